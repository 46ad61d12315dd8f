"""``metadata=``: checked where it enters (the constructor, ``ConfigurationError``), and
read back without ever raising (another process's row is untrusted input)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pgleaderlock import ConfigurationError, LeaderLock, LockOptions, Participation
from pgleaderlock.core.metadata import (
    METADATA_MAX_BYTES,
    METADATA_MAX_DEPTH,
    check_metadata,
    read_metadata,
)

DSN = "postgresql://nobody@127.0.0.1:1/none"


def nested(depth: int) -> dict[str, Any]:
    """An object nested ``depth`` levels deep (the outermost counts as one)."""
    document: dict[str, Any] = {}
    for _ in range(depth - 1):
        document = {"a": document}
    return document


def cycle() -> dict[str, Any]:
    document: dict[str, Any] = {}
    document["self"] = document
    return document


REFUSED: dict[str, tuple[Any, str]] = {
    "NaN": ({"x": float("nan")}, "NaN"),
    "infinity": ({"x": [1, float("inf")]}, "infinity"),
    "minus infinity": ({"x": {"y": -float("inf")}}, "infinity"),
    "NUL in a string": ({"x": "a\x00b"}, "NUL"),
    "NUL in a key": ({"a\x00": 1}, "NUL"),
    "lone surrogate": ({"x": "\ud800"}, "surrogate"),
    "2,000 deep": (nested(2000), "deeper than 32"),
    "33 deep": (nested(METADATA_MAX_DEPTH + 1), "deeper than 32"),
    "a cycle": (cycle(), "deeper than 32"),
    "an int key": ({1: "x"}, "not a string"),
    "a set": ({"x": {1, 2}}, "not a JSON value"),
    "bytes": ({"x": b"raw"}, "not a JSON value"),
    "too large": ({"x": "y" * METADATA_MAX_BYTES}, "bytes as JSON"),
    "too many values": ({"x": [0] * (METADATA_MAX_BYTES + 1)}, "more than"),
    "an int of 5,000 digits": ({"x": 10**5000}, "JSON-serialisable"),
    "not a mapping": ([1, 2], "must be a mapping"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_constructor_refuses_metadata_no_reader_can_represent(case: str) -> None:
    """Each fails at construction with ``ConfigurationError`` (before: NaN and NUL
    passed and failed later on the server, 2,000 deep raised ``RecursionError``)."""
    document, message = REFUSED[case]
    with pytest.raises(ConfigurationError, match=message):
        LeaderLock(DSN, 1, 2, options=_published(document))
    with pytest.raises(ConfigurationError, match=message):
        check_metadata(document)


def test_plain_json_is_accepted_as_compact_sorted_text() -> None:
    document = {"b": [1, 2.5, True, None, "é"], "a": nested(METADATA_MAX_DEPTH - 1)}
    text = check_metadata(document)
    assert text is not None
    assert json.loads(text) == document
    assert text.startswith('{"a":')
    lock = LeaderLock(DSN, 1, 2, options=_published(document))
    assert lock.metadata == document


UNREADABLE = {
    "3,000 deep": "[" * 3000 + "]" * 3000,
    "an int of 5,000 digits": '{"x": ' + "9" * 5000 + "}",
    "33 deep": json.dumps(nested(METADATA_MAX_DEPTH + 1)),
    "not JSON": "{",
    "too large": json.dumps({"x": "y" * METADATA_MAX_BYTES}),
    "infinity": '{"x": Infinity}',
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_reading_never_raises(case: str) -> None:
    document, why = read_metadata(UNREADABLE[case])
    assert document is None
    assert why


def test_reading_plain_json() -> None:
    assert read_metadata('{"address": "http://a:1"}') == ({"address": "http://a:1"}, None)
    assert read_metadata("[1, 2]") == ({"value": [1, 2]}, None)


def _published(document: object) -> LockOptions:
    """Options that publish ``document`` (checked by ``Participation``)."""
    return LockOptions(participation=Participation(metadata=document), load_plugins=False)  # type: ignore[arg-type]
