"""The parent's side of ``idle_scale.py``'s worker processes: the variants measured (a
library revision on its own PYTHONPATH, or raw sessions), a worker process started,
commanded and stopped, and the neighbour processes of ``--neighbour``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from _common import library_revision
from _idle_scale_proc import _CLK_TCK, _stat_cpu_ticks

HERE = Path(__file__).resolve().parent


@dataclass
class Variant:
    """A library to run the workers with (``src`` on PYTHONPATH), or the raw sessions."""

    label: str
    src: Path | None  # None: inherit this process's environment
    impl: str = "lib"  # lib, raw, raw-probe, raw-ping
    revision: str = ""

    @property
    def raw(self) -> bool:
        return self.impl != "lib"

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``LABEL=SRC``, ``raw``, ``raw-probe``, ``raw-ping`` or ``current``."""
        if text == "raw":
            return cls("raw", None, impl="raw", revision="raw driver sessions")
        if text == "raw-probe":
            return cls("raw-probe", None, impl="raw-probe", revision="raw sessions, probing")
        if text == "raw-ping":
            return cls("raw-ping", None, impl="raw-ping", revision="raw sessions, Sync every 5 s")
        if text == "current":
            return cls("current", None, revision=_revision(None))
        label, sep, src = text.partition("=")
        if not sep or not label or not src:
            raise argparse.ArgumentTypeError(f"expected LABEL=SRC, raw or current: {text!r}")
        path = Path(src).resolve()
        if not (path / "pgleaderlock" / "__init__.py").is_file():
            raise argparse.ArgumentTypeError(f"{path} has no pgleaderlock package")
        return cls(label, path, revision=_revision(path))

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.src is not None:
            env["PYTHONPATH"] = str(self.src)
        return env


def _revision(src: Path | None) -> str:
    """The commit of the checkout ``src`` belongs to (or of the library imported here)."""
    if src is None:
        pythonpath = os.environ.get("PYTHONPATH", "")
        src = Path(pythonpath.split(os.pathsep)[0]) if pythonpath else HERE.parent / "src"
    return library_revision(src)


class Worker:
    """One worker process: commands on its stdin, JSON lines from its stdout."""

    def __init__(
        self,
        role: str,
        variant: Variant,
        *,
        dsn: str,
        n: int,
        prefix: str,
        backend: str,
        log_dir: Path,
        announce: bool = False,
        connect_fn: bool = False,
        ready_timeout_s: float = 180.0,
    ) -> None:
        command = [
            sys.executable,
            str(HERE / "idle_scale.py"),
            "--worker",
            role,
            "--impl",
            variant.impl,
            "--n",
            str(n),
            "--prefix",
            prefix,
            "--dsn",
            dsn,
            "--backend",
            backend,
            "--ready-timeout",
            str(ready_timeout_s),
        ]
        if announce:
            command.append("--announce")
        if connect_fn:
            command.append("--connect-fn")
        self.role = role
        self.log_path = log_dir / f"{prefix}-{role}.log"
        self._log: TextIO = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=variant.env(),
            text=True,
            bufsize=1,
        )
        _LIVE.add(self)
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"read-{role}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next line of kind ``event`` (earlier lines of other kinds are dropped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.role}: no {event!r} within {timeout_s:g} s")
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(
                    f"{self.role} worker exited (code {self.proc.wait(5)}); see {self.log_path}"
                )
            if line.get("event") == event:
                return line

    def ask(self, command: str, event: str, timeout_s: float = 30.0) -> dict[str, Any]:
        """Send ``command``; return the answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.expect(event, timeout_s)

    def cpu_s(self) -> float:
        """utime + stime of the process so far."""
        return _stat_cpu_ticks(self.pid) / _CLK_TCK

    def stop(self, timeout_s: float = 60.0) -> float | None:
        """Stop the sessions (shutdown), end the process; the shutdown's duration."""
        took = None
        with contextlib.suppress(Exception):
            took = float(self.ask("stop", "stopped", timeout_s)["shutdown_s"])
        self.close()
        return took

    def kill(self) -> None:
        """SIGKILL, now."""
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self) -> None:
        """End the process (SIGKILL if it does not exit by itself), reap it."""
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        self._log.close()
        _LIVE.discard(self)


_LIVE: set[Worker] = set()


def kill_all_workers() -> None:
    """SIGKILL every worker still running (every exit path calls this)."""
    for worker in list(_LIVE):
        worker.kill()
        with contextlib.suppress(Exception):
            worker.close()


@contextlib.contextmanager
def neighbours(count: int, seconds: float) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` CPU-bound busy loops that end by themselves after ``seconds``."""
    code = (
        "import sys, time\nend = time.monotonic() + float(sys.argv[1])\n"
        "while time.monotonic() < end: pass"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seconds)]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
