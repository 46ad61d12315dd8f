"""``Coordinator``: many named workers across replicas, each name run by exactly one
replica at a time, balanced, with fenced checkpoints."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal, Unpack

from ..lowlevel import (
    DEPRECATED_KEYWORDS,
    ConfigurationError,
    DeprecatedOptions,
    LockOptions,
    Participation,
    RetryStrategy,
    Service,
    SessionFactory,
    check_give_away,
    check_options,
    check_retry_strategy,
    connection_target,
    default_retry_strategy,
    lock_config,
    merge_deprecated,
    old_keywords,
    positive,
)
from .dedicated import DedicatedEngine
from .member import Engine, GroupView, Settings
from .protocol import check_group, name_keys, new_member_id
from .shared import SharedEngine
from .workers import CheckpointTable, WorkerFunction

__all__ = ["Coordinator"]

Sessions = Literal["dedicated", "shared"]


class Coordinator(Service):
    """Named workers, run by the replicas of one group: each name by exactly one replica
    at a time, spread evenly over the replicas, taken over when its replica dies.

    A group is a namespace: a name's lock is
    [`lock_keys("<group>:<name>")`][pgleaderlock.lock_keys], the same lock as
    ``LeaderLock.from_name("<group>:<name>")``, and its checkpoint row is
    ``<group>:<name>``: two groups that register the same name never share its lock,
    term or checkpoint.

    Args:
        dsn: as for [`LeaderLock`][pgleaderlock.LeaderLock]; ``None`` with ``connect_fn``.
        group: the group's name (1-32 letters, digits, ``_``, ``.``, ``-``); the
            replicas of a service use the same one. They find each other through
            ``pg_stat_activity`` and ``pg_locks``, and talk with ``NOTIFY``.
        sessions: ``"dedicated"`` (default): a session per name led, a
            [`LeaderLock`][pgleaderlock.LeaderLock] each, and one standby per name on
            another replica, waiting on the server (about two sessions per name for the
            group, plus three per replica); for tens of names. ``"shared"``: every name
            this replica leads is held by one session (three sessions per replica in
            all, whatever the number of names); losing that session loses all its names
            at once.
        checkpoint_table: the table of checkpoints (created if missing with fencing),
            in the schema of ``options.fencing``.
        give_away_after_crashes: after this many crashes in a row, a worker's name is
            released for another replica (``None``: never; the worker is restarted).
        give_away_cooldown_s: how long a replica leaves a name it gave away to others.
        balance_interval_s: how often an unsettled group looks at its balance again.
        idle_tick_s: how often a settled group checks itself (a safety net: changes
            are notified at once).
        retry_strategy: delays between worker restarts and reconnections; default as
            for ``LeaderLock``.
        connect_fn: as for ``LeaderLock``; called for each session.
        health_interval_s: as for ``LeaderLock``, for every lock of the member.
        reconnect_grace_s: as for ``LeaderLock``, for every lock of the member.
        options: [`LockOptions`][pgleaderlock.LockOptions] for every lock of the member:
            a name's (dedicated sessions) and the member's own lock, a ``LeaderLock``
            too, whose session is the util session with dedicated sessions and the hold
            session with shared ones (which holds the names). Its
            [`Fencing`][pgleaderlock.Fencing] keeps a term per name (needed for
            [`WorkerContext.fence`][pgleaderlock.WorkerContext.fence] and checkpoints;
            ``acquire_delay_s`` is for dedicated sessions' names), its ``schema`` holds
            the checkpoints too; ``trusted_roles`` also says whose sessions and
            messages are the group's members. The lease holds for every session that
            holds a lock. Its [`Participation`][pgleaderlock.Participation] must stay
            the default (a group's names publish nothing of their own).
        **deprecated: the flat keywords of 0.1 (``fencing=``, ``lease_s=``, ...), as for
            ``LeaderLock``, with a ``DeprecationWarning``.

    Raises:
        ConfigurationError: bad input, before any I/O.
    """

    def __init__(
        self,
        dsn: Any = None,
        *,
        group: str,
        sessions: Sessions = "dedicated",
        checkpoint_table: str = "pgleaderlock_subscriptions",
        give_away_after_crashes: int | None = None,
        give_away_cooldown_s: float = 60.0,
        balance_interval_s: float = 0.5,
        idle_tick_s: float = 10.0,
        retry_strategy: RetryStrategy | None = None,
        connect_fn: SessionFactory | None = None,
        health_interval_s: float = 5.0,
        reconnect_grace_s: float | None = None,
        options: LockOptions | None = None,
        **deprecated: Unpack[DeprecatedOptions],
    ) -> None:
        unknown = set(deprecated) - set(DEPRECATED_KEYWORDS)
        if unknown:  # a ConfigurationError, as in 0.1 (not Python's TypeError)
            raise ConfigurationError(f"unknown Coordinator arguments: {', '.join(sorted(unknown))}")
        if deprecated:
            options = merge_deprecated(options, deprecated, owner="Coordinator")
        opts = check_options(options)
        if opts.participation != Participation():
            raise ConfigurationError(
                "a Coordinator's options take no Participation: its names publish nothing "
                "of their own"
            )
        if opts.session.application_name is not None:
            raise ConfigurationError(
                "a Coordinator names its sessions itself (Session.application_name): "
                "pgl:<group>:<member>:<role> shows them in pg_stat_activity"
            )
        if sessions not in ("dedicated", "shared"):
            raise ConfigurationError(f"sessions must be 'dedicated' or 'shared', got {sessions!r}")
        check_give_away(give_away_after_crashes)
        config = lock_config(
            opts,
            health_interval_s=health_interval_s,
            reconnect_grace_s=reconnect_grace_s,
            auto_reacquire=True,
        )
        backend, driver_dsn, config = connection_target(
            opts.session.backend, dsn, connect_fn, config
        )
        check_retry_strategy(retry_strategy)
        # What every lock of the member is made with. The engines pass these on as the
        # flat keywords (the member lock overrides some of them), which
        # ``options_from_keywords`` reads back; always with the fencing settings.
        passed: dict[str, Any] = {
            **old_keywords(opts),
            "fencing": opts.fencing.enabled,
            "fencing_table": opts.fencing.table,
            "fencing_schema": opts.fencing.schema,
            "trusted_roles": config.trusted_roles,
            "retry_strategy": retry_strategy,
            "health_interval_s": health_interval_s,
            "reconnect_grace_s": reconnect_grace_s,
        }
        self._settings = Settings(
            group=check_group(group),
            member=new_member_id(),
            config=config,
            retry=retry_strategy or default_retry_strategy(),
            backend=backend,
            dsn=driver_dsn,
            user_dsn=dsn,
            connect_fn=connect_fn,
            checkpoints=CheckpointTable(
                checkpoint_table, opts.fencing.schema, config.trusted_roles
            ),
            give_away_after_crashes=give_away_after_crashes,
            give_away_cooldown_s=positive("give_away_cooldown_s", give_away_cooldown_s),
            balance_interval_s=positive("balance_interval_s", balance_interval_s),
            idle_tick_s=positive("idle_tick_s", idle_tick_s),
            lock_kwargs=passed if connect_fn is None else {**passed, "connect_fn": connect_fn},
        )
        self._options = opts
        engine: type[Engine] = DedicatedEngine if sessions == "dedicated" else SharedEngine
        self._engine = engine(self._settings)
        self._sessions: Sessions = sessions

    # ------------------------------------------------------------------ workers

    def worker(self, name: str) -> Callable[[WorkerFunction], WorkerFunction]:
        """Decorator: register ``fn(ctx)`` as the worker of ``name``."""

        def register(fn: WorkerFunction) -> WorkerFunction:
            self.add(name, fn)
            return fn

        return register

    def add(self, name: str, fn: WorkerFunction) -> None:
        """Register ``fn(ctx)`` as the worker of ``name``; after ``start()`` the
        coordinator competes for the name at once.

        Raises:
            ConfigurationError: ``fn`` is not a coroutine function, or ``name`` is
                already registered here.
        """
        name_keys(self.group, name)  # validates the name
        if not inspect.iscoroutinefunction(fn):
            raise ConfigurationError(f"a worker must be an async function, got {fn!r}")
        if name in self._engine.functions:
            raise ConfigurationError(f"a worker named {name!r} is already registered")
        self._engine.register(name, fn)

    async def remove(self, name: str) -> None:
        """Unsubscribe ``name`` on this replica: stop its worker and release its lock at
        once (another replica that registered it takes it); do nothing if unknown."""
        if name in self._engine.functions:
            await self._engine.unregister(name)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open the sessions and compete for every registered name. Idempotent."""
        await self._engine.start()

    async def shutdown(self) -> None:
        """Stop every worker, release every name, close the sessions. Idempotent."""
        await self._engine.stop()

    # ------------------------------------------------------------------ state

    @property
    def started(self) -> bool:
        """True from ``start()`` until ``shutdown()``, or until an error retrying cannot
        mend stops the coordinator (see `stop_error`)."""
        return self._engine.running

    @property
    def stop_error(self) -> BaseException | None:
        """The error that stopped the coordinator (authentication, configuration: what
        stops a ``LeaderLock`` for good), or ``None``; ``start()`` raises it too."""
        return self._engine.error

    @property
    def options(self) -> LockOptions:
        """The [`LockOptions`][pgleaderlock.LockOptions] of the member's locks."""
        return self._options

    @property
    def group(self) -> str:
        """The group's name (``group=``): the same in every replica of the service."""
        return self._settings.group

    @property
    def member(self) -> str:
        """This replica's id in the group (new at every process start)."""
        return self._settings.member

    @property
    def sessions(self) -> Sessions:
        """How the names' locks are held (``sessions=``): ``"dedicated"``, a session per
        name led, or ``"shared"``, one session for every name this replica leads."""
        return self._sessions

    @property
    def names(self) -> frozenset[str]:
        """The names registered here."""
        return frozenset(self._engine.functions)

    @property
    def owned(self) -> frozenset[str]:
        """The names this replica leads now (their workers run here)."""
        return self._engine.owned

    @property
    def running(self) -> frozenset[str]:
        """The names whose worker runs here now."""
        return self._engine.workers.running

    @property
    def moves(self) -> int:
        """How many names this replica has handed to other replicas so far, to even
        out the group (the group's moves are the sum over its replicas)."""
        return self._engine.balancer.moves

    def view(self) -> GroupView:
        """Who leads what in the group, as of this replica's last look (at most
        ``idle_tick_s`` old; every change it is told of refreshes it)."""
        return self._engine.membership.view

    def __repr__(self) -> str:
        return (
            f"<Coordinator group={self.group!r} member={self.member} sessions={self._sessions}"
            f" names={len(self.names)} owned={len(self.owned)}>"
        )
