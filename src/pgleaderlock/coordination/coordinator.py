"""``Coordinator``: many named workers across replicas, each name run by exactly one
replica at a time, balanced, with fenced checkpoints."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, Self

from ..core import (
    DEFAULT_SCHEMA,
    ConfigurationError,
    RetryStrategy,
    SessionFactory,
    check_give_away,
    check_retry_strategy,
    connection_target,
    default_retry_strategy,
    lock_config,
    positive,
)
from .dedicated import DedicatedEngine
from .member import Engine, GroupView, Settings
from .protocol import check_group, name_keys, new_member_id
from .shared import SharedEngine
from .workers import CheckpointTable, WorkerFunction

__all__ = ["Coordinator"]

Sessions = Literal["dedicated", "shared"]

# LeaderLock arguments a Coordinator passes on (dedicated sessions) or applies itself.
_LOCK_KNOBS = frozenset({
    "health_interval_s", "health_timeout_s", "reconnect_grace_s", "connect_timeout_s",
    "command_timeout_s", "tcp_user_timeout_s", "follower_mode", "load_plugins",
    "retry_permanent_errors", "acquire_delay_s", "backend", "lease_s", "fencing_grace_s",
    "drain_s", "escalate_after_s",
})  # fmt: skip
_CONFIG_KNOBS = _LOCK_KNOBS - {"load_plugins", "backend"}  # lock_config()'s, with its defaults


class Coordinator:
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
        fencing: keep a fencing term per name (see
            [`LeaderLock`][pgleaderlock.LeaderLock]'s ``fencing``); needed for
            [`WorkerContext.fence`][pgleaderlock.WorkerContext.fence] and checkpoints.
        checkpoint_table: the table of checkpoints (created if missing with fencing).
        give_away_after_crashes: after this many crashes in a row, a worker's name is
            released for another replica (``None``: never; the worker is restarted).
        give_away_cooldown_s: how long a replica leaves a name it gave away to others.
        balance_interval_s: how often an unsettled group looks at its balance again.
        idle_tick_s: how often a settled group checks itself (a safety net: changes
            are notified at once).
        retry_strategy: delays between worker restarts and reconnections; default as
            for ``LeaderLock``.
        connect_fn: as for ``LeaderLock``; called for each session.
        fencing_table: the table of fencing terms.
        fencing_schema: the schema of the library's tables (terms and checkpoints;
            default ``public``): always named in statements, never found through
            ``search_path``.
        trusted_roles: roles trusted besides the sessions' own role and superusers: the
            owners of the library's tables and their schema, and the group's members
            (sessions and messages of other roles are not a member's).
        **lock_knobs: other ``LeaderLock`` arguments: ``health_interval_s``,
            ``health_timeout_s``, ``connect_timeout_s``, ``command_timeout_s``,
            ``tcp_user_timeout_s``, ``lease_s``, ``fencing_grace_s``, ``drain_s``,
            ``escalate_after_s``, ``backend``, ``reconnect_grace_s``, ``follower_mode``,
            ``load_plugins``, ``retry_permanent_errors``, and ``acquire_delay_s``
            (dedicated sessions' names). They hold for every lock of the member: a name's (dedicated
            sessions) and the member's own lock, a ``LeaderLock`` too, whose session is
            the util session with dedicated sessions and the hold session with shared
            ones (which holds the names). The lease holds for every session that holds a
            lock.

    Raises:
        ConfigurationError: bad input, before any I/O.
    """

    def __init__(
        self,
        dsn: Any = None,
        *,
        group: str,
        sessions: Sessions = "dedicated",
        fencing: bool = False,
        checkpoint_table: str = "pgleaderlock_subscriptions",
        give_away_after_crashes: int | None = None,
        give_away_cooldown_s: float = 60.0,
        balance_interval_s: float = 0.5,
        idle_tick_s: float = 10.0,
        retry_strategy: RetryStrategy | None = None,
        connect_fn: SessionFactory | None = None,
        fencing_table: str = "pgleaderlock_terms",
        fencing_schema: str = DEFAULT_SCHEMA,
        trusted_roles: Sequence[str] = (),
        **lock_knobs: Any,
    ) -> None:
        unknown = set(lock_knobs) - _LOCK_KNOBS
        if unknown:
            raise ConfigurationError(f"unknown Coordinator arguments: {', '.join(sorted(unknown))}")
        if sessions not in ("dedicated", "shared"):
            raise ConfigurationError(f"sessions must be 'dedicated' or 'shared', got {sessions!r}")
        check_give_away(give_away_after_crashes)
        backend_name = lock_knobs.get("backend")
        # The fencing knobs: for the member's settings and every lock of the member.
        fencing_knobs = {
            "fencing": fencing,
            "fencing_table": fencing_table,
            "fencing_schema": fencing_schema,
        }
        config = lock_config(
            **{knob: lock_knobs[knob] for knob in _CONFIG_KNOBS & set(lock_knobs)},
            **fencing_knobs,
            auto_reacquire=True,
            trusted_roles=trusted_roles,
        )
        backend, driver_dsn, config = connection_target(backend_name, dsn, connect_fn, config)
        check_retry_strategy(retry_strategy)
        passed = {
            **lock_knobs,
            **fencing_knobs,
            "trusted_roles": config.trusted_roles,
            "retry_strategy": retry_strategy,
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
            checkpoints=CheckpointTable(checkpoint_table, fencing_schema, config.trusted_roles),
            give_away_after_crashes=give_away_after_crashes,
            give_away_cooldown_s=positive("give_away_cooldown_s", give_away_cooldown_s),
            balance_interval_s=positive("balance_interval_s", balance_interval_s),
            idle_tick_s=positive("idle_tick_s", idle_tick_s),
            lock_kwargs=passed if connect_fn is None else {**passed, "connect_fn": connect_fn},
        )
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

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

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
    def group(self) -> str:
        return self._settings.group

    @property
    def member(self) -> str:
        """This replica's id in the group (new at every process start)."""
        return self._settings.member

    @property
    def sessions(self) -> Sessions:
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
        return self._engine.moves

    def view(self) -> GroupView:
        """Who leads what in the group, as of this replica's last look (at most
        ``idle_tick_s`` old; every change it is told of refreshes it)."""
        return self._engine.view

    def __repr__(self) -> str:
        return (
            f"<Coordinator group={self.group!r} member={self.member} sessions={self._sessions}"
            f" names={len(self.names)} owned={len(self.owned)}>"
        )
