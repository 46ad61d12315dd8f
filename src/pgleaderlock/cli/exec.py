"""``pgleaderlock exec``: run a command only while holding the lock, and supervise it.

Like flock(1) for a fleet: the host holding the lock runs COMMAND, the others exit 75
(or wait with ``--wait``). COMMAND runs in its own process group; SIGTERM and SIGINT are
forwarded to it; if leadership is lost its group gets SIGTERM, then SIGKILL after
``--kill-after`` if any of it still runs (exit 76). On Linux it also dies with
pgleaderlock (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shlex
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from ..core.errors import PgLeaderLockError
from ..core.lock import LeaderLock
from ..core.semaphore import Semaphore
from .exits import EXIT_CANNOT_EXECUTE, EXIT_HELD, EXIT_LOST, EXIT_NOT_FOUND, CliError
from .logs import log
from .options import (
    Common,
    check_wait,
    lock_options,
    log_options,
    positive,
    seconds_option,
    slots_option,
    wait_option,
)
from .retry import Deadline, FailFast
from .runtime import Signals, build_lock, contend, first
from .tracker import Tracker

__all__ = ["exec_", "exit_status", "kill_group", "spawn", "stop_command"]

_PR_SET_PDEATHSIG = 1

_EXEC_EPILOG = """\b
Examples:
  # cron on every host of a fleet: the report runs once, wherever the lock is free
  pgleaderlock exec --name nightly-report -- /usr/local/bin/report --since yesterday
  # Kubernetes CronJob with overlapping runs: wait up to 10 minutes for the previous one
  pgleaderlock exec --name nightly-report --wait 600 -- python -m app.report
  # skipping is not a failure for this job
  pgleaderlock exec --name cleanup --held-exit-code 0 -- ./cleanup.sh
  # at most 3 hosts transcode at once; the others wait for a free slot
  pgleaderlock exec --name transcoders -n 3 --wait inf -- ./transcode-worker

\b
Exit codes: COMMAND's own exit code (128+N if it died of signal N); 75 if the lock is
held elsewhere (COMMAND did not run); 76 if leadership was lost while COMMAND ran
(COMMAND was sent SIGTERM, then SIGKILL after --kill-after); with -n N, 75 means all N
slots are held elsewhere; 2 for bad input, an
unreachable server or a server that refuses this client for good (COMMAND did not run);
126/127 if COMMAND cannot be executed / is not found.

