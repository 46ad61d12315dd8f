"""The ``pgleaderlock`` command line (spec §9): ``run``, ``acquire``, ``exec``, ``status``.

Install it with ``pip install 'pgleaderlock[cli]'`` (click and loguru). Every command
works on one lock, named with ``--name`` (keys derived by :func:`~pgleaderlock.lock_keys`)
or given as ``--key1``/``--key2``; the database comes from ``--dsn`` or ``$PG_DSN``.

The library logs on the stdlib logger ``pgleaderlock``; the CLI routes that logger into
loguru (:class:`InterceptHandler`, spec §9.2) and writes every line to stderr, so that
stdout belongs to ``status`` output and to the command that ``exec`` runs.

Exit codes (also in ``pgleaderlock --help``):

==== ===================================================================================
0    success; ``run`` stopped by SIGTERM/SIGINT (lock released)
1    ``acquire``: the lock is held elsewhere; ``run``: the lock stopped by itself
2    bad input (no DSN, malformed DSN, keys out of range, ...) or unreachable server
75   ``exec``: the lock is held elsewhere, COMMAND was not run (EX_TEMPFAIL;
     ``--held-exit-code`` changes it)
76   ``exec``/``acquire --hold``: leadership was lost; COMMAND was terminated
126  ``exec``: COMMAND cannot be executed; 127: COMMAND not found
128+N killed by / stopped on signal N before COMMAND ran (130 SIGINT, 143 SIGTERM)
==== ===================================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import math
import os
import re
import shlex
import signal
import sys
import time
import types
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

try:
    import click
    from loguru import logger
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"the pgleaderlock command line needs click and loguru ({exc}); "
        "install them with: pip install 'pgleaderlock[cli]'"
    ) from exc

import psycopg
from psycopg.conninfo import conninfo_to_dict

if TYPE_CHECKING:
    from loguru import Record

from .. import __version__
from ..backends import resolve as resolve_backend
from ..core._logging import format_event, mask_dsn
from ..core.errors import ConfigurationError, PgLeaderLockError, SessionNotDedicatedError
from ..core.hooks import hookimpl
from ..core.keys import check_key, lock_keys
from ..core.lock import LeaderLock
from ..core.models import LockState, RetryContext
from ..core.retry import ExponentialBackoff, RetryStrategy

__all__ = [
    "EXIT_CANNOT_EXECUTE",
    "EXIT_HELD",
    "EXIT_LOST",
    "EXIT_NOT_ACQUIRED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_USAGE",
    "InterceptHandler",
    "cli",
    "main",
]

EXIT_OK = 0
EXIT_NOT_ACQUIRED = 1
EXIT_USAGE = 2
EXIT_HELD = 75  # EX_TEMPFAIL from sysexits.h: "try again later"
EXIT_LOST = 76
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127

F = TypeVar("F", bound=Callable[..., Any])

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> | <level>{level: <7}</level> | "
    "<cyan>{extra[logger]}</cyan> | {message}"
)
_CLI_LOGGER = "pgleaderlock.cli"
_WAIT_CHUNK_S = 5.0  # --wait: longest single wait on the server (one acquire attempt)
_PR_SET_PDEATHSIG = 1


class CliError(click.ClickException):
    """A one-line error for the user; the command exits with ``exit_code`` (2).

    Passwords are masked. Messages put a DSN last: a masked ``password=***`` swallows
    what follows it up to the next space.
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(mask_dsn(message).split()))
        ctx = click.get_current_context(silent=True)
        self.where = ctx.command_path if ctx is not None else "pgleaderlock"


# ---------------------------------------------------------------------- logging


class InterceptHandler(logging.Handler):
    """Routes stdlib log records (the library's ``pgleaderlock`` logger) into loguru."""

    def emit(self, record: logging.LogRecord) -> None:
        """Re-emit ``record`` through loguru, keeping its level and caller."""
        level: str | int
        try:
            level = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        frame: types.FrameType | None = logging.currentframe()
        depth = 2
        while frame is not None and frame.f_code.co_filename == logging.__file__:
            frame = frame.f_back
            depth += 1
        # The library's structured fields ride along for --log-json consumers.
        fields = getattr(record, "pgleaderlock", None)
        logger.bind(logger=record.name, pgleaderlock=fields).opt(
            depth=depth, exception=record.exc_info
        ).log(level, record.getMessage())


def configure_logging(
    level: str, *, library_level: str | None = None, json_lines: bool = False
) -> None:
    """Send the ``pgleaderlock`` stdlib logger and the CLI's own lines to stderr via loguru.

    Args:
        level: threshold of the CLI's own lines: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``.
        library_level: threshold of the library's lines (the stdlib logger); default
            ``level``.
        json_lines: one JSON object per line (loguru's ``serialize``) instead of text.
    """
    library_level = library_level or level
    stdlib = logging.getLogger("pgleaderlock")
    stdlib.handlers = [InterceptHandler()]
    stdlib.propagate = False
    stdlib.setLevel(library_level)  # the library's lines are filtered here
    cli_threshold = logger.level(level).no

    def keep(record: Record) -> bool:
        return bool(
            record["extra"].get("logger") != _CLI_LOGGER or record["level"].no >= cli_threshold
        )

    logger.remove()
    logger.configure(extra={"logger": _CLI_LOGGER})
    # diagnose=False: tracebacks must not print local variables (a DSN with a password).
    logger.add(
        sys.stderr,
        level=min(cli_threshold, logger.level(library_level).no),
        format=_FORMAT,
        filter=keep,
        serialize=json_lines,
        backtrace=False,
        diagnose=False,
    )


