"""lock_keys golden values, key validation, DSN masking and structured log lines: every
record names its event and lock, and every event the library logs is documented."""

from __future__ import annotations

import ast
import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import pgleaderlock
from pgleaderlock import (
    ConfigurationError,
    Coordinator,
    LeaderLock,
    LockOptions,
    Session,
    lock_keys,
)
from pgleaderlock.core._logging import format_event, get_logger, mask_dsn
from pgleaderlock.core.keys import check_key

if TYPE_CHECKING:
    from conftest import JsonLogCheck

# Computed by PostgreSQL 15: SELECT ('x'||substr(md5(n),1,8))::bit(32)::int, ...9,8...
GOLDEN = {
    "a": (214005177, -1057900888),
    "billing-scheduler": (-1810666763, 228481242),
}


def test_lock_keys_golden() -> None:
    for name, keys in GOLDEN.items():
        assert lock_keys(name) == keys
    k1, k2 = lock_keys("ünïcødé 🔒")
    assert -(2**31) <= k1 < 2**31
    assert -(2**31) <= k2 < 2**31


@pytest.mark.parametrize("bad", ["", None, 5, b"bytes"])
def test_lock_keys_rejects_bad_names(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="non-empty string"):
        lock_keys(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["a\x00b", "line\nfake_event", "tab\there", "\x7f"])
def test_bad_names_are_refused(bad: str) -> None:
    """A NUL would make every connection fail (it goes into ``application_name``), and a
    newline would forge a log line: refused at construction, before any I/O."""
    with pytest.raises(ConfigurationError, match="control characters"):
        lock_keys(bad)
    with pytest.raises(ConfigurationError, match="control characters"):
        LeaderLock.from_name(bad, "postgresql://u@h/db")
    with pytest.raises(ConfigurationError, match="control characters"):
        LeaderLock(
            "postgresql://u@h/db", 1, 2, options=LockOptions(session=Session(application_name=bad))
        )
    with pytest.raises(ConfigurationError, match="control characters"):
        Coordinator("postgresql://u@h/db", group="g").add(bad, _worker)


async def _worker(ctx: object) -> None:
    return None


def test_check_key_bounds() -> None:
    assert check_key("k", -(2**31)) == -(2**31)
    assert check_key("k", 2**31 - 1) == 2**31 - 1
    with pytest.raises(ConfigurationError, match="outside the signed 32-bit range"):
        check_key("k", 2**31)


