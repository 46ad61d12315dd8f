"""``pgleaderlock exec``: run a command only while holding the lock, and supervise it.

Like flock(1) for a fleet: the host holding the lock runs COMMAND, the others exit 75
(or wait with ``--wait``). COMMAND runs in its own process group; SIGTERM and SIGINT are
forwarded to it; if leadership is lost every process of its tree gets SIGTERM, then
SIGKILL after ``--kill-after`` if any still runs (exit 76). No process of the tree
outlives the lock, not even when pgleaderlock is SIGKILLed: COMMAND runs under a keeper
process that holds the lock's session open until the tree is gone
(`pgleaderlock.proctree`).
"""

from __future__ import annotations

import asyncio
import os
import shlex
from typing import Any

import click

from ..lowlevel import LeaderLock, PgLeaderLockError, Semaphore, lock_arguments
from ..proctree.tree import CommandTree, become_subreaper, held_by_keeper
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

__all__ = ["exec_", "exit_status", "start_tree"]

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

COMMAND runs in its own process group; SIGTERM and SIGINT sent to pgleaderlock are
forwarded to that group. No process of COMMAND's tree outlives the lock: what COMMAND
leaves running is stopped (SIGTERM, SIGKILL after --kill-after) before the lock is
released, and if pgleaderlock is killed, the tree is killed before the server can free
the lock (on Linux the whole tree, setsid and double forks included; elsewhere
COMMAND's process group).
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
    text="When leadership is lost, or COMMAND exited and left processes running: seconds "
    "between SIGTERM and SIGKILL to what runs of COMMAND's tree.",
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
    become_subreaper()  # if its keeper dies, what is left of COMMAND's tree comes here
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
    sem.plugins.register(tracker)
    return sem, tracker


def exit_status(returncode: int) -> int:
    """A shell's exit status for ``returncode`` (a negative one is "killed by -N")."""
    return 128 - returncode if returncode < 0 else returncode


async def start_tree(
    lock: LeaderLock,
    command: list[str],
    kill_after_s: float,
    env: dict[str, str] | None = None,
) -> CommandTree:
    """Start ``command`` under a keeper that holds ``lock``'s session open until every
    process of its tree is gone (see `pgleaderlock.proctree`), with ``env`` (default:
    this process's environment). The keeper's reports are logged.

    Raises:
        ConnectionError: ``lock`` does not lead (any more).
        FileNotFoundError: the command is not found (exit 127).
        OSError: it cannot be executed (exit 126).
    """

    def report(what: str, count: int) -> None:
        if what == "left":
            log("WARNING", "command_left_processes", lock=lock.label, count=count,
                action="terminating them", kill_after_s=kill_after_s)  # fmt: skip
        elif what == "killed":
            log("WARNING", "command_killed", lock=lock.label, signal="SIGKILL", count=count)
        else:
            log("ERROR", "keeper_died", lock=lock.label, killed=count)

    def waiting() -> None:
        log("WARNING", "waiting_for_last_command", lock=lock.label,
            reason="the last leader's command on this host is still being stopped")  # fmt: skip

    sock, hostlock = await held_by_keeper(lock, waiting)
    try:
        return await CommandTree.start(
            command, session_fd=sock, hostlock_fd=hostlock, kill_after_s=kill_after_s,
            env=env, report=report,
        )  # fmt: skip
    finally:
        for fd in (sock, hostlock):
            if fd is not None:
                os.close(fd)


async def _supervise(
    lock: LeaderLock,
    tracker: Tracker,
    signals: Signals,
    command: list[str],
    kill_after_s: float,
) -> int:
    """Run ``command`` while leader; forward signals; terminate it if leadership is lost."""
    try:
        if not lock.is_leader or tracker.lost.is_set():  # lost in the instant since acquiring
            raise ConnectionError("not leading")
        tree = await start_tree(lock, command, kill_after_s)
    except ConnectionError:  # from start_tree: no session to hold any more
        log("WARNING", "leadership_lost", lock=lock.label, action="not running COMMAND")
        return EXIT_LOST
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
        pid=tree.pid,
        backend_pid=lock.backend_pid,
        command=shlex.join(command),
    )
    try:
        while True:
            which, _ = await first(
                child=tree.wait(), lost=tracker.lost.wait(), signal=signals.wait()
            )
            if which == "child":
                code = exit_status(await tree.wait())
                log("INFO", "command_exited", pid=tree.pid, exit_code=code, lock=lock.label)
                return code
            if which == "signal":
                for sig in signals.take():
                    log("INFO", "signal_forwarded", signal=sig.name, pid=tree.pid, lock=lock.label)
                    tree.send_signal(sig)
                continue
            log(
                "WARNING",
                "leadership_lost",
                lock=lock.label,
                action="terminating COMMAND",
                pid=tree.pid,
                kill_after_s=kill_after_s,
            )
            await tree.stop()
            log("WARNING", "command_terminated", pid=tree.pid, exit_code=EXIT_LOST, lock=lock.label)
            return EXIT_LOST
    finally:  # cancelled or a bug: never leave the tree running unsupervised
        await tree.aclose()