def _log(level: str, event: str, /, **fields: object) -> None:
    """Log ``event key=value ...`` in the library's style (fields also in ``extra``)."""
    logger.bind(pgleaderlock={"name": event, **fields}).opt(depth=1).log(
        level, format_event(event, fields)
    )


def _level(base: str, verbose: int, quiet: int) -> str:
    index = _LEVELS.index(base) - verbose + quiet
    return _LEVELS[min(max(index, 0), len(_LEVELS) - 1)]


def _setup_logging(cli: str, library: str, verbose: int, quiet: int, json_lines: bool) -> None:
    """Each ``-v`` lowers both thresholds one step (WARNING -> INFO -> DEBUG); ``-q``
    raises them."""
    configure_logging(
        _level(cli, verbose, quiet),
        library_level=_level(library, verbose, quiet),
        json_lines=json_lines,
    )


# ---------------------------------------------------------------------- options


@dataclass(frozen=True)
class Target:
    """The lock a command works on."""

    name: str | None
    key1: int
    key2: int

    @property
    def label(self) -> str:
        """The name, or ``key1,key2``."""
        return self.name if self.name is not None else f"{self.key1},{self.key2}"


@dataclass(frozen=True)
class Common:
    """Options shared by ``run``, ``acquire`` and ``exec``."""

    dsn: str
    target: Target
    backend: str | None
    connect_timeout_s: float


def _resolve_dsn(dsn: str | None) -> str:
    if dsn is None or not dsn.strip():
        raise CliError("no DSN: pass --dsn or set PG_DSN (e.g. postgresql://user@host/db)")
    return dsn


def _resolve_target(name: str | None, key1: int | None, key2: int | None) -> Target:
    if name is not None and (key1 is not None or key2 is not None):
        raise CliError("name the lock with either --name or --key1/--key2, not both")
    if name is not None:
        try:
            key1, key2 = lock_keys(name)
        except ConfigurationError as exc:
            raise CliError(str(exc)) from None
        return Target(name, key1, key2)
    if key1 is None and key2 is None:
        raise CliError("which lock? pass --name NAME, or --key1 K1 --key2 K2")
    if key1 is None or key2 is None:
        raise CliError("--key1 and --key2 go together (or use --name)")
    try:
        return Target(None, check_key("--key1", key1), check_key("--key2", key2))
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None


