"""``pgleaderlock acquire``: try once (or for ``--wait`` seconds) to take the lock.

Exit 0 if it was acquired (and held for ``--hold`` seconds, then released), 1 if it is
held elsewhere, 76 if leadership was lost while holding, 128+N on signal N; 2 for bad
input, an unreachable server, or an error that retrying cannot mend.
"""

from __future__ import annotations

import asyncio
import math

import click

from ..lowlevel import LeaderLock
from .exits import EXIT_LOST, EXIT_NOT_ACQUIRED, EXIT_OK, CliError
from .logs import log
from .options import Common, check_wait, lock_options, log_options, seconds_option, wait_option
from .retry import Deadline
from .runtime import Signals, build_lock, contend, first
from .tracker import Tracker

__all__ = ["acquire"]

_ACQUIRE_EPILOG = """\b
Examples:
  pgleaderlock acquire --name nightly-report && echo "nobody else holds it"
  pgleaderlock acquire --name nightly-report --wait 30      # retry for up to 30 s
  pgleaderlock acquire --key1 1234 --key2 5678 --hold 60    # hold it for a minute
"""


@click.command("acquire", epilog=_ACQUIRE_EPILOG)
@lock_options
@wait_option
@seconds_option(
    "--hold",
    default=0.0,
    text="Keep the lock this long before releasing it (SIGTERM/SIGINT end it early).",
)
@log_options(cli="INFO", library="WARNING")
def acquire(
    common: Common,
    wait_s: float,
    hold: float,
) -> int:
    """Try once to acquire the lock: exit 0 if acquired, 1 if it is held elsewhere.

    The lock is released again before the command exits (after --hold SECONDS).
    """
    deadline = Deadline(check_wait(wait_s))
    if hold < 0 or not math.isfinite(hold):
        raise CliError(f"--hold must be a finite number >= 0, got {hold:g}")
    lock, tracker = build_lock(common, deadline, auto_reacquire=False)
    return asyncio.run(
        contend(
            common,
            lock,
            deadline,
            held_exit_code=EXIT_NOT_ACQUIRED,
            event="not_acquired",
            on_signal="stop trying",
            then=lambda signals: _hold(lock, tracker, signals, hold),
        )
    )


async def _hold(lock: LeaderLock, tracker: Tracker, signals: Signals, hold_s: float) -> int:
    """The lock leads: say so, and keep it for ``hold_s`` seconds, unless leadership is lost
    or a signal comes first."""
    log(
        "INFO",
        "acquired",
        lock=lock.label,
        backend_pid=lock.backend_pid,
        hold_s=hold_s or None,
    )
    if hold_s > 0:
        which, _ = await first(
            lost=tracker.lost.wait(), signal=signals.wait(), held=asyncio.sleep(hold_s)
        )
        if which == "lost":
            log("WARNING", "leadership_lost", lock=lock.label)
            return EXIT_LOST
        if which == "signal":
            sig = signals.take()[0]
            log("INFO", "signal_received", signal=sig.name, action="release", lock=lock.label)
    return EXIT_OK
