"""``pgleaderlock run``: take part in leader election and log every transition.

It runs until SIGTERM or SIGINT (exit 0, the lock released) or until the lock stops by
itself (exit 1, e.g. lost with ``--no-auto-reacquire``); a server that cannot be reached
at start, and an error that retrying cannot mend (the server refused this client, a
transaction-mode pooler) at any time, are a one-line error (exit 2).
"""

from __future__ import annotations

import asyncio
import signal

import click

from ..lowlevel import ConfigurationError, ExponentialBackoff, LeaderLock, is_permanent, mask_dsn
from .exits import EXIT_NOT_ACQUIRED, EXIT_OK, CliError
from .logs import log
from .options import Common, lock_options, log_options, seconds_option
from .runtime import (
    Signals,
    build_lock,
    first,
    not_acquired_error,
    permanent_error,
    preflight,
)
from .tracker import Tracker

__all__ = ["run"]

_RUN_EPILOG = """\b
Examples:
  pgleaderlock run --dsn postgresql://app@db/app --key1 1234 --key2 5678 \\
      --health-interval 5.0 --retry-base 1.0 --retry-max 30.0
  PG_DSN=postgresql://app@db/app pgleaderlock run --name billing-scheduler
  pgleaderlock run --name billing-scheduler --reconnect-grace 10 --follower-mode poll

Start it in two terminals: one becomes leader, the other waits. Stop the leader
(Ctrl-C) and the other takes over at once.
"""


@click.command("run", epilog=_RUN_EPILOG)
@lock_options
@seconds_option(
    "--health-interval",
    default=5.0,
    text="Seconds between health probes while leader.",
)
@seconds_option(
    "--retry-base",
    default=1.0,
    text="Base delay of the exponential backoff between attempts.",
)
@seconds_option(
    "--retry-max",
    default=30.0,
    text="Maximum delay of the exponential backoff.",
)
@seconds_option(
    "--reconnect-grace",
    default=None,
    text="Flap damping: how long to silently reconnect and re-acquire after the "
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
@log_options(cli="INFO", library="INFO")
def run(
    common: Common,
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
    0. Exits 2 if the server cannot be reached at start, or on an error that retrying
    cannot mend (the server refused this client, a transaction-mode pooler); other
    connection trouble later is retried with the backoff.
    """
    try:
        strategy = ExponentialBackoff(base_s=retry_base, max_s=retry_max)
    except ConfigurationError as exc:
        raise CliError(f"--retry-base/--retry-max: {exc}") from None
    lock, tracker = build_lock(
        common,
        strategy,
        health_interval_s=health_interval,
        reconnect_grace_s=reconnect_grace,
        auto_reacquire=not no_auto_reacquire,
        follower_mode=follower_mode,
    )
    return asyncio.run(_run(common, lock, tracker))


async def _run(common: Common, lock: LeaderLock, tracker: Tracker) -> int:
    await preflight(common, lock)
    key1, key2 = lock.keys
    log(
        "INFO",
        "run_started",
        lock=lock.label,
        key1=key1,
        key2=key2,
        dsn=mask_dsn(common.dsn),
        application_name=lock.application_name,
        follower_mode=lock.follower_mode,
    )
    sig: signal.Signals | None = None
    with Signals() as signals:
        async with lock:  # leaving it releases the lock (shutdown)
            which, _ = await first(signal=signals.wait(), stopped=tracker.stopped.wait())
            if which == "signal":
                sig = signals.take()[0]
                log(
                    "INFO",
                    "signal_received",
                    signal=sig.name,
                    action="release and exit",
                    lock=lock.label,
                )
    if sig is not None:
        log("INFO", "run_stopped", reason=sig.name, exit_code=EXIT_OK, lock=lock.label)
        return EXIT_OK
    last = lock.statistics().last_error
    if last is not None and is_permanent(last):
        raise permanent_error(common, last)
    if last is not None and not tracker.reached_server:
        raise not_acquired_error(common, lock)
    log("WARNING", "run_stopped", reason="the lock stopped", exit_code=EXIT_NOT_ACQUIRED)
    return EXIT_NOT_ACQUIRED
