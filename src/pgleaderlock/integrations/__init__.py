"""Framework integrations, each behind its own extra.

- [`pgleaderlock.integrations.fastapi`][pgleaderlock.integrations.fastapi] (extra
  ``fastapi``): a lifespan that runs a [`LeaderLock`][pgleaderlock.LeaderLock] with the app,
  leader-only background tasks, a leadership status route; ``GroupLifespan``: several
  leader-only tasks spread over the replicas by a [`Coordinator`][pgleaderlock.Coordinator].
- [`pgleaderlock.integrations.apscheduler`][pgleaderlock.integrations.apscheduler] (extra
  ``apscheduler``, APScheduler 3.x): singleton jobs across replicas, per job
  (``leader_only``) or per scheduler (``bind_scheduler``), or spread over the replicas
  by a coordinator (``owned_only``).
- [`pgleaderlock.integrations.django`][pgleaderlock.integrations.django] (extra
  ``django``): an app that takes its database from ``DATABASES``, locks configured in
  ``settings.py``, ``manage.py pgleaderlock_singleton`` (a management command on one
  replica) and ``manage.py pgleaderlock_status``.
- [`pgleaderlock.integrations.celery`][pgleaderlock.integrations.celery] (extra
  ``celery``): Celery beat on every replica, only the leader sends, each send claimed in
  the schedule ledger first (``LeaderScheduler``; ``LeaderDatabaseScheduler`` for
  django-celery-beat).

What they are built on needs no extra and is imported from `pgleaderlock`:
[`LeaderTasks`][pgleaderlock.LeaderTasks] (coroutines that run only while a lock is LEADER, for
any asyncio program) and [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock] (a lock in its own
thread, for code without an event loop).

The rule every integration follows: leader-only work runs only while the lock's state is
LEADER. It stops the moment the lock leaves LEADER (to RECONNECTING, FOLLOWER,
RELEASING or STOPPED), because exclusivity is no longer guaranteed then, and it may
start again when the lock is LEADER again. With a coordinator, the same holds per name:
work runs only while this replica leads the work's name.
"""
