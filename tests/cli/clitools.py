"""Helpers for the command-line tests: run the real console script as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def cli_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("pgleaderlock")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("pgleaderlock")
    return [found] if found else [sys.executable, "-m", "pgleaderlock.cli"]


CLI = cli_command()


def python_m(
    module: str, *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with this interpreter, its output captured as text
    (the caller checks the exit status)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PG_DSN", "PGLEADERLOCK_DSN")}
    env.update(extra)
    return env


class CliProcess:
    """A running ``pgleaderlock`` process; stdout and stderr are collected line by line."""

    def __init__(self, proc: asyncio.subprocess.Process, args: tuple[str, ...]) -> None:
        self.proc = proc
        self.args = args
        self.out: list[str] = []
        self.err: list[str] = []
        self._changed = asyncio.Condition()
        assert proc.stdout is not None
        assert proc.stderr is not None
        self._readers = [
            asyncio.ensure_future(self._read(proc.stdout, self.out)),
            asyncio.ensure_future(self._read(proc.stderr, self.err)),
        ]

    async def _read(self, stream: asyncio.StreamReader, into: list[str]) -> None:
        while line := await stream.readline():
            into.append(line.decode(errors="replace").rstrip("\n"))
            async with self._changed:
                self._changed.notify_all()
        async with self._changed:
            self._changed.notify_all()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self) -> str:
        return "\n".join(self.out)

    @property
    def stderr(self) -> str:
        return "\n".join(self.err)

    def describe(self) -> str:
        return (
            f"pgleaderlock {' '.join(self.args)} (pid {self.pid}, rc {self.proc.returncode})\n"
            f"--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )

    async def expect(
        self, pattern: str, timeout: float = 15.0, *, stream: str = "err"
    ) -> re.Match[str]:
        """Wait until a line of stderr (or stdout) matches ``pattern``; return the match."""
        lines = self.err if stream == "err" else self.out
        regex = re.compile(pattern)

        def found() -> re.Match[str] | None:
            for line in lines:
                if match := regex.search(line):
                    return match
            return None

        try:
            async with asyncio.timeout(timeout), self._changed:
                while (match := found()) is None:
                    if all(r.done() for r in self._readers):
                        raise AssertionError(
                            f"process ended without {pattern!r}\n{self.describe()}"
                        )
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(
                f"no line matching {pattern!r} within {timeout} s\n{self.describe()}"
            ) from None
        return match

    def count(self, pattern: str) -> int:
        return sum(1 for line in self.err if re.search(pattern, line))

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 20.0) -> int:
        """Wait for the exit code (and the end of its output)."""
        try:
            async with asyncio.timeout(timeout):
                code = await self.proc.wait()
                await asyncio.gather(*self._readers)
        except TimeoutError:
            raise AssertionError(f"still running after {timeout} s\n{self.describe()}") from None
        return code

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()
        await asyncio.gather(*self._readers, return_exceptions=True)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    process: CliProcess

    def describe(self) -> str:
        return self.process.describe()


def process_gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # pragma: no cover - not Linux
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
