"""The workers' side: [`SlotTask`][pgleaderlock.integrations.celery.SlotTask], a task
that begins at most once per slot."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

from celery import Task
from celery.exceptions import Ignore

from ...lowlevel import get_logger
from ...schedule import SlotGuard
from .headers import SCHEDULE_HEADER, SLOT_HEADER
from .settings import BeatSettings

__all__ = ["SlotTask"]

log = get_logger("pgleaderlock.celery")


class SlotTask(Task):  # type: ignore[misc]
    """The base class of tasks that begin at most once per slot on the workers:
    ``Celery("proj", task_cls="pgleaderlock.integrations.celery:SlotTask")`` for every
    task of the app, or ``@app.task(base=SlotTask)`` for some.

    Before a task that the leader scheduler sent begins (one with the
    ``pgleaderlock_slot`` header), the worker records its slot ``executed`` in the
    ledger with a [`SlotGuard`][pgleaderlock.schedule.SlotGuard]; when a copy of the
    same slot began already, this one is skipped (its state is ``IGNORED``). With
    ``pgleaderlock_interrupted = "rerun"`` on the beats, a slot whose leader died
    between the claim and the recorded send is sent again, and this guard runs it once:
    exactly once per slot, across fail-overs.

    Tasks without the header (sent by anything else) and retries of a task that began
    (``self.retry()``) are not guarded. A message redelivered after a worker died in
    the middle of the task (``acks_late``) is a later copy and is skipped. When the
    ledger cannot be reached within ``pgleaderlock_guard_timeout_s`` the task fails
    (not run), with the error.
    """

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        """Admit the task's slot, or skip the task (``Ignore``)."""
        request = self.request
        slot = request.get(SLOT_HEADER)
        schedule = request.get(SCHEDULE_HEADER)
        if slot and schedule and not request.get("retries"):
            guard = _slot_guard(self.app)
            if not guard.admit_sync(str(schedule), dt.datetime.fromisoformat(str(slot))):
                log.info("celery_task_skipped", task=self.name, task_id=task_id,
                         schedule=schedule, slot=slot)  # fmt: skip
                raise Ignore()
        super().before_start(task_id, args, kwargs)


_guards: dict[int, tuple[Any, SlotGuard]] = {}
_guards_mutex = threading.Lock()


def _slot_guard(app: Any) -> SlotGuard:
    """The app's guard, made from its settings on first use (once per process)."""
    with _guards_mutex:
        found = _guards.get(id(app))
        if found is None or found[0] is not app:
            found = (app, BeatSettings.from_app(app).slot_guard())
            _guards[id(app)] = found
        return found[1]
