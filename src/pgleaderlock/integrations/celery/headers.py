"""What every leader send carries, for the workers: the slot, the term and the
schedule in headers, and a task id derived from the schedule and the slot (the same
slot always gets the same id)."""

from __future__ import annotations

import uuid
from typing import Any

from ...schedule import Run

__all__ = ["SCHEDULE_HEADER", "SLOT_HEADER", "TERM_HEADER", "send_headers", "task_id"]

SLOT_HEADER = "pgleaderlock_slot"
"""The header that carries a send's slot (ISO 8601, UTC)."""
TERM_HEADER = "pgleaderlock_term"
"""The header that carries the fencing term of the leadership that sent it."""
SCHEDULE_HEADER = "pgleaderlock_schedule"
"""The header that carries the schedule's name in the ledger (``<lock>:<entry>``)."""

_TASK_IDS = uuid.UUID("5f0c1b52-9a53-4c1e-8a63-6d1e1f3a2c77")


def send_headers(run: Run) -> dict[str, Any]:
    """The headers of ``run``'s send."""
    return {SLOT_HEADER: run.slot.isoformat(), TERM_HEADER: run.term, SCHEDULE_HEADER: run.schedule}


def task_id(run: Run) -> str:
    """The task id of ``run``'s send: the same for the same schedule and slot."""
    return str(uuid.uuid5(_TASK_IDS, f"{run.schedule}|{run.slot}"))
