"""What ``idle_scale.py`` reads from ``/proc``: the CPU time of a process and of its
children, and the machine's busy ticks.
"""

from __future__ import annotations

import contextlib
import os

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
        text = stat.read()
    return text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on


def _stat_cpu_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)


def process_cpu_ns(pid: int) -> int | None:
    """CPU time of a single-threaded process in ns: the scheduler's runtime when the
    kernel keeps it (``/proc/<pid>/schedstat``), else utime + stime; None if gone."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as schedstat:
            return int(schedstat.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    try:
        return _stat_cpu_ticks(pid) * 1_000_000_000 // _CLK_TCK
    except (OSError, ValueError, IndexError):
        return None


def children_of(parent: int) -> list[int]:
    """Every process whose parent is ``parent``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if int(_stat_fields(int(entry))[1]) == parent:
                    out.append(int(entry))
    return out


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine since boot (``/proc/stat``)."""
    with open("/proc/stat", encoding="ascii") as stat:
        values = [int(v) for v in stat.readline().split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)
