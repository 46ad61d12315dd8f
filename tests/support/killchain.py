"""SIGKILL a lock's leader while its command's process tree runs, and check that the next
leader's command starts only once every process of that tree is gone.

The command is ``tree_probe.py`` (see there): each leader's probe records its tree and,
first thing, checks the trees that earlier leaders' probes recorded. A chain of leaders
on one lock, each SIGKILLed once the next one waits for the lock, runs this check
``RUNS`` times for the price of one process start each, and ``POOL`` candidates wait at
any time so that their starts overlap the runs.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import statistics
import sys
import time
from pathlib import Path

from support.tree_probe import recorded, start_time

__all__ = [
    "POOL",
    "PROBE",
    "RUNS",
    "check_of",
    "descendants_of",
    "exited_within",
    "kill_recorded",
    "probe",
    "ready_tags",
    "summary",
    "tree_of",
]

PROBE = Path(__file__).with_name("tree_probe.py")
RUNS = 20
POOL = 2
"""How many candidates wait at any time (their starts overlap the runs)."""


def probe(directory: Path, tag: str, seconds: float = 30.0, *, stubborn: bool = False) -> list[str]:
    """The probe's command line (``tag``, ``stubborn``: see ``tree_probe``)."""
    return [sys.executable, str(PROBE), str(directory), tag, f"{seconds:g}",
            *(["stubborn"] if stubborn else [])]  # fmt: skip


def ready_tags(directory: Path) -> set[str]:
    """The tags of the probes that have recorded their tree."""
    paths = directory.glob("ready-*")
    return {path.name.removeprefix("ready-") for path in paths if path.suffix != ".tmp"}


def tree_of(directory: Path, tag: str) -> list[int]:
    """The pids of the tree the probe ``tag`` recorded that still run."""
    path = directory / f"pids-{tag}"
    pids = []
    for line in path.read_text().splitlines():
        pid, started = line.split()
        if start_time(int(pid)) == started:
            pids.append(int(pid))
    return pids


def check_of(directory: Path, tag: str) -> list[str]:
    """What the probe ``tag`` found still running of the earlier trees, when it started."""
    return (directory / f"check-{tag}").read_text().splitlines()


def exited_within(pids: list[int], since: float, timeout_s: float) -> float:
    """Block until every process of ``pids`` has exited (a zombie has); return the
    seconds from ``since`` (a ``time.monotonic()``) until the last one had.

    Raises:
        AssertionError: one still runs after ``timeout_s``.
    """
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    try:
        waiting = list(fds)
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            assert left > 0, f"{len(waiting)} of {pids} still run after {timeout_s} s"
            readable, _, _ = select.select(waiting, [], [], left)
            waiting = [fd for fd in waiting if fd not in readable]
        return time.monotonic() - since
    finally:
        for fd in fds:
            os.close(fd)


def descendants_of(root: int) -> list[int]:
    """The running processes below ``root`` (the tests' own walk of ``/proc``)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] not in ("Z", "X"):
                    parents[int(entry)] = int(fields[1])
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        below = [pid for pid, ppid in parents.items() if ppid == parent]
        found += below
        todo += below
    return found


def kill_recorded(directory: Path) -> None:
    """SIGKILL whatever the probes recorded that still runs (a failed test's leftovers)."""
    for pid, started in recorded(directory, skip=""):
        if start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def summary(what: str, seconds: list[float]) -> str:
    """``what``: the median and the maximum of ``seconds``, in ms."""
    return (
        f"{what}: SIGKILL to every descendant gone, median "
        f"{statistics.median(seconds) * 1000:.1f} ms, max {max(seconds) * 1000:.1f} ms "
        f"over {len(seconds)} runs"
    )
