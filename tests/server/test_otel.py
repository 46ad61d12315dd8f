"""The OpenTelemetry plugin on the shared server, read through the SDK's in-memory span
exporter and metric reader: leadership spans with their term and events, and gauges and
histograms that move under a failover (a terminated backend) and a hand-over."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from pgleaderlock import Fencing, LeaderLock, LockOptions, LockState
from pgleaderlock.plugins.otel import SPAN_NAME, OpenTelemetryPlugin
from support.fixture_types import Terminate
from support.locks import kept
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = pytest.mark.timeout(90)

FAST: dict[str, Any] = timings(retry_s=0.3, health_interval_s=0.2, load_plugins=False)


class Telemetry:
    """An SDK tracer and meter provider that keep everything in memory."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.plugin = OpenTelemetryPlugin(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def finished(self) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == SPAN_NAME]

    def points(self, name: str, **attributes: str) -> list[Any]:
        """The data points of metric ``name`` whose attributes include ``attributes``."""
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        attrs = dict(point.attributes or {})
                        if all(attrs.get(k) == v for k, v in attributes.items()):
                            found.append(point)
        return found

    def close(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    t = Telemetry()
    try:
        yield t
    finally:
        t.close()


def _events(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


async def test_leadership_spans_and_metrics_through_a_failover_and_a_hand_over(
    pg_dsn: str,
    telemetry: Telemetry,
    terminate: Terminate,
    figures: Callable[..., None],
) -> None:
    """Two locks on one name (fencing on): the leader's backend is terminated, the
    standby takes over; then it steps down and the first one leads again. Each
    leadership is one span with its lock, term and backend pid, and events for what
    happened; the leader gauge, the confirmation age, the transitions counter and the
    failover and hand-over histograms all move."""
    name = f"otel-{random.randrange(10**9)}"
    label = {"pgleaderlock.lock": name}
    async with kept(LeaderLock.from_name) as make:
        fenced = lock_args(FAST, options=LockOptions(fencing=Fencing(enabled=True)))
        first = make(name, pg_dsn, **fenced)
        second = make(name, pg_dsn, **fenced)
        for lock in (first, second):
            lock.plugins.register(telemetry.plugin)
        await first.start()
        assert await first.wait_for_leadership(10)
        await second.start()
        await eventually(lambda: second.statistics().failed_attempts >= 1, 10, "a standby")
        first_term, first_pid = first.term, first.backend_pid
        assert first_term is not None
        assert first_pid is not None
        span = telemetry.plugin.leadership_span(first)
        assert span is not None
        assert span.is_recording()
        assert [p.value for p in telemetry.points("pgleaderlock.leader", **label)] == [1]
        (age,) = telemetry.points("pgleaderlock.leadership.confirmation.age", **label)
        assert 0 <= age.value < 5
        assert telemetry.points("pgleaderlock.failover.duration", **label) == []

        await terminate(first_pid)  # the server frees the lock: the standby is granted it
        await eventually(lambda: second.is_leader, 10, "the standby leads")
        await eventually(lambda: not first.is_leader and telemetry.finished(), 10, "span ends")
        (lost,) = telemetry.finished()
        assert lost.attributes is not None
        assert lost.attributes["pgleaderlock.lock"] == name
        assert lost.attributes["pgleaderlock.term"] == first_term
        assert lost.attributes["pgleaderlock.backend_pid"] == first_pid
        assert lost.status.status_code is StatusCode.ERROR
        events = _events(lost)
        assert events[0] == "acquired"
        assert events[-1] == "lost"
        assert "probe_failed" in events
        (failover,) = telemetry.points("pgleaderlock.failover.duration", **label)
        assert failover.count == 1
        assert failover.sum >= 0
        figures("failover seen by this process (terminated backend)", failover.sum, "ms")
        assert [p.value for p in telemetry.points("pgleaderlock.leader", **label)] == [1]

        second_term = second.term
        assert second_term is not None
        assert second_term > first_term
        await eventually(lambda: first.state is not LockState.STOPPED, 5, "first follows")
        await eventually(lambda: first.statistics().failed_attempts >= 1, 10, "first waits")
        await second.step_down()
        await eventually(lambda: first.is_leader, 10, "the first lock leads again")
        await eventually(lambda: len(telemetry.finished()) == 2, 10, "second span ends")
        released = telemetry.finished()[1]
        assert released.attributes is not None
        assert released.attributes["pgleaderlock.term"] == second_term
        assert released.status.status_code is StatusCode.UNSET
        assert _events(released)[-3:] == ["hand_over", "state_change", "released"]
        (handover,) = telemetry.points("pgleaderlock.handover.duration", **label)
        assert handover.count == 1
        assert handover.sum > 0
        figures("hand-over seen by this process (step_down)", handover.sum, "ms")

        transitions = {
            (
                p.attributes["pgleaderlock.from_state"],
                p.attributes["pgleaderlock.to_state"],
            ): p.value
            for p in telemetry.points("pgleaderlock.transitions", **label)
        }
        assert transitions[("leader", "releasing")] == 1
        assert transitions[("acquiring", "leader")] == 3
    await eventually(lambda: len(telemetry.finished()) == 3, 10, "the last span ends")
    assert [p.value for p in telemetry.points("pgleaderlock.leader", **label)] == [0]
    assert telemetry.points("pgleaderlock.leadership.confirmation.age", **label) == []
