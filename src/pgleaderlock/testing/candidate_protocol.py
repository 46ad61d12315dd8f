"""The lines a candidate process prints: one JSON object per event, stamped with
``time.monotonic()`` (see [`pgleaderlock.testing.candidate`][pgleaderlock.testing.candidate]
for the events), written by the child and read by its parent."""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["DSN_ENV", "MODULE", "CandidateEvent", "parse_event", "write_event"]

DSN_ENV: Final = "PGLEADERLOCK_CANDIDATE_DSN"
"""The environment variable a child reads its DSN from (kept out of ``ps`` output)."""

MODULE: Final = "pgleaderlock.testing.candidate"


@dataclass(frozen=True)
class CandidateEvent:
    """One line printed by a candidate process.

    Attributes:
        t: ``time.monotonic()`` in the child when the event happened.
        event: the event's name (``acquired``, ``state``, ...).
        backend_pid: the server pid of the child's session then, if it had one.
        data: the line's other fields (``old`` and ``new`` of a ``state`` event, ...).
    """

    t: float
    event: str
    backend_pid: int | None
    data: dict[str, Any] = field(default_factory=dict)


_write_lock = threading.Lock()


def write_event(event: str, backend_pid: int | None = None, **data: object) -> None:
    """Print one event as a JSON line on stdout, stamped with ``time.monotonic()`` first.

    Args:
        event: the event's name.
        backend_pid: the server pid of the session concerned, if any.
        **data: more fields (JSON-serializable).
    """
    line = {"t": time.monotonic(), "event": event, "backend_pid": backend_pid, **data}
    text = json.dumps(line) + "\n"
    with _write_lock:
        sys.stdout.write(text)
        sys.stdout.flush()


def parse_event(line: str | bytes) -> CandidateEvent | None:
    """The event in one line printed by
    [`write_event`][pgleaderlock.testing.candidate.write_event], or None for any other line."""
    try:
        raw = json.loads(line)
        return CandidateEvent(
            float(raw.pop("t")), str(raw.pop("event")), raw.pop("backend_pid", None), raw
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
