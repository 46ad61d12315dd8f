"""What a newcomer runs first does what the README and the docs say (issue 23): the
demo's ``--help``, ``make demo`` with options, the README's quick start stopped with
Ctrl-C, and the FastAPI example's ``/leader`` answers."""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import pytest
from asgi_lifespan import LifespanManager

from cli.clitools import cli_command, python_m
from pgleaderlock import LeaderLock
from support.asgi import leader_view
from support.pgbouncer import PgBouncer, PoolMode
from support.poll import eventually

REPO: Final = Path(__file__).resolve().parents[2]
README: Final = (REPO / "README.md").read_text()
BOUND_S: Final = 30.0


def test_demo_help_is_plain_text() -> None:
    done = python_m("pgleaderlock.demo", "--help", timeout_s=60)
    assert done.returncode == 0, done.stderr
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
        ["make", "--no-print-directory", "-n", "demo", f"ARGS={example.group(1)}"],
        cwd=REPO,
        # Under `make test` the outer make's flags would make this one a sub-make.
        env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")},
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


# ---------------------------------------------------------------- the FastAPI example

EXAMPLE_APP: Final = REPO / "examples" / "fastapi_app"


def _load_example(name: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> ModuleType:
    """``examples/fastapi_app/app.py`` as a module of its own (it reads its environment
    when imported): one replica."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location(name, EXAMPLE_APP / "app.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def example_logging() -> Iterator[None]:
    """The example sets its loggers' levels and a root handler when imported: undone."""
    names = ("", "pgleaderlock", "pgleaderlock.tasks", "example")
    levels = {name: logging.getLogger(name).level for name in names}
    handlers = list(logging.getLogger().handlers)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger().handlers[:] = handlers


@pytest.mark.integration
@pytest.mark.usefixtures("example_logging")
async def test_fastapi_example_readme_shows_the_real_leader_answers(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (EXAMPLE_APP / "README.md").read_text()
    block = re.search(r"curl -s localhost:8002/leader.*?```json\n(.*?)```", readme, re.DOTALL)
    assert block is not None, "no /leader answers in the example's README"
    shown_leader, shown_follower = (json.loads(line) for line in block.group(1).splitlines())

    lock_name = f"offline-fastapi-{uuid.uuid4().hex[:8]}"
    replicas = [
        _load_example(
            f"example_app_{r}", monkeypatch, PG_DSN=pg_dsn, LOCK_NAME=lock_name, REPLICA=r
        )
        for r in ("a", "b")
    ]
    async with LifespanManager(replicas[0].app) as a, LifespanManager(replicas[1].app) as b:

        async def views() -> list[dict[str, Any]]:
            return [await leader_view(a.app), await leader_view(b.app)]

        async def settled() -> bool:
            seen = await views()
            states = sorted(view["state"] for view in seen)
            tasks = sorted(str(view["tasks"]) for view in seen)
            told = all(view["leader"] is not None for view in seen)  # the leader watch read
            return states == ["acquiring", "leader"] and tasks == ["['heartbeat']", "[]"] and told

        await eventually(settled, 20.0, "one leader running its task, one waiting follower")
        real_leader, real_follower = sorted(await views(), key=lambda v: not v["is_leader"])

    for shown, real in ((shown_leader, real_leader), (shown_follower, real_follower)):
        assert list(shown) == list(real), "the README's fields are not the route's"
        # The README shows the example's own lock; the test ran one of its own.
        assert real["name"] == lock_name
        assert shown["name"] == "example-fastapi-app"
        assert shown["keys"] == list(LeaderLock.from_name(shown["name"], dsn=pg_dsn).keys)
        assert real["keys"] == list(LeaderLock.from_name(lock_name, dsn=pg_dsn).keys)
        assert (shown["leader_since"] is None) is (real["leader_since"] is None)
        if shown["leader_since"] is not None:
            dt.datetime.fromisoformat(shown["leader_since"])
        same = {k: v for k, v in real.items() if k not in ("name", "keys", "leader_since")}
        # Who leads: the same fields; its pid and application_name are the run's own.
        told, shown_told = same.pop("leader"), shown["leader"]
        assert list(shown_told) == list(told)
        assert shown_told["application_name"].startswith("pgleaderlock:example-fastapi-app@")
        varying = ("pid", "application_name", "role")
        assert {k: v for k, v in told.items() if k not in varying} == {
            k: v for k, v in shown_told.items() if k not in varying
        }
        assert {k: shown[k] for k in same} == same


# ---------------------------------------------------------------- docs/cli.md quotes the CLI


def _normalized(line: str, lock_name: str) -> str:
    line = re.sub(r"postgresql://\S+", "DSN", line.replace(lock_name, "LOCK"))
    return re.sub(r"-?\d+", "N", line)


def test_cli_docs_quote_the_pooler_refusal_the_cli_prints(
    pgbouncer_factory: Callable[[PoolMode], PgBouncer],
) -> None:
    docs = (REPO / "docs" / "cli.md").read_text()
    block = re.search(
        r"```console\n\$ pgleaderlock exec [^\n]*47799[^\n]*\n(.*?)```", docs, re.DOTALL
    )
    assert block is not None, "docs/cli.md no longer shows the run through a pooler"
    shown = block.group(1).splitlines()

    bouncer = pgbouncer_factory("transaction")
    lock_name = f"offline-pooler-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [*cli_command(), "exec", "--dsn", bouncer.dsn(), "--name", lock_name, "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    printed = done.stderr.splitlines()
    assert [_normalized(line, lock_name) for line in printed] == [
        _normalized(line, "nightly-report") for line in shown
    ]
