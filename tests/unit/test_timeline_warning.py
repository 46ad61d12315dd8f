"""The ``timeline_changed`` warning: a fenced lock that leads on a later server timeline
than the last term known (the term row's previous term on the new primary, or its own
last term) logs once, at WARNING, what a failover may have lost. On the FakeServer: a
"promotion" is ``server.timeline += 1``."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock import FixedInterval
from pgleaderlock.core.timeline import timeline_change, timeline_of
from pgleaderlock.lowlevel import BumpedTerm
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorder
from support.locks import fake_locks

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.timeout(30)

TL1, TL2 = 1 << 32, 2 << 32


def _warnings(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        r.pgleaderlock  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "pgleaderlock", {}).get("event") == "timeline_changed"
    ]


@pytest.fixture
async def make(server: FakeServer) -> AsyncIterator[MakeLock]:
    async with fake_locks(
        server, load_plugins=False, health_interval_s=0.05, health_timeout_s=0.2
    ) as make_lock:
        yield make_lock


def test_the_change_is_read_from_the_terms_timelines() -> None:
    at = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    assert timeline_of(TL2 | 7) == 2
    fields = timeline_change(TL2 | 1, TL1 | 5, at, None)
    assert fields is not None
    assert (fields["from_timeline"], fields["to_timeline"]) == (1, 2)
    assert fields["last_known_term"] == TL1 | 5
    assert fields["since"] == at.isoformat()
    assert "lost_term" not in fields
    assert "ledger claims" in str(fields["may_be_lost"])
    # this process led under a term the new primary does not have: it was lost
    lost = timeline_change(TL2 | 1, TL1 | 5, at, TL1 | 6)
    assert lost is not None
    assert lost["lost_term"] == TL1 | 6
    assert timeline_change(TL2 | 1, None, None, TL1 | 6) is not None  # no row: own memory
    assert timeline_change(TL1 | 6, TL1 | 5, at, None) is None  # same timeline
    assert timeline_change(TL2 | 1, None, None, None) is None  # nothing known: a new lock
    assert timeline_change(TL2 | 1, 5, at, None) is None  # a term without a timeline
    bumped = BumpedTerm(TL2 | 1, TL1 | 5, at)
    assert bumped == TL2 | 1
    assert bumped.prior == TL1 | 5
    assert bumped.prior_at == at


async def test_a_lock_leading_on_a_new_timeline_warns_once(
    make: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = make(fencing=True, retry_strategy=FixedInterval(0.01))
    rec = recorder(a)
    with caplog.at_level(logging.INFO, logger="pgleaderlock"):
        await a.start()
        assert await a.wait_for_leadership(5)
        first = a.term
        assert first == TL1 | 1
        server.terminate()  # same timeline: no warning
        await rec.wait_event("acquired", count=2)
        assert _warnings(caplog) == []
        server.timeline = 2  # a failover: the new primary is on timeline 2
        server.terminate()
        await rec.wait_event("acquired", count=3)
        assert a.term == TL2 | 1
        server.terminate()  # still timeline 2: nothing more
        await rec.wait_event("acquired", count=4)
    (warning,) = _warnings(caplog)
    assert (warning["from_timeline"], warning["to_timeline"]) == (1, 2)
    assert warning["term"] == TL2 | 1
    assert warning["last_known_term"] == TL1 | 2
    (record,) = [r for r in caplog.records if "timeline_changed" in r.getMessage()]
    assert record.levelno == logging.WARNING


async def test_another_process_leading_after_the_failover_warns_from_the_row(
    make: MakeLock,
    server: FakeServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = make(fencing=True)
    await a.start()
    assert await a.wait_for_leadership(5)
    await a.shutdown(5)
    server.timeline = 3
    b = make(fencing=True)  # never led: it knows the past from the term row
    with caplog.at_level(logging.WARNING, logger="pgleaderlock"):
        await b.start()
        assert await b.wait_for_leadership(5)
    (warning,) = _warnings(caplog)
    assert (warning["from_timeline"], warning["to_timeline"]) == (1, 3)
    assert warning["last_known_term"] == TL1 | 1