COMMAND runs in its own session (process group); SIGTERM and SIGINT sent to
pgleaderlock are forwarded to that group. On Linux COMMAND is also killed if
pgleaderlock itself dies.
"""


@click.command(
    "exec",
    epilog=_EXEC_EPILOG,
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@lock_options
@slots_option
@wait_option
@seconds_option(
    "--kill-after",
    default=10.0,
    text="When leadership is lost: seconds between SIGTERM and SIGKILL to COMMAND.",
)
@click.option(
    "--held-exit-code",
    type=click.IntRange(0, 255),
    metavar="CODE",
    default=EXIT_HELD,
    show_default=True,
    help="Exit code when the lock is held elsewhere and COMMAND did not run.",
)
@seconds_option(
    "--health-interval",
    default=5.0,
    text="Seconds between health probes while COMMAND runs (a terminated session is "
    "noticed at once; a silent network within this plus 2 s).",
)
@log_options(cli="WARNING", library="WARNING")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def exec_(
    common: Common,
    slots: int,
    wait_s: float,
    kill_after: float,
    held_exit_code: int,
    health_interval: float,
    command: tuple[str, ...],
) -> int:
    """Run COMMAND only while holding the lock: a singleton for cron and CronJobs.

    Like flock(1), but for a whole fleet: of all hosts running the same `exec`, only
    the one holding the lock runs COMMAND; the others exit 75 at once (or wait with
    --wait). If leadership is lost while COMMAND runs, COMMAND is terminated. With
    -n N, up to N hosts run COMMAND at once, each holding one of N slots. Put `--`
    before COMMAND.
    """
    deadline = Deadline(check_wait(wait_s))
    kill_after = positive("--kill-after", kill_after)
    options = {"auto_reacquire": False, "health_interval_s": health_interval}
    lock: LeaderLock
    if slots > 1:
        lock, tracker = _build_semaphore(common, slots, deadline, **options)
    else:
        lock, tracker = build_lock(common, deadline, **options)
    return asyncio.run(
        contend(
            common,
            lock,
            deadline,
            held_exit_code=held_exit_code,
            event="not_running",
            on_signal="not running COMMAND",
            then=lambda signals: _supervise(lock, tracker, signals, list(command), kill_after),
        )
    )


def _build_semaphore(
    common: Common, slots: int, deadline: Deadline, **options: Any
) -> tuple[Semaphore, Tracker]:
    """`build_lock` for ``-n N``: a [`Semaphore`][pgleaderlock.Semaphore] of ``slots``
    slots named by ``--name``."""
    name = common.target.name
    if name is None:
        raise CliError("-n/--slots names the semaphore with --name, not --key1/--key2")
    tracker = Tracker()
    try:
        sem = Semaphore(
            common.dsn,
            name,
            slots=slots,
            retry_strategy=FailFast(deadline, tracker),
            backend=common.backend,
            connect_timeout_s=common.connect_timeout_s,
            **options,
        )
    except PgLeaderLockError as exc:
        raise CliError(str(exc)) from None
    sem.plugins.register(tracker)
    return sem, tracker


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


async def spawn(
    command: list[str], env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """Start ``command`` (with ``env``, default this process's environment) in a
    session (process group) of its own, to die with this process on Linux (see
    `_pdeathsig`).

    Raises:
        FileNotFoundError: the command is not found (exit 127).
        OSError: it cannot be executed (exit 126).
    """
    return await asyncio.create_subprocess_exec(
        *command, env=env, start_new_session=True, preexec_fn=_pdeathsig()
    )


def kill_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    """Send ``sig`` to ``proc``'s process group, unless it has ended."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


async def stop_command(proc: asyncio.subprocess.Process, kill_after_s: float, label: str) -> None:
    """SIGTERM to ``proc``'s group, SIGKILL to what is left of the group after
    ``kill_after_s``; return once ``proc`` has ended and nothing of its group runs.

    The whole group, not only ``proc``: a shell that exits on SIGTERM may leave a
    background child behind (one forked just after the signal never got it), and that
    child must not go on working for a leader that is no longer one.
    """
    kill_group(proc, signal.SIGTERM)
    try:
        async with asyncio.timeout(kill_after_s):
            await proc.wait()
            # nothing signals the end of a group's last process: poll for it
            while await asyncio.to_thread(_group_runs, proc.pid):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
    except TimeoutError:
        log("WARNING", "command_killed", pid=proc.pid, signal="SIGKILL", lock=label)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. Zombies do not count: an orphan
    that ended stays one where nothing reaps it (a container's first process may not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that changed its user: it runs
        return True
    try:
        pids = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:  # pragma: no cover - no /proc (not Linux): the group exists
        return True
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _ppid, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # ended meanwhile
            continue
        if int(pgrp) == pgid and state not in ("Z", "X"):
            return True
    return False


def exit_status(returncode: int) -> int:
    """A shell's exit status for ``returncode`` (a negative one is "killed by -N")."""
    return 128 - returncode if returncode < 0 else returncode


async def _supervise(
    lock: LeaderLock,
    tracker: Tracker,
    signals: Signals,
    command: list[str],
    kill_after_s: float,
) -> int:
    """Run ``command`` while leader; forward signals; terminate it if leadership is lost."""
    if not lock.is_leader or tracker.lost.is_set():  # lost in the instant since acquiring
        log("WARNING", "leadership_lost", lock=lock.label, action="not running COMMAND")
        return EXIT_LOST
    try:
        proc = await spawn(command)
    except FileNotFoundError:
        log(
            "ERROR",
            "command_not_found",
            command=command[0],
            exit_code=EXIT_NOT_FOUND,
            lock=lock.label,
        )
        return EXIT_NOT_FOUND
    except OSError as exc:
        log("ERROR", "command_failed", command=command[0], error=str(exc), lock=lock.label)
        return EXIT_CANNOT_EXECUTE
    log(
        "INFO",
        "command_started",
        lock=lock.label,
        pid=proc.pid,
        backend_pid=lock.backend_pid,
        command=shlex.join(command),
    )

    child = asyncio.ensure_future(proc.wait())
    try:
        while True:
            which, _ = await first(
                child=asyncio.shield(child), lost=tracker.lost.wait(), signal=signals.wait()
            )
            if which == "child":
                code = exit_status(await child)
                log("INFO", "command_exited", pid=proc.pid, exit_code=code, lock=lock.label)
                return code
            if which == "signal":
                for sig in signals.take():
                    log("INFO", "signal_forwarded", signal=sig.name, pid=proc.pid, lock=lock.label)
                    kill_group(proc, sig)
                continue
            log(
                "WARNING",
                "leadership_lost",
                lock=lock.label,
                action="terminating COMMAND",
                pid=proc.pid,
                kill_after_s=kill_after_s,
            )
            await stop_command(proc, kill_after_s, lock.label)
            await child
            log("WARNING", "command_terminated", pid=proc.pid, exit_code=EXIT_LOST, lock=lock.label)
            return EXIT_LOST
    finally:
        if not child.done():  # cancelled or a bug: never leave COMMAND running unsupervised
            kill_group(proc, signal.SIGKILL)
            await asyncio.gather(child, return_exceptions=True)
