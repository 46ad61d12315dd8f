"""``pgleaderlock cron``: run a command once per slot of a schedule across a fleet.

Every host runs the same ``pgleaderlock cron``; the one that leads the lock claims each
slot in the schedule ledger (``pgleaderlock.schedule``) and runs COMMAND for it. A slot
is claimed at most once, ever, so a failover neither runs a slot twice nor (per
``--catch-up``) skips it. Each run's exit status goes into the ledger (``done`` for 0,
``failed`` with ``exit N`` otherwise) and ``pgleaderlock status`` shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import shlex
import shutil
import signal

import click

from ..lowlevel import ConfigurationError, ExponentialBackoff, LeaderLock
from ..proctree.tree import CommandTree, become_subreaper
from ..schedule import Cron, Every, JobFunction, Policy, Run, RunFailed, Scheduler, Timing
from .exec import exit_status, start_tree
from .exits import EXIT_CANNOT_EXECUTE, EXIT_NOT_ACQUIRED, EXIT_NOT_FOUND, EXIT_OK, CliError
from .logs import log
from .options import (
    Common,
    Tables,
    choice_option,
    command_of_a_command,
    lock_options,
    log_options,
    positive,
    seconds_option,
    table_options,
)
from .runtime import Signals, build_lock, first, permanent_error, preflight
from .tracker import Tracker

__all__ = ["cron"]

_CRON_EPILOG = """\b
Examples:
  # on every host: the backup runs once a night, on whichever host leads
  pgleaderlock cron --name backup --schedule "0 3 * * *" -- ./backup.sh
  # every 30 s, and after an outage run every slot that was missed (at most 100)
  pgleaderlock cron --name sync --every 30 --catch-up all -- python -m app.sync
  # 03:00 Berlin time, daylight saving included
  pgleaderlock cron --name report --schedule "0 3 * * *" --timezone Europe/Berlin -- ./report
  # the tables in their own schema, made by a migration role (pgleaderlock sql)
  pgleaderlock cron --name backup --every 3600 --schema locks --trusted-role migrator -- ./b.sh

\b
COMMAND gets PGLEADERLOCK_SLOT (the slot, ISO 8601 UTC), PGLEADERLOCK_TERM (the fencing
term it runs under) and PGLEADERLOCK_SCHEDULE in its environment, and runs in a process
group of its own. If leadership is lost while it runs, every process of its tree gets
SIGTERM, then SIGKILL after --kill-after; its slot stays "running" and the next leader
applies --interrupted. On SIGTERM/SIGINT to cron, a running COMMAND gets --drain
seconds to finish, then it is stopped the same way; its slot is recorded with how it
ended (done for exit 0, failed otherwise), and the lock is released. As for exec, no
process of COMMAND's tree outlives the lock, a SIGKILLed cron included. The tables go
in --schema; with tables made by a migration role (pgleaderlock sql), name it with
--trusted-role.

