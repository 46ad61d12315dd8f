"""A command that leaves a process tree behind, and checks that an earlier one is gone.

``python tree_probe.py DIR TAG [SECONDS [stubborn]]``, run under a lock (``pgleaderlock exec``,
``cron``, the Django singleton command), one TAG per leadership (``term``: the value of
``$PGLEADERLOCK_TERM``, which ``cron`` sets):

1. it first writes ``DIR/check-TAG``: one line ``alive PID`` per process that an earlier
   probe (another TAG) recorded and that still runs (empty: every one is gone). Run as
   the next leader's command, this is the check "every descendant of the last leader's
   command is gone before the next one starts";
2. it then starts three processes that sleep SECONDS (default 30): a plain child (in
   its process group), one that escaped with ``setsid``, and one that a shell started
   in the background with ``setsid`` and left (a double fork: its parent is gone);
3. it writes ``DIR/pids-TAG`` (each process of its tree, itself included: ``PID
   STARTTIME`` per line, so a reused pid is not mistaken for it), then ``DIR/ready-TAG``,
   and sleeps SECONDS (``main(..., stay=False)``: returns, leaving the three behind).

``stubborn``: the probe and its three processes ignore SIGTERM (only SIGKILL ends them).

Each file is written whole (a rename), so a reader never sees half of one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot); None if it does not run (a
    zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def recorded(directory: Path, skip: str) -> list[tuple[int, str]]:
    """The ``(pid, start time)`` of every process the other probes recorded."""
    found = []
    for path in directory.glob("pids-*"):
        if path.name == f"pids-{skip}" or path.name.endswith(".tmp"):
            continue
        for line in path.read_text().splitlines():
            pid, started = line.split()
            found.append((int(pid), started))
    return found


def main(directory: Path, tag: str, seconds: float, stay: bool = True) -> None:
    alive = [pid for pid, started in recorded(directory, tag) if start_time(pid) == started]
    write(directory / f"check-{tag}", "".join(f"alive {pid}\n" for pid in alive))
    sleep = ["sleep", f"{seconds:g}"]
    quiet = {
        "stdin": subprocess.DEVNULL,
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
    }
    child = subprocess.Popen(sleep, **quiet)  # type: ignore[call-overload]
    escaped = subprocess.Popen(sleep, start_new_session=True, **quiet)  # type: ignore[call-overload]
    shell = f"setsid {' '.join(sleep)} </dev/null >/dev/null 2>&1 & echo $!"
    orphan = int(subprocess.run(["sh", "-c", shell], capture_output=True, text=True).stdout)
    pids = [os.getpid(), child.pid, escaped.pid, orphan]
    write(directory / f"pids-{tag}", "".join(f"{pid} {start_time(pid)}\n" for pid in pids))
    write(directory / f"ready-{tag}", "")
    if stay:
        time.sleep(seconds)


if __name__ == "__main__":
    tag = sys.argv[2] if sys.argv[2] != "term" else os.environ["PGLEADERLOCK_TERM"]
    if sys.argv[4:5] == ["stubborn"]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited through exec
    main(Path(sys.argv[1]), tag, float(sys.argv[3]) if len(sys.argv) > 3 else 30.0)
