"""What the commands that hold the lock (``run``, ``acquire``, ``exec``) share.

- `build_lock`: the [`LeaderLock`][pgleaderlock.LeaderLock] for the options, with a
  `Tracker` registered and the retry policy wrapped in `FailFast`;
- `preflight`: one session opened and closed first, so that an unreachable server is a clear
  one-line error rather than a lock that retries;
- `Signals` (SIGTERM and SIGINT, queued) and `first` (race awaitables);
- `lead`: wait until the lock leads, or say why not (held elsewhere, a signal, an error);
- `permanent_error`: the one line for an error that retrying cannot mend (the server
  refused this client, a transaction-mode pooler, bad configuration): the lock stops on
  it, and every command exits 2 with that line.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from ..lowlevel import (
    LeaderLock,
    PgLeaderLockError,
    RetryStrategy,
    driver_dsn,
    is_permanent,
    lock_arguments,
)
from .exits import CliError, first_line, signal_exit
from .logs import log
from .options import Common
from .retry import Deadline, FailFast
from .tracker import Tracker

__all__ = [
    "Signals",
    "build_lock",
    "contend",
    "first",
    "lead",
    "not_acquired_error",
    "permanent_error",
    "preflight",
]


def build_lock(
    common: Common, retry_strategy: RetryStrategy, **options: Any
) -> tuple[LeaderLock, Tracker]:
    """The lock for ``common``, retrying with ``retry_strategy`` (behind `FailFast`).

    Args:
        common: the lock, database and connection options.
        retry_strategy: the command's retry policy (see `pgleaderlock.cli.retry`).
        **options: other [`LeaderLock`][pgleaderlock.LeaderLock] settings, flat (the
            specification's arguments, and the fields of the option groups by their
            0.1 keywords: ``fencing``, ``drain_s``, ...; see ``core.lock_arguments``).

    Returns:
        The lock, and the tracker registered on it.

    Raises:
        CliError: the lock refused the options (keys, intervals, backend, DSN).
    """
    tracker = Tracker()
    target = common.target
    try:
        lock = LeaderLock(
            common.dsn,
            target.key1,
            target.key2,
            name=target.name,
            retry_strategy=FailFast(retry_strategy, tracker),
            **lock_arguments(
                {
                    "backend": common.backend,
                    "connect_timeout_s": common.connect_timeout_s,
                    **options,
                }
            ),
        )
    except PgLeaderLockError as exc:
        raise CliError(str(exc)) from None
    lock.plugins.register(tracker)
    return lock, tracker


async def preflight(common: Common, lock: LeaderLock) -> None:
    """Open (and close) one session, so that an unreachable server is a clear error.

    Raises:
        CliError: the server cannot be reached within ``--connect-timeout``, or it refused
            this client (see `permanent_error`).
    """
    backend = lock.backend  # resolved once, by the lock
    assert backend is not None, "the CLI's locks open sessions through a backend"
    dsn = driver_dsn(backend, common.dsn, named=common.backend is not None)
    try:
        async with asyncio.timeout(common.connect_timeout_s):
            session = await backend.connect(dsn, lock.connect_options)
    except TimeoutError:
        raise CliError(
            f"cannot connect to the database: no answer within "
            f"{common.connect_timeout_s:g} s; DSN: {common.dsn}"
        ) from None
    except Exception as exc:
        if is_permanent(exc):
            raise permanent_error(common, exc) from None
        raise CliError(
            f"cannot connect to the database: {first_line(exc)}; DSN: {common.dsn}"
        ) from None
    await session.close()


def permanent_error(common: Common, error: BaseException) -> CliError:
    """The one-line error (exit 2) for an error that retrying cannot mend.

    [`ServerRefusedError`][pgleaderlock.ServerRefusedError] (authentication failed, unknown
    role or database), [`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError]
    (a transaction- or statement-mode pooler) or
    [`ConfigurationError`][pgleaderlock.ConfigurationError]: the lock stops on them, so the
    command ends at once instead of retrying, and the line names the error's type.
    """
    return CliError(
        f"permanent error, not retried: {type(error).__name__}: {first_line(error)}; "
        f"DSN: {common.dsn}"
    )


def not_acquired_error(common: Common, lock: LeaderLock) -> CliError:
    """The error for a lock that stopped without leading and without finding it taken."""
    error = lock.statistics().last_error
    if error is None:
        return CliError("the lock stopped before it could be acquired")
    return CliError(f"could not acquire the lock: {first_line(error)}; DSN: {common.dsn}")


class Signals:
    """SIGTERM and SIGINT handlers for the life of a command; signals are queued."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._pending: list[signal.Signals] = []
        self._event = asyncio.Event()

    def __enter__(self) -> Signals:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            loop.remove_signal_handler(sig)

    def _received(self, sig: signal.Signals) -> None:
        self._pending.append(sig)
        self._event.set()

    async def wait(self) -> None:
        """Return once a signal is pending (does not consume it)."""
        await self._event.wait()

    def take(self) -> list[signal.Signals]:
        """The pending signals, oldest first; clears them."""
        pending, self._pending = self._pending, []
        self._event.clear()
        return pending


async def first(**awaitables: Awaitable[Any]) -> tuple[str, Any]:
    """Wait for the first of ``awaitables`` (in keyword order on a tie); cancel the rest.

    Returns:
        The keyword of the one that finished, and its result.
    """
    tasks = {name: asyncio.ensure_future(aw) for name, aw in awaitables.items()}
    try:
        await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks.values():
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
    for name, task in tasks.items():
        if task.done() and not task.cancelled():
            return name, task.result()
    raise AssertionError("asyncio.wait returned without a finished task")  # pragma: no cover


async def lead(
    common: Common,
    lock: LeaderLock,
    signals: Signals,
    *,
    held_exit_code: int,
    event: str,
    on_signal: str,
) -> int | None:
    """Wait until ``lock`` leads: None then, else the exit code that says why not.

    Args:
        common: the command's options (the DSN for an error message).
        lock: the started lock.
        signals: a signal ends the wait with 128+N.
        held_exit_code: the exit code when the lock is held elsewhere.
        event: the name of the log line for "held elsewhere".
        on_signal: what the log line for a signal says is done about it.

    Raises:
        CliError: the attempt failed for another reason than "held elsewhere"; the lock
            stopped on an error that retrying cannot mend (see `permanent_error`).
    """
    try:
        which, leader = await first(leader=lock.wait_for_leadership(), signal=signals.wait())
    except PgLeaderLockError as exc:  # the lock stopped on a permanent error
        raise permanent_error(common, exc) from None
    if which == "signal":
        sig = signals.take()[0]
        log("INFO", "signal_received", signal=sig.name, action=on_signal, lock=lock.label)
        return signal_exit(sig)
    if leader:
        return None
    if lock.statistics().failed_attempts:
        log(
            "INFO",
            event,
            lock=lock.label,
            reason="the lock is held elsewhere",
            exit_code=held_exit_code,
        )
        return held_exit_code
    raise not_acquired_error(common, lock)


async def contend(
    common: Common,
    lock: LeaderLock,
    deadline: Deadline,
    *,
    held_exit_code: int,
    event: str,
    on_signal: str,
    then: Callable[[Signals], Awaitable[int]],
) -> int:
    """The one try of ``acquire`` and ``exec``: check the server, start ``deadline`` and
    the lock, wait until it leads (see `lead`, which takes the keyword arguments), and then
    do the command's work, ``then(signals)``, while it leads.

    Returns:
        The exit code of ``then``, or the one that says why the lock did not lead. The lock
            is shut down (which releases it) before this returns.
    """
    await preflight(common, lock)
    with Signals() as signals:
        deadline.start()
        async with lock:
            refused = await lead(
                common, lock, signals, held_exit_code=held_exit_code,
                event=event, on_signal=on_signal,
            )  # fmt: skip
            if refused is not None:
                return refused
            return await then(signals)