def _positive(option: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise CliError(f"{option} must be a positive number of seconds, got {value:g}")
    return value


def _target_options(f: F) -> F:
    options = [
        click.option(
            "--dsn",
            envvar="PG_DSN",
            show_envvar=True,
            metavar="DSN",
            help="PostgreSQL connection string (URL or key=value). Prefer $PG_DSN or "
            "~/.pgpass to a password on the command line. A postgresql+DRIVER:// "
            "scheme selects the backend.",
        ),
        click.option(
            "--name",
            metavar="NAME",
            help="Lock name; the keys are derived from it exactly as "
            "('x'||substr(md5(NAME),1,8))::bit(32)::int and (…,9,8) in SQL.",
        ),
        click.option("--key1", type=int, metavar="INT", help="Advisory lock key 1 (int4)."),
        click.option("--key2", type=int, metavar="INT", help="Advisory lock key 2 (int4)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _log_options(f: F) -> F:
    options = [
        click.option("-v", "--verbose", count=True, help="More log output (repeat for debug)."),
        click.option("-q", "--quiet", count=True, help="Less log output."),
        click.option("--log-json", is_flag=True, help="Log one JSON object per line (to stderr)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _lock_options(f: F) -> F:
    options = [
        click.option(
            "--backend",
            metavar="NAME",
            help="Driver backend (psycopg, asyncpg, sqlalchemy); default from the DSN "
            "scheme, else psycopg.",
        ),
        click.option(
            "--connect-timeout",
            type=float,
            default=5.0,
            show_default=True,
            metavar="SECONDS",
            help="Timeout for opening a database session.",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return _target_options(f)


def _common(
    dsn: str | None,
    name: str | None,
    key1: int | None,
    key2: int | None,
    backend: str | None,
    connect_timeout: float,
) -> Common:
    return Common(
        dsn=_resolve_dsn(dsn),
        target=_resolve_target(name, key1, key2),
        backend=backend,
        connect_timeout_s=_positive("--connect-timeout", connect_timeout),
    )


# ---------------------------------------------------------------------- lock plumbing


class _Tracker:
    """A plugin that tells the CLI what the lock is doing."""

    def __init__(self) -> None:
        self.reached_server = False  # a session was opened at least once
        self.held_elsewhere = 0  # attempts that found the lock taken
        self.errors: list[Exception] = []
        self.lost = asyncio.Event()
        self.stopped = asyncio.Event()
        self._busy = False

    @hookimpl
    def pgleaderlock_state_change(self, new: LockState) -> None:
        """Note that the server was reached (an attempt only starts on an open session)."""
        if new is LockState.ACQUIRING:
            self.reached_server = True

    @hookimpl
    def pgleaderlock_acquire_failed(self, lock: LeaderLock, attempt: int) -> None:
        """Log the first attempt of a series that found the lock taken (the rest: debug)."""
        self.held_elsewhere += 1
        level = "DEBUG" if self._busy else "INFO"
        self._busy = True
        _log(level, "lock_busy", lock=_label(lock), attempt=attempt, holder="another session")

    @hookimpl
    def pgleaderlock_acquired(self) -> None:
        """Reset the busy series."""
        self._busy = False

    @hookimpl
    def pgleaderlock_error(self, error: Exception) -> None:
        """Remember errors, for the exit code."""
        self.errors.append(error)

    @hookimpl
    def pgleaderlock_lost(self) -> None:
        """Leadership that was held is gone."""
        self.lost.set()

    @hookimpl
    def pgleaderlock_stopped(self) -> None:
        """The lock reached STOPPED."""
        self.stopped.set()


def _label(lock: LeaderLock) -> str:
    return lock.name if lock.name is not None else "{},{}".format(*lock.keys)


class _FailFast:
    """Gives up when the server could never be reached; otherwise asks ``inner``."""

    def __init__(self, inner: RetryStrategy, tracker: _Tracker) -> None:
        self._inner = inner
        self._tracker = tracker

    def next_delay_s(self, ctx: RetryContext) -> float | None:
        if ctx.last_error is not None and not self._tracker.reached_server:
            return None
        return self._inner.next_delay_s(ctx)


class _Deadline:
    """Retry until ``wait_s`` after :meth:`start`, in waits of at most ``_WAIT_CHUNK_S``.

    ``wait_s=0`` gives up after the first failed attempt: a single try.
    """

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._deadline = time.monotonic() + wait_s

    def start(self) -> None:
        self._deadline = time.monotonic() + self._wait_s

    def next_delay_s(self, ctx: RetryContext) -> float | None:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return None
        return min(remaining, _WAIT_CHUNK_S)


def _build_lock(common: Common, retry_strategy: RetryStrategy, **options: Any) -> LeaderLock:
    target = common.target
    try:
        if target.name is not None:
            return LeaderLock.from_name(
                target.name,
                common.dsn,
                retry_strategy=retry_strategy,
                backend=common.backend,
                connect_timeout_s=common.connect_timeout_s,
                **options,
            )
        return LeaderLock(
            common.dsn,
            target.key1,
            target.key2,
            retry_strategy=retry_strategy,
            backend=common.backend,
            connect_timeout_s=common.connect_timeout_s,
            **options,
        )
    except PgLeaderLockError as exc:
        raise CliError(str(exc)) from None


async def _preflight(common: Common, lock: LeaderLock) -> None:
    """Open (and close) one session, so that an unreachable server is a clear error."""
    try:
        backend, driver_dsn = resolve_backend(common.backend, common.dsn)
        async with asyncio.timeout(common.connect_timeout_s):
            session = await backend.connect(str(driver_dsn), lock.connect_options)
    except TimeoutError:
        raise CliError(
            f"cannot connect to the database: no answer within "
            f"{common.connect_timeout_s:g} s; DSN: {common.dsn}"
        ) from None
    except Exception as exc:
        raise CliError(
            f"cannot connect to the database: {_first_line(exc)}; DSN: {common.dsn}"
        ) from None
    await session.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _not_acquired_error(common: Common, tracker: _Tracker) -> CliError:
    error = tracker.errors[-1] if tracker.errors else None
    if error is None:
        return CliError("the lock stopped before it could be acquired")
    return CliError(f"could not acquire the lock: {_first_line(error)}; DSN: {common.dsn}")


class _Signals:
    """SIGTERM and SIGINT handlers for the life of a command; signals are queued."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._pending: list[signal.Signals] = []
        self._event = asyncio.Event()

    def __enter__(self) -> _Signals:
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


async def _first(**awaitables: Awaitable[Any]) -> tuple[str, Any]:
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


def _signal_exit(sig: signal.Signals) -> int:
    return 128 + int(sig)


# ---------------------------------------------------------------------- the group

_MAIN_EPILOG = """\b
Examples:
  export PG_DSN=postgresql://app@db.internal/app
  pgleaderlock run --name billing-scheduler          # take part in an election, log it
  pgleaderlock acquire --name nightly-report         # one try: exit 0 if acquired, 1 if not
  pgleaderlock exec --name nightly-report -- ./report.sh   # run only if nobody else does
  pgleaderlock status --name billing-scheduler       # who holds it, who waits
  pgleaderlock status --all --json                   # every advisory lock, for scripts

\b
Exit codes:
  0      success; run: stopped by SIGTERM/SIGINT (the lock was released)
  1      acquire: the lock is held elsewhere; run: the lock stopped by itself
  2      bad input (no or malformed DSN, keys out of range, ...) or unreachable server
  75     exec: the lock is held elsewhere, COMMAND did not run (--held-exit-code)
  76     exec, acquire --hold: leadership was lost (COMMAND was terminated)
  126    exec: COMMAND cannot be executed (127: not found)
  128+N  stopped by signal N before COMMAND ran (130: SIGINT, 143: SIGTERM)

Logs go to stderr; stdout carries only status output and the output of COMMAND.
"""


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=_MAIN_EPILOG,
)
@click.version_option(__version__, "--version", prog_name="pgleaderlock")
def cli() -> None:
    """Leader election and singleton jobs on PostgreSQL session-level advisory locks.

    Every command works on one lock: name it with --name NAME (the two keys are
    derived from the name, so every process and SQL agree), or give the keys with
    --key1/--key2. The database comes from --dsn or $PG_DSN.
    """


# ---------------------------------------------------------------------- run

_RUN_EPILOG = """\b
Examples:
  pgleaderlock run --dsn postgresql://app@db/app --key1 1234 --key2 5678 \\
      --health-interval 5.0 --retry-base 1.0 --retry-max 30.0
  PG_DSN=postgresql://app@db/app pgleaderlock run --name billing-scheduler
  pgleaderlock run --name billing-scheduler --reconnect-grace 10 --follower-mode poll

Start it in two terminals: one becomes leader, the other waits. Stop the leader
(Ctrl-C) and the other takes over at once.
"""


@cli.command(epilog=_RUN_EPILOG)
@_lock_options
@click.option(
    "--health-interval",
    type=float,
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between health probes while leader.",
)
@click.option(
    "--retry-base",
    type=float,
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Base delay of the exponential backoff between attempts.",
)
@click.option(
    "--retry-max",
    type=float,
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="Maximum delay of the exponential backoff.",
)
@click.option(
    "--reconnect-grace",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Flap damping: how long to silently reconnect and re-acquire after the "
    "session fails before reporting the loss. Off when omitted.",
)
@click.option(
    "--no-auto-reacquire",
    is_flag=True,
    help="After losing or releasing the lock, stop (exit 1) instead of trying again.",
)
@click.option(
    "--follower-mode",
    type=click.Choice(["wait", "poll"]),
    default="wait",
    show_default=True,
    help="wait: a follower waits on the server and takes over the instant the leader's "
    "session ends. poll: it retries pg_try_advisory_lock after each delay.",
)
@_log_options
def run(
    dsn: str | None,
    name: str | None,
    key1: int | None,
    key2: int | None,
    backend: str | None,
    connect_timeout: float,
    verbose: int,
    quiet: int,
    log_json: bool,
    health_interval: float,
    retry_base: float,
    retry_max: float,
    reconnect_grace: float | None,
    no_auto_reacquire: bool,
    follower_mode: str,
) -> int:
    """Take part in leader election and log every transition until stopped.

    Connects, competes for the lock, and logs each state change and event (acquired,
    lost, released, errors) to stderr. SIGTERM or SIGINT releases the lock and exits
    0. Exits 2 if the server cannot be reached at start; later connection trouble is
    retried with the backoff.
    """
    _setup_logging("INFO", "INFO", verbose, quiet, log_json)
    common = _common(dsn, name, key1, key2, backend, connect_timeout)
    tracker = _Tracker()
    try:
        strategy = ExponentialBackoff(base_s=retry_base, max_s=retry_max)
    except ConfigurationError as exc:
        raise CliError(f"--retry-base/--retry-max: {exc}") from None
    lock = _build_lock(
        common,
        _FailFast(strategy, tracker),
        health_interval_s=health_interval,
        reconnect_grace_s=reconnect_grace,
        auto_reacquire=not no_auto_reacquire,
        follower_mode=follower_mode,
    )
    lock.plugins.register(tracker)
    return asyncio.run(_run(common, lock, tracker))


async def _run(common: Common, lock: LeaderLock, tracker: _Tracker) -> int:
    await _preflight(common, lock)
    key1, key2 = lock.keys
    _log(
        "INFO",
        "run_started",
        lock=common.target.label,
        key1=key1,
        key2=key2,
        dsn=mask_dsn(common.dsn),
        application_name=lock.application_name,
        follower_mode=lock.follower_mode,
    )
    sig: signal.Signals | None = None
    with _Signals() as signals:
        async with lock:  # leaving it releases the lock (shutdown)
            which, _ = await _first(signal=signals.wait(), stopped=tracker.stopped.wait())
            if which == "signal":
                sig = signals.take()[0]
                _log("INFO", "signal_received", signal=sig.name, action="release and exit")
    if sig is not None:
        _log("INFO", "run_stopped", reason=sig.name, exit_code=EXIT_OK)
        return EXIT_OK
    last = tracker.errors[-1] if tracker.errors else None
    if isinstance(last, ConfigurationError | SessionNotDedicatedError) or (
        last is not None and not tracker.reached_server
    ):
        raise _not_acquired_error(common, tracker)
    _log("WARNING", "run_stopped", reason="the lock stopped", exit_code=EXIT_NOT_ACQUIRED)
    return EXIT_NOT_ACQUIRED


# ---------------------------------------------------------------------- acquire

_ACQUIRE_EPILOG = """\b
Examples:
  pgleaderlock acquire --name nightly-report && echo "nobody else holds it"
  pgleaderlock acquire --name nightly-report --wait 30      # retry for up to 30 s
  pgleaderlock acquire --key1 1234 --key2 5678 --hold 60    # hold it for a minute
"""


def _wait_option(f: F) -> F:
    return click.option(
        "--wait",
        "wait_s",
        type=float,
        default=0.0,
        show_default=True,
        metavar="SECONDS",
        help="Wait up to SECONDS for the lock if it is held elsewhere (inf: forever). "
        "0 makes a single attempt.",
    )(f)


@cli.command(epilog=_ACQUIRE_EPILOG)
@_lock_options
@_wait_option
@click.option(
    "--hold",
    type=float,
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Keep the lock this long before releasing it (SIGTERM/SIGINT end it early).",
)
@_log_options
def acquire(
    dsn: str | None,
    name: str | None,
    key1: int | None,
    key2: int | None,
    backend: str | None,
    connect_timeout: float,
    verbose: int,
    quiet: int,
    log_json: bool,
    wait_s: float,
    hold: float,
) -> int:
    """Try once to acquire the lock: exit 0 if acquired, 1 if it is held elsewhere.

    The lock is released again before the command exits (after --hold SECONDS).
    """
    _setup_logging("INFO", "WARNING", verbose, quiet, log_json)
    common = _common(dsn, name, key1, key2, backend, connect_timeout)
    if wait_s < 0 or math.isnan(wait_s):
        raise CliError(f"--wait must be >= 0, got {wait_s:g}")
    if hold < 0 or not math.isfinite(hold):
        raise CliError(f"--hold must be a finite number >= 0, got {hold:g}")
    tracker = _Tracker()
    deadline = _Deadline(wait_s)
    lock = _build_lock(common, _FailFast(deadline, tracker), auto_reacquire=False)
    lock.plugins.register(tracker)
    return asyncio.run(_acquire(common, lock, tracker, deadline, hold))


async def _acquire(
    common: Common, lock: LeaderLock, tracker: _Tracker, deadline: _Deadline, hold_s: float
) -> int:
    await _preflight(common, lock)
    with _Signals() as signals:
        deadline.start()
        async with lock:
            refused = await _lead(
                common, lock, tracker, signals, held_exit_code=EXIT_NOT_ACQUIRED,
                event="not_acquired", on_signal="stop trying",
            )  # fmt: skip
            if refused is not None:
                return refused
            _log(
                "INFO",
                "acquired",
                lock=common.target.label,
                backend_pid=lock.backend_pid,
                hold_s=hold_s or None,
            )
            if hold_s > 0:
                which, _ = await _first(
                    lost=tracker.lost.wait(), signal=signals.wait(), held=asyncio.sleep(hold_s)
                )
                if which == "lost":
                    _log("WARNING", "leadership_lost", lock=common.target.label)
                    return EXIT_LOST
                if which == "signal":
                    sig = signals.take()[0]
                    _log("INFO", "signal_received", signal=sig.name, action="release")
    return EXIT_OK


async def _lead(
    common: Common,
    lock: LeaderLock,
    tracker: _Tracker,
    signals: _Signals,
    *,
    held_exit_code: int,
    event: str,
    on_signal: str,
) -> int | None:
    """Wait until ``lock`` leads: None then, else the exit code that says why not.

    Raises:
        CliError: the attempt failed for another reason than "held elsewhere".
    """
    which, leader = await _first(leader=lock.wait_for_leadership(), signal=signals.wait())
    if which == "signal":
        sig = signals.take()[0]
        _log("INFO", "signal_received", signal=sig.name, action=on_signal)
        return _signal_exit(sig)
    if leader:
        return None
    if tracker.held_elsewhere:
        _log(
            "INFO",
            event,
            lock=common.target.label,
            reason="the lock is held elsewhere",
            exit_code=held_exit_code,
        )
        return held_exit_code
    raise _not_acquired_error(common, tracker)


# ---------------------------------------------------------------------- exec

_EXEC_EPILOG = """\b
Examples:
  # cron on every host of a fleet: the report runs once, wherever the lock is free
  pgleaderlock exec --name nightly-report -- /usr/local/bin/report --since yesterday
  # Kubernetes CronJob with overlapping runs: wait up to 10 minutes for the previous one
  pgleaderlock exec --name nightly-report --wait 600 -- python -m app.report
  # skipping is not a failure for this job
  pgleaderlock exec --name cleanup --held-exit-code 0 -- ./cleanup.sh

\b
Exit codes: COMMAND's own exit code (128+N if it died of signal N); 75 if the lock is
held elsewhere (COMMAND did not run); 76 if leadership was lost while COMMAND ran
(COMMAND was sent SIGTERM, then SIGKILL after --kill-after); 2 for bad input or an
unreachable server; 126/127 if COMMAND cannot be executed / is not found.

COMMAND runs in its own session (process group); SIGTERM and SIGINT sent to
pgleaderlock are forwarded to that group. On Linux COMMAND is also killed if
pgleaderlock itself dies.
"""


@cli.command(
    "exec",
    epilog=_EXEC_EPILOG,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@_lock_options
@_wait_option
@click.option(
    "--kill-after",
    type=float,
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="When leadership is lost: seconds between SIGTERM and SIGKILL to COMMAND.",
)
@click.option(
    "--held-exit-code",
    type=click.IntRange(0, 255),
    metavar="CODE",
    default=EXIT_HELD,
    show_default=True,
    help="Exit code when the lock is held elsewhere and COMMAND did not run.",
)
@click.option(
    "--health-interval",
    type=float,
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between health probes while COMMAND runs (a terminated session is "
    "noticed at once; a silent network within this plus 2 s).",
)
@_log_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(
    dsn: str | None,
    name: str | None,
    key1: int | None,
    key2: int | None,
    backend: str | None,
    connect_timeout: float,
    verbose: int,
    quiet: int,
    log_json: bool,
    wait_s: float,
    kill_after: float,
    held_exit_code: int,
    health_interval: float,
    command: tuple[str, ...],
) -> int:
    """Run COMMAND only while holding the lock: a singleton for cron and CronJobs.

    Like flock(1), but for a whole fleet: of all hosts running the same `exec`, only
    the one holding the lock runs COMMAND; the others exit 75 at once (or wait with
    --wait). If leadership is lost while COMMAND runs, COMMAND is terminated. Put
    `--` before COMMAND.
    """
    _setup_logging("WARNING", "WARNING", verbose, quiet, log_json)
    common = _common(dsn, name, key1, key2, backend, connect_timeout)
    if wait_s < 0 or math.isnan(wait_s):
        raise CliError(f"--wait must be >= 0, got {wait_s:g}")
    kill_after = _positive("--kill-after", kill_after)
    tracker = _Tracker()
    deadline = _Deadline(wait_s)
    lock = _build_lock(
        common,
        _FailFast(deadline, tracker),
        auto_reacquire=False,
        health_interval_s=health_interval,
    )
    lock.plugins.register(tracker)
    return asyncio.run(
        _exec(common, lock, tracker, deadline, list(command), kill_after, held_exit_code)
    )


async def _exec(
    common: Common,
    lock: LeaderLock,
    tracker: _Tracker,
    deadline: _Deadline,
    command: list[str],
    kill_after_s: float,
    held_exit_code: int,
) -> int:
    await _preflight(common, lock)
    with _Signals() as signals:
        deadline.start()
        async with lock:
            refused = await _lead(
                common, lock, tracker, signals, held_exit_code=held_exit_code,
                event="not_running", on_signal="not running COMMAND",
            )  # fmt: skip
            if refused is not None:
                return refused
            return await _supervise(common, lock, tracker, signals, command, kill_after_s)


def _pdeathsig() -> Callable[[], None] | None:
    """On Linux, a ``preexec_fn`` that makes the child die with pgleaderlock.

    If pgleaderlock is killed (SIGKILL, OOM), its session ends and the lock is free:
    COMMAND must not keep running while another host starts it.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


async def _supervise(
    common: Common,
    lock: LeaderLock,
    tracker: _Tracker,
    signals: _Signals,
    command: list[str],
    kill_after_s: float,
) -> int:
    """Run ``command`` while leader; forward signals; terminate it if leadership is lost."""
    if not lock.is_leader or tracker.lost.is_set():  # lost in the instant since acquiring
        _log("WARNING", "leadership_lost", lock=common.target.label, action="not running COMMAND")
        return EXIT_LOST
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, start_new_session=True, preexec_fn=_pdeathsig()
        )
    except FileNotFoundError:
        _log("ERROR", "command_not_found", command=command[0], exit_code=EXIT_NOT_FOUND)
        return EXIT_NOT_FOUND
    except OSError as exc:
        _log("ERROR", "command_failed", command=command[0], error=str(exc))
        return EXIT_CANNOT_EXECUTE
    _log(
        "INFO",
        "command_started",
        lock=common.target.label,
        pid=proc.pid,
        backend_pid=lock.backend_pid,
        command=shlex.join(command),
    )

    def kill(sig: signal.Signals) -> None:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    child = asyncio.ensure_future(proc.wait())
    try:
        while True:
            which, _ = await _first(
                child=asyncio.shield(child), lost=tracker.lost.wait(), signal=signals.wait()
            )
            if which == "child":
                code = _exit_status(await child)
                _log("INFO", "command_exited", pid=proc.pid, exit_code=code)
                return code
            if which == "signal":
                for sig in signals.take():
                    _log("INFO", "signal_forwarded", signal=sig.name, pid=proc.pid)
                    kill(sig)
                continue
            _log(
                "WARNING",
                "leadership_lost",
                lock=common.target.label,
                action="terminating COMMAND",
                pid=proc.pid,
                kill_after_s=kill_after_s,
            )
            kill(signal.SIGTERM)
            try:
                async with asyncio.timeout(kill_after_s):
                    await asyncio.shield(child)
            except TimeoutError:
                _log("WARNING", "command_killed", pid=proc.pid, signal="SIGKILL")
                kill(signal.SIGKILL)
            await child
            _log("WARNING", "command_terminated", pid=proc.pid, exit_code=EXIT_LOST)
            return EXIT_LOST
    finally:
        if not child.done():  # cancelled or a bug: never leave COMMAND running unsupervised
            kill(signal.SIGKILL)
            await asyncio.gather(child, return_exceptions=True)


# ---------------------------------------------------------------------- status

_STATUS_EPILOG = """\b
Examples:
  pgleaderlock status --name billing-scheduler
  pgleaderlock status --key1 1234 --key2 5678 --json | jq .holders[0].pid
  pgleaderlock status --all

Informational: it shows what pg_locks says at this instant. Only followers that wait
on the server (--follower-mode wait, the default) are counted as waiting; polling
followers hold no row in pg_locks between attempts.
"""

_SCHEME = re.compile(r"^(?P<base>postgres(?:ql)?)\+[A-Za-z0-9_]+://", re.I)
_APP_NAME = re.compile(r"^pgleaderlock:(?P<label>.*)@[^@]*$")

_SESSION_COLUMNS = """
    l.pid, l.granted, l.mode, a.application_name, host(a.client_addr) AS client_addr,
    a.client_port, a.usename, a.backend_start, a.state_change, a.state, {waitstart}
"""
_ONE_LOCK = f"""
SELECT {_SESSION_COLUMNS}
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 2
  AND l.database = (SELECT oid FROM pg_catalog.pg_database
                    WHERE datname = pg_catalog.current_database())
  AND l.classid = %(classid)s::int8::oid AND l.objid = %(objid)s::int8::oid
ORDER BY l.granted DESC, 11 NULLS LAST, l.pid
"""
_ALL_LOCKS = f"""
SELECT l.classid::int8, l.objid::int8, l.objsubid::int4, {_SESSION_COLUMNS}
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_catalog.pg_database
                    WHERE datname = pg_catalog.current_database())
"""
_SESSION_FIELDS = (
    "pid",
    "granted",
    "mode",
    "application_name",
    "client_addr",
    "client_port",
    "usename",
    "backend_start",
    "state_change",
    "state",
    "wait_start",
)


@cli.command(epilog=_STATUS_EPILOG)
@_target_options
@click.option("--all", "all_locks", is_flag=True, help="List every advisory lock in the database.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (for scripts).")
@click.option(
    "--timeout",
    type=float,
    default=5.0,
    show_default=True,
    metavar="SECONDS",
    help="Connect timeout and statement timeout.",
)
@_log_options
def status(
    dsn: str | None,
    name: str | None,
    key1: int | None,
    key2: int | None,
    all_locks: bool,
    as_json: bool,
    timeout: float,
    verbose: int,
    quiet: int,
    log_json: bool,
) -> int:
    """Show who holds the lock now and how many sessions wait for it.

    Reads pg_locks joined with pg_stat_activity: the holder's backend pid,
    application_name (pgleaderlock sets it to pgleaderlock:NAME@HOST:PID), client
    address, user, when its session started and when its state last changed; then the
    sessions waiting for the lock. --all lists every advisory lock held or awaited in
    the database, with two-key locks decoded back to signed key1/key2.
    """
    _setup_logging("WARNING", "WARNING", verbose, quiet, log_json)
    dsn = _resolve_dsn(dsn)
    if all_locks:
        if name is not None or key1 is not None or key2 is not None:
            raise CliError("--all lists every lock: leave out --name/--key1/--key2")
        target = None
    else:
        target = _resolve_target(name, key1, key2)
    timeout = _positive("--timeout", timeout)
    with _connect_for_status(dsn, timeout) as conn:
        try:
            info = _server_info(conn)
            report = _one_lock(conn, info, target) if target else _all_locks(conn, info)
        except psycopg.errors.QueryCanceled:
            raise CliError(f"the status query took longer than {timeout:g} s") from None
        except psycopg.Error as exc:
            raise CliError(f"status query failed: {_first_line(exc)}") from None
    if as_json:
        click.echo(json.dumps(report, indent=2, default=_json_default))
    elif target is None:
        click.echo(_render_all(report))
    else:
        click.echo(_render_one(report))
    return EXIT_OK


@contextlib.contextmanager
def _connect_for_status(dsn: str, timeout_s: float) -> Iterator[psycopg.Connection[Any]]:
    driver_dsn = _SCHEME.sub(lambda m: f"{m.group('base')}://", dsn)
    try:
        params = conninfo_to_dict(driver_dsn)
    except psycopg.Error as exc:
        raise CliError(f"malformed DSN {dsn!r}: {_first_line(exc)}") from None
    existing = params.get("options")
    statement = f"-c statement_timeout={math.ceil(timeout_s * 1000)}"
    options = f"{existing} {statement}" if existing else statement
    try:
        conn = psycopg.connect(
            driver_dsn,
            autocommit=True,
            connect_timeout=max(2, math.ceil(timeout_s)),
            application_name="pgleaderlock-status",
            options=options,
        )
    except psycopg.Error as exc:
        raise CliError(f"cannot connect to the database: {_first_line(exc)}; DSN: {dsn}") from None
    with conn:
        yield conn


@dataclass(frozen=True)
class _ServerInfo:
    now: datetime
    database: str
    version: int


def _server_info(conn: psycopg.Connection[Any]) -> _ServerInfo:
    row = conn.execute(
        "SELECT pg_catalog.now(), pg_catalog.current_database(),"
        " pg_catalog.current_setting('server_version_num')::int"
    ).fetchone()
    assert row is not None
    return _ServerInfo(now=row[0], database=row[1], version=row[2])


def _waitstart(info: _ServerInfo) -> str:
    # pg_locks.waitstart exists since PostgreSQL 14.
    return "l.waitstart" if info.version >= 140000 else "NULL::timestamptz AS waitstart"


def _session(row: Sequence[Any], now: datetime) -> dict[str, Any]:
    session = dict(zip(_SESSION_FIELDS, row, strict=True))
    for field in ("backend_start", "state_change", "wait_start"):
        value = session[field]
        session[f"{field}_age_s"] = (
            round((now - value).total_seconds(), 3) if isinstance(value, datetime) else None
        )
    return session


def _one_lock(conn: psycopg.Connection[Any], info: _ServerInfo, target: Target) -> dict[str, Any]:
    query = _ONE_LOCK.format(waitstart=_waitstart(info))
    rows = conn.execute(
        query.encode(),
        {"classid": target.key1 & 0xFFFFFFFF, "objid": target.key2 & 0xFFFFFFFF},
    ).fetchall()
    sessions = [_session(row, info.now) for row in rows]
    holders = [s for s in sessions if s["granted"]]
    waiting = [s for s in sessions if not s["granted"]]
    return {
        "lock": {"name": target.name, "key1": target.key1, "key2": target.key2},
        "database": info.database,
        "checked_at": info.now,
        "held": bool(holders),
        "holders": holders,
        "waiting_count": len(waiting),
        "waiting": waiting,
    }


def _signed32(value: int) -> int:
    return value - 2**32 if value > 2**31 - 1 else value


def _name_for(keys: tuple[int, int], application_name: str | None) -> str | None:
    """The lock name, when the holder is a pgleaderlock session whose name gives these keys."""
    match = _APP_NAME.match(application_name or "")
    if match is None:
        return None
    label = match.group("label")
    try:
        return label if label and lock_keys(label) == keys else None
    except ConfigurationError:  # pragma: no cover - label is a non-empty str
        return None


def _all_locks(conn: psycopg.Connection[Any], info: _ServerInfo) -> dict[str, Any]:
    query = _ALL_LOCKS.format(waitstart=_waitstart(info))
    locks = []
    for classid, objid, objsubid, *session_row in conn.execute(query.encode()).fetchall():
        session = _session(session_row, info.now)
        if objsubid == 2:
            keys = (_signed32(classid), _signed32(objid))
            lock: dict[str, Any] = {
                "kind": "int4 pair",
                "key1": keys[0],
                "key2": keys[1],
                "name": _name_for(keys, session["application_name"]),
            }
        else:  # pg_advisory_lock(bigint): high and low halves
            key = (classid << 32) | objid
            lock = {"kind": "bigint", "key": key - 2**64 if key > 2**63 - 1 else key}
        locks.append({**lock, **session})
    locks.sort(
        key=lambda lk: (
            lk["kind"] != "bigint",
            (lk.get("key", 0), lk.get("key1", 0), lk.get("key2", 0)),
            not lk["granted"],
            lk["pid"],
        )
    )
    return {"database": info.database, "checked_at": info.now, "locks": locks}


def _json_default(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _when(value: object, age_s: float | None) -> str:
    if not isinstance(value, datetime):
        return "unknown"
    stamp = value.isoformat(sep=" ", timespec="seconds")
    return f"{stamp} ({_age(age_s)} ago)" if age_s is not None else stamp


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0, int(seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if s >= size:
            return f"{s // size}{unit} {(s % size) // sub_size}{sub}"
    return f"{s // 60}m {s % 60}s" if s >= 60 else f"{s}s"


def _client(session: dict[str, Any]) -> str:
    if session["client_addr"] is not None:
        return f"{session['client_addr']}:{session['client_port']}"
    if session["client_port"] == -1:
        return "local socket"
    return "unknown"


def _render_one(report: dict[str, Any]) -> str:
    lock = report["lock"]
    keys = f"key1={lock['key1']}, key2={lock['key2']}"
    lines = [
        f"lock      {lock['name']} ({keys})" if lock["name"] else f"lock      {keys}",
        f"database  {report['database']}",
    ]
    if not report["holders"]:
        lines.append("holder    none: the lock is free")
    for s in report["holders"]:
        lines += [
            f"holder    pid {s['pid']}  {s['application_name'] or '(no application_name)'}",
            f"          client {_client(s)}  user {s['usename'] or 'unknown'}  mode {s['mode']}",
            f"          session started {_when(s['backend_start'], s['backend_start_age_s'])}",
            f"          {s['state'] or 'state unknown'} since "
            f"{_when(s['state_change'], s['state_change_age_s'])}",
        ]
    count = report["waiting_count"]
    lines.append(f"waiting   {count} session{'' if count == 1 else 's'}")
    for s in report["waiting"]:
        since = _when(s["wait_start"], s["wait_start_age_s"])
        lines.append(
            f"          pid {s['pid']}  {s['application_name'] or '(no application_name)'}"
            f"  client {_client(s)}  waiting since {since}"
        )
    return "\n".join(lines)


def _render_all(report: dict[str, Any]) -> str:
    if not report["locks"]:
        return f"no advisory locks in database {report['database']}"
    header = ("KEY1", "KEY2", "NAME", "PID", "STATUS", "APPLICATION_NAME", "CLIENT", "AGE")
    rows = [header]
    for lock in report["locks"]:
        if lock["kind"] == "bigint":
            key1, key2 = f"bigint {lock['key']}", "-"
        else:
            key1, key2 = str(lock["key1"]), str(lock["key2"])
        since = (
            _age(lock["backend_start_age_s"]) if lock["granted"] else _age(lock["wait_start_age_s"])
        )
        rows.append(
            (
                key1,
                key2,
                lock.get("name") or "-",
                str(lock["pid"]),
                "held" if lock["granted"] else "waiting",
                lock["application_name"] or "-",
                _client(lock),
                since,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# ---------------------------------------------------------------------- entry point


def run_cli(args: Sequence[str] | None = None) -> int:
    """Run the command line and return its exit code (no ``sys.exit``).

    Args:
        args: the arguments; default ``sys.argv[1:]``.
    """
    try:
        result = cli.main(
            args=list(args) if args is not None else None,
            prog_name="pgleaderlock",
            standalone_mode=False,
        )
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.format_message())
        return EXIT_OK
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "pgleaderlock"
        message = " ".join(mask_dsn(exc.format_message()).split())
        click.echo(f"{where}: error: {message} (see '{where} --help')", err=True)
        return exc.exit_code
    except CliError as exc:
        click.echo(f"{exc.where}: error: {exc.format_message()}", err=True)
        return exc.exit_code
    except click.ClickException as exc:
        message = " ".join(mask_dsn(exc.format_message()).split())
        click.echo(f"pgleaderlock: error: {message}", err=True)
        return exc.exit_code
    except click.exceptions.Abort:
        return _signal_exit(signal.SIGINT)
    except KeyboardInterrupt:
        return _signal_exit(signal.SIGINT)
    return result if isinstance(result, int) else EXIT_OK


def main() -> NoReturn:
    """The ``pgleaderlock`` console script."""
    sys.exit(run_cli())


if __name__ == "__main__":
    main()
