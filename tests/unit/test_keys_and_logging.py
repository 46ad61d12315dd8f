"""lock_keys golden values, key validation, DSN masking and structured log lines."""

from __future__ import annotations

import logging

import pytest

from pgleaderlock import ConfigurationError, lock_keys
from pgleaderlock.core._logging import format_event, get_logger, mask_dsn
from pgleaderlock.core.keys import check_key

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
