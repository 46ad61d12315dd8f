"""Test plumbing (not shipped in the wheel): the shared server, a TCP proxy, netns links.

``tests/`` is on ``sys.path`` while pytest runs (the root ``conftest.py`` lives there), so
tests import ``support.proxy`` and friends; the benchmarks put ``tests/`` on the path
themselves (``benchmarks/_common.py``).

- :mod:`support.server`: the test-DSN chain (``resolve_test_dsn``), ``probe_server``,
  ``dsn_to_url``, ``one_row``, ``lock_holders``, ``backend_gone``.
- :mod:`support.proxy`: ``TcpProxy``, a proxy that can stall (black-hole) or cut.
- :mod:`support.netns`: ``NetnsLink``, a namespace whose link can be cut silently.
- :mod:`support.poll`: ``eventually`` (async) and ``eventually_sync``, a bounded wait for
  a condition.
- :mod:`support.timings`: ``timings(...)``, short lock timings, and ``FAULT_TIMINGS``.
- :mod:`support.locks`: ``kept``, locks shut down after a test, ``fake_locks``, locks
  on the in-memory server, ``another_holds`` (a session of that server holding the lock)
  and ``leading`` (a lock started and leading).
- :mod:`support.flaky`: ``Flaky``, a job that crashes on its first calls, then runs.
- :mod:`support.belief_spans`: ``log_with``, a belief log written by hand.
- :mod:`support.started`: ``Started``, a base for plumbing used in a ``with`` block.
- :mod:`support.child`: the skeleton of a worker process (``stdin_commands``,
  ``watch_stdin``).
- :mod:`support.replication`: ``PrimaryStandby``, a primary with a streaming standby
  (two throwaway clusters), and ``multi_host_dsn``.
- :mod:`support.blackhole`: ``BlackHole``, a listener that never answers a byte.
- :mod:`support.fenced`: ``FencedWorker``, a child process that leads a fencing lock and
  runs fenced transactions (``tests/faults/fenced_worker.py``).
- :mod:`support.pgbouncer`: ``PgBouncer``, a real PgBouncer in any pool mode (its
  fixtures: ``tests/fix_pgbouncer.py``, a ``pytest_plugins`` module of the root
  ``conftest.py``).
- :mod:`support.chromium`: Debian's Chromium for Playwright (``require_chromium``,
  ``launch_options``: headless, loopback only), for tests/docs and tests/dashboard.
- :mod:`support.dashboard`: a dashboard served on a thread (``served``), pages
  following its events (``event_clients_of``), ``own_database``, ``dashboard_sessions``.
- :mod:`support.answering`: ``free_port`` and ``first_answer``, for a server a test
  starts in a process of its own.
"""
