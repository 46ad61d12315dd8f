"""What a newcomer runs first does what the README and the docs say (issue 23): the
demo's ``--help``, ``make demo`` with options, and the README's quick start, stopped
with Ctrl-C."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[2]
README: Final = (REPO / "README.md").read_text()
BOUND_S: Final = 30.0


def test_demo_help_is_plain_text() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pgleaderlock.demo", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    text = done.stdout
    # No Markdown fences or code spans, no mkdocstrings cross-references.
    assert "`" not in text, text
    assert "][" not in text, text
    assert "running one LeaderLock." in text, text
    # The examples are there, each on a line of its own.
    lines = [line.strip() for line in text.splitlines()]
    assert "python -m pgleaderlock.demo" in lines, text
    assert "python -m pgleaderlock.demo --dsn postgresql://... --kill terminate --rounds 3" in lines


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_demo_passes_the_readme_options_through() -> None:
    example = re.search(r'`make demo ARGS="([^"]+)"`', README)
    assert example is not None, "the README shows no `make demo ARGS=...` example"
    done = subprocess.run(
        ["make", "-n", "demo", f"ARGS={example.group(1)}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == f"./scripts/demo.sh {example.group(1)}"


def _quick_start(dsn: str, lock_name: str) -> str:
    section = README.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    source = code.group(1)
    assert '"nightly-report"' in source
    assert '"postgresql://app@db.internal/app"' in source
    return source.replace('"nightly-report"', repr(lock_name)).replace(
        '"postgresql://app@db.internal/app"', repr(dsn)
    )


def _wait_for_line(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        got = proc.stdout.readline()
        if got.strip() == line:
            return
        if not got and proc.poll() is not None:
            break
    pytest.fail(f"{line!r} not printed (exit {proc.poll()})")


def _ctrl_c_exits_cleanly(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    out, err = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 0, (out, err)
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err, err


@pytest.mark.integration
def test_quick_start_stops_cleanly_on_ctrl_c_and_hands_over(pg_dsn: str, tmp_path: Path) -> None:
    script = tmp_path / "quick_start.py"
    script.write_text(_quick_start(pg_dsn, f"offline-quickstart-{uuid.uuid4().hex[:8]}"))
    first = subprocess.Popen(
        [sys.executable, "-u", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    second: subprocess.Popen[str] | None = None
    try:
        _wait_for_line(first, "I am the leader now")
        second = subprocess.Popen(
            [sys.executable, "-u", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _ctrl_c_exits_cleanly(first)
        _wait_for_line(second, "I am the leader now")  # the other one takes over
        _ctrl_c_exits_cleanly(second)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.communicate(timeout=BOUND_S)