@pytest.mark.parametrize(
    ("dsn", "masked"),
    [
        ("postgresql://u:secret@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("postgres://u:p%40ss@h/db?sslmode=require", "postgres://u:***@h/db?sslmode=require"),
        ("postgresql://u@h/db?password=secret&x=1", "postgresql://u@h/db?password=***&x=1"),
        ("host=h password=secret user=u", "host=h password=*** user=u"),
        ("host=h password='se cret' user=u", "host=h password=*** user=u"),
        ("postgresql://h/db", "postgresql://h/db"),
        (
            "connect failed for postgresql://a:b@h/db: refused",
            "connect failed for postgresql://a:***@h/db: refused",
        ),
    ],
)
def test_mask_dsn(dsn: str, masked: str) -> None:
    assert mask_dsn(dsn) == masked


def test_structured_messages(caplog: pytest.LogCaptureFixture) -> None:
    assert format_event("state_change", {"from": "leader", "to": "follower", "x": None}) == (
        "state_change from=leader to=follower"
    )
    assert format_event("e", {"error": 'he said "no"'}) == 'e error="he said \\"no\\""'
    # one line whatever a value holds: no value can forge a record of its own
    forged = format_event("e", {"lock": "x\nlock_lost lock=y", "why": "a\rb\tc\x00"})
    assert forged == 'e lock="x\\nlock_lost lock=y" why="a\\rb\\tc\\x00"'
    assert "\n" not in forged
    with caplog.at_level(logging.INFO, logger="pgleaderlock"):
        get_logger().info("lock_acquired", key1=1, key2=-2, attempt=3)
    record = caplog.records[-1]
    assert record.name == "pgleaderlock"
    assert record.getMessage() == "lock_acquired key1=1 key2=-2 attempt=3"
    fields = record.pgleaderlock  # type: ignore[attr-defined]
    assert fields == {"event": "lock_acquired", "key1": 1, "key2": -2, "attempt": 3}


def test_structured_fields_are_json_serialisable(caplog: pytest.LogCaptureFixture) -> None:
    """A JSON formatter must never meet an enum or an exception object."""
    import json

    from pgleaderlock import LockState

    with caplog.at_level(logging.INFO, logger="pgleaderlock"):
        get_logger().info("state_change", to=LockState.LEADER, error=ValueError("x"), lock="a")
    fields = caplog.records[-1].pgleaderlock  # type: ignore[attr-defined]
    assert fields == {"event": "state_change", "to": "leader", "error": "x", "lock": "a"}
    json.dumps(fields)


# ---------------------------------------------------------------- every event documented

SRC = Path(pgleaderlock.__file__).resolve().parent
DOCS = Path(__file__).resolve().parents[2] / "docs"
LEVELS = {"debug", "info", "warning", "error"}


def logging_calls() -> Iterator[tuple[str, ast.Call, ast.expr]]:
    """Every call in the library that writes a log record: (file, call, event argument).

    The shapes: ``log.info("event", ...)`` and ``self._log.info(...)`` (StructuredLogger),
    ``self._log(level, "event", ...)`` and ``Log(level, "event", ...)`` (the state
    machine), ``log(level, "event", ...)`` (the command line's own lines).
    """
    for path in sorted(SRC.rglob("*.py")):
        if "testing" in path.relative_to(SRC).parts:
            continue  # test helpers for users, not the library's own logging
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func, where = node.func, str(path.relative_to(SRC))
            if (
                isinstance(func, ast.Attribute)
                and func.attr in LEVELS
                and (
                    (isinstance(func.value, ast.Name) and func.value.id == "log")
                    or (isinstance(func.value, ast.Attribute) and func.value.attr == "_log")
                )
                and node.args
            ):
                yield where, node, node.args[0]
            elif (
                (isinstance(func, ast.Attribute) and func.attr == "_log")
                or (isinstance(func, ast.Name) and func.id in ("Log", "log"))
            ) and len(node.args) >= 2:
                yield where, node, node.args[1]


def emitted_events() -> set[str]:
    events: set[str] = set()
    for _, _call, event in logging_calls():
        if isinstance(event, ast.Constant) and isinstance(event.value, str):
            events.add(event.value)
    # The command line's "held elsewhere" line: its name is passed to contend()/lead().
    for path in (SRC / "cli").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    value = kw.value
                    if kw.arg == "event" and isinstance(value, ast.Constant):
                        events.add(str(value.value))
    return events


def test_the_scan_finds_the_library_events() -> None:
    events = emitted_events()
    for event in ("state_change", "lock_acquired", "session_opened", "leader_task_started",
                  "job_skipped", "callback_failed", "run_started", "not_acquired", "lock_busy"):  # fmt: skip
        assert event in events


def test_no_logging_call_passes_a_field_named_event() -> None:
    """``event`` is the record's event name; a field of that name would replace it in
    ``record.pgleaderlock``."""
    clashes = [
        f"{where}:{call.lineno}"
        for where, call, _ in logging_calls()
        if any(kw.arg == "event" for kw in call.keywords)
    ]
    assert clashes == []


def test_every_event_is_documented() -> None:
    documented = (DOCS / "logging.md").read_text()
    missing = sorted(e for e in emitted_events() if f"`{e}`" not in documented)
    assert missing == [], f"events missing from docs/logging.md: {missing}"


def test_lifecycle_records_carry_event_and_lock(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lock's records, DEBUG included, each name the event and the lock."""
    from pgleaderlock.testing import FakeServer

    server = FakeServer()

    async def lead_and_stop() -> None:
        options = LockOptions(load_plugins=False)
        lock = LeaderLock(None, 7, -8, connect_fn=server.connect, options=options)
        async with lock:
            assert await lock.wait_for_leadership(5)

    with caplog.at_level(logging.DEBUG, logger="pgleaderlock"):
        asyncio.run(lead_and_stop())
    records = [r for r in caplog.records if r.name.startswith("pgleaderlock")]
    events = [r.pgleaderlock["event"] for r in records]  # type: ignore[attr-defined]
    assert {"input", "state_change", "session_opened", "lock_acquired", "lock_stopped"} <= set(
        events
    )
    for record in records:
        fields = record.pgleaderlock  # type: ignore[attr-defined]
        assert fields["lock"] == "7,-8", record.getMessage()
        assert record.getMessage().split()[0] == fields["event"]
        json.dumps(fields)


def test_the_json_log_check_fails_a_record_a_json_formatter_cannot_write(
    json_log_check: JsonLogCheck,
) -> None:
    """The autouse check (tests/conftest.py) would fail this test at teardown."""
    from pgleaderlock import LockState

    raw = logging.getLogger("pgleaderlock")
    raw.error("raw", extra={"pgleaderlock": {"event": "raw", "state": LockState.LEADER}})
    assert len(json_log_check.problems) == 1
    assert "TypeError" in json_log_check.problems[0]
    json_log_check.problems.clear()