\b
Exit codes: 0 after SIGTERM/SIGINT (a running COMMAND is stopped the same way first,
or finishes within --drain); 1 if the lock stops by itself; 2 for bad input, an
unreachable server or one that refuses this client for good; 126/127 if COMMAND cannot
be executed / is not found (checked before the first slot).
"""


@command_of_a_command("cron", _CRON_EPILOG)
@lock_options
@table_options
@click.option(
    "--schedule",
    "expression",
    metavar="CRON",
    default=None,
    help='A five-field cron expression, e.g. "0 3 * * *".',
)
@seconds_option(
    "--every", default=None, text="Or: a slot every this many seconds (from the epoch)."
)
@click.option(
    "--timezone",
    default="UTC",
    show_default=True,
    help="The time zone of --schedule (an IANA name).",
)
@choice_option(
    "--catch-up",
    ["none", "latest", "all"],
    default="latest",
    text="Slots missed while nobody led: skip them, run the newest, or run all.",
)
@seconds_option(
    "--misfire-grace",
    default=1.0,
    text="A slot started later than this after its time counts as missed.",
)
@choice_option(
    "--interrupted",
    ["lost", "rerun"],
    default="lost",
    text="A slot whose leader ended mid-run: record it lost, or run it again.",
)
@seconds_option(
    "--kill-after",
    default=10.0,
    text="When leadership is lost, or COMMAND exited and left processes running: seconds "
    "between SIGTERM and SIGKILL to what runs of COMMAND's tree.",
)
@seconds_option(
    "--drain", default=0.0, text="On SIGTERM/SIGINT: how long a running COMMAND may finish first."
)
@seconds_option(
    "--health-interval", default=5.0, text="Seconds between health probes while leader."
)
@log_options(cli="INFO", library="WARNING")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def cron(
    common: Common,
    tables: Tables,
    expression: str | None,
    every: float | None,
    timezone: str,
    catch_up: str,
    misfire_grace: float,
    interrupted: str,
    kill_after: float,
    drain: float,
    health_interval: float,
    command: tuple[str, ...],
) -> int:
    """Run COMMAND once per slot of a schedule, on whichever host leads the lock.

    Every host of a fleet runs the same `cron`; a slot is claimed in the database's
    schedule ledger before COMMAND runs, so it runs at most once across the fleet,
    failovers and restarts included. Put `--` before COMMAND.
    """
    timing = _timing(expression, every, timezone)
    kill_after = positive("--kill-after", kill_after)
    if shutil.which(command[0]) is None:
        code = EXIT_NOT_FOUND if not os.path.exists(command[0]) else EXIT_CANNOT_EXECUTE
        log("ERROR", "command_not_found", command=command[0], exit_code=code)
        return code
    lock, tracker = build_lock(
        common,
        # A server that went away is tried again within 2 s, as a lock's default does
        # (every 0.1 s while it looks down: a failover under way).
        ExponentialBackoff(base_s=1.0, max_s=30.0, error_max_s=2.0, down_s=0.1),
        fencing=True,
        fencing_schema=tables.schema,
        trusted_roles=tables.trusted_roles,
        health_interval_s=health_interval,
        # The lock's drain bounds the whole deliberate stop: --drain for COMMAND, then
        # --kill-after for its tree, then the statement that records its slot.
        drain_s=drain + kill_after + _RECORD_S,
    )
    stop = _Stop(drain)
    try:
        sched = Scheduler(lock)
        sched.add(
            _job(list(command), lock, kill_after, stop),
            timing,
            name="cron",
            policy=Policy(
                catch_up=catch_up,  # type: ignore[arg-type]  # click checked it
                misfire_grace_s=positive("--misfire-grace", misfire_grace),
                interrupted=interrupted,  # type: ignore[arg-type]
            ),
        )
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None
    become_subreaper()  # if a keeper dies, what is left of COMMAND's tree comes here
    return asyncio.run(_serve(common, lock, tracker, sched, timing, stop))


_RECORD_S = 10.0
"""Beyond --drain and --kill-after: the bound on recording the stopped run's slot."""


class _Stop:
    """cron's own stop (SIGTERM/SIGINT), as the running COMMAND sees it: ``requested``
    is set before the lock drains; COMMAND then has ``drain_s`` to finish."""

    def __init__(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self.requested = asyncio.Event()
        self.signal = "SIGTERM"


def _timing(expression: str | None, every: float | None, timezone: str) -> Timing:
    if (expression is None) == (every is None):
        raise CliError("give one of --schedule CRON and --every SECONDS")
    try:
        if every is not None:
            return Every(dt.timedelta(seconds=positive("--every", every)))
        assert expression is not None
        return Cron(expression, timezone)
    except ConfigurationError as exc:
        raise CliError(str(exc)) from None


def _job(command: list[str], lock: LeaderLock, kill_after_s: float, stop: _Stop) -> JobFunction:
    """The scheduled job: COMMAND for one slot; a non-zero exit fails the run. On cron's
    own stop, COMMAND gets ``stop.drain_s`` to finish, then is stopped, and the run ends
    with COMMAND's exit status (its slot recorded as such, not left running)."""

    async def run_command(run: Run) -> None:
        env = {
            **os.environ,
            "PGLEADERLOCK_SLOT": run.slot.isoformat(),
            "PGLEADERLOCK_TERM": str(run.term),
            "PGLEADERLOCK_SCHEDULE": run.schedule,
        }
        tree = await start_tree(lock, command, kill_after_s, env)
        slot = run.slot.isoformat()
        log("INFO", "command_started", lock=lock.label, pid=tree.pid, slot=slot,
            term=run.term, command=shlex.join(command))  # fmt: skip
        stopped = False
        try:
            code, stopped = await _wait_or_stop(tree, stop, lock.label, kill_after_s)
        except asyncio.CancelledError:
            if stop.requested.is_set():  # the lock's bound on the stop passed first
                log("WARNING", "command_stop_cut_short", lock=lock.label, pid=tree.pid,
                    slot=slot, action="terminating COMMAND")  # fmt: skip
            else:
                log("WARNING", "leadership_lost", lock=lock.label, action="terminating COMMAND",
                    pid=tree.pid, kill_after_s=kill_after_s)  # fmt: skip
            await asyncio.shield(tree.stop())
            raise
        finally:
            await asyncio.shield(tree.aclose())
        if stopped:
            log("INFO", "command_stopped", lock=lock.label, pid=tree.pid, exit_code=code,
                slot=slot, reason=f"cron got {stop.signal}")  # fmt: skip
            if code != 0:
                raise RunFailed(f"exit {code} (stopped: cron got {stop.signal})")
            return
        log("INFO", "command_exited", lock=lock.label, pid=tree.pid, exit_code=code,
            slot=slot)  # fmt: skip
        if code != 0:
            raise RunFailed(f"exit {code}")

    return run_command


async def _wait_or_stop(
    tree: CommandTree, stop: _Stop, label: str, kill_after_s: float
) -> tuple[int, bool]:
    """COMMAND's exit status, and whether cron's stop ended it: COMMAND runs until it
    exits, or until ``stop`` is requested and ``stop.drain_s`` has passed (then its
    tree gets SIGTERM, and SIGKILL after ``kill_after_s``)."""
    exited = asyncio.ensure_future(tree.wait())
    requested = asyncio.ensure_future(stop.requested.wait())
    try:
        await asyncio.wait({exited, requested}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            return exit_status(exited.result()), False
        if stop.drain_s > 0:
            with contextlib.suppress(TimeoutError):
                return exit_status(
                    await asyncio.wait_for(asyncio.shield(exited), stop.drain_s)
                ), False
        log("INFO", "command_stopping", lock=label, pid=tree.pid, signal="SIGTERM",
            kill_after_s=kill_after_s)  # fmt: skip
        return exit_status(await tree.stop()), True
    finally:
        for future in (exited, requested):
            future.cancel()
        await asyncio.gather(exited, requested, return_exceptions=True)


async def _serve(
    common: Common,
    lock: LeaderLock,
    tracker: Tracker,
    sched: Scheduler,
    timing: Timing,
    stop: _Stop,
) -> int:
    await preflight(common, lock)
    # The preflight reached the server: from here on a connection error is transient
    # (a restart, a failover), retried for as long as cron runs, even before the lock's
    # first attempt (FailFast gives up only on a server never reached).
    tracker.reached_server = True
    log("INFO", "cron_started", lock=lock.label, schedule=timing.spec,
        application_name=lock.application_name)  # fmt: skip
    sig: signal.Signals | None = None
    with Signals() as signals:
        async with sched, lock:
            which, _ = await first(signal=signals.wait(), stopped=tracker.stopped.wait())
            if which == "signal":
                sig = signals.take()[0]
                log("INFO", "cron_stopping", lock=lock.label, signal=sig.name)
                stop.signal = sig.name
                stop.requested.set()  # a running COMMAND: --drain, then stopped
                await lock.shutdown()  # drains first (--drain)
    if sig is not None:
        return EXIT_OK
    error = lock.stop_error
    if error is not None:
        raise permanent_error(common, error)
    return EXIT_NOT_ACQUIRED
