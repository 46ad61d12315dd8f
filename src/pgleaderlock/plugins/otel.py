"""OpenTelemetry traces and metrics for leader election: a plugin built on the lock's hooks.

It uses the OpenTelemetry *API* only; your SDK and exporters decide where spans and
metrics go (without an SDK, the API's no-op providers make it free). Install the extra,
set up the SDK as usual, then register the plugin on each lock (one instance may serve
any number of locks):

```bash
pip install 'pgleaderlock[otel]'
```

```python
from pgleaderlock.plugins.otel import OpenTelemetryPlugin

otel = OpenTelemetryPlugin()           # the global tracer and meter providers
lock.plugins.register(otel)
```

**Traces.** One span per leadership, ``pgleaderlock.leadership``, from the moment the
lock becomes LEADER until it stops leading (released, lost, or stopped). Flap damping's
RECONNECTING belongs to the leadership it may save. Its attributes: ``pgleaderlock.lock``
([`LeaderLock.label`][pgleaderlock.LeaderLock.label]), ``pgleaderlock.key1``,
``pgleaderlock.key2``, ``pgleaderlock.backend_pid``, ``pgleaderlock.term`` (with
``fencing=True``), ``db.system.name`` = ``postgresql``. Its events:

- ``acquired``: the leadership began (``pgleaderlock.from_state``);
- ``state_change``: every change of state during the leadership
  (``pgleaderlock.from_state``, ``pgleaderlock.to_state``);
- ``probe_failed``: a health probe failed, or the session broke (``exception.type``,
  ``exception.message``);
- ``probe_late``: a probe did not answer within ``health_timeout_s`` (RECONNECTING: its
  answer decides);
- ``recovered``: RECONNECTING ended with the lock held again
  (``pgleaderlock.backend_pid``, which may be new);
- ``draining``: a graceful stop lets leader work finish its unit (``drain_s``);
- ``hand_over``: ``step_down()`` or ``shutdown()`` began releasing the lock;
- ``released`` or ``lost``: how the leadership ended; ``lost`` also sets the span's
  status to ERROR;
- ``error``: any other error reported during the leadership (a callback's, a failed
  release).

[`leadership_span(lock)`][pgleaderlock.plugins.otel.OpenTelemetryPlugin.leadership_span]
returns the current span, to link or parent the leader's own work to it.

**Metrics** (attribute ``pgleaderlock.lock`` on every one; locks of one label add up):

- ``pgleaderlock.leader`` (observable gauge, ``{lock}``): the locks of the label that
  are LEADER in this process (1 or 0 for one lock);
- ``pgleaderlock.transitions`` (counter, ``{transition}``): state changes, with
  ``pgleaderlock.from_state`` and ``pgleaderlock.to_state``;
- ``pgleaderlock.failover.duration`` (histogram, ``s``): leaderless time after an
  involuntary loss, as this process sees it (below);
- ``pgleaderlock.handover.duration`` (histogram, ``s``): leaderless time after a
  voluntary release, as this process sees it (below);
- ``pgleaderlock.leadership.confirmation.age`` (observable gauge, ``s``): seconds since
  the leadership was last confirmed (granted, or a probe answered); leaders only;
- ``pgleaderlock.lifecycle.stall`` (observable gauge, ``s``): how far the lifecycle
  task is behind its own schedule
  ([`stalled_s`][pgleaderlock.LockStatistics]); above a second for long: wedged.

**The two durations, defined from one process's hooks.** A process cannot see when
another process lost or gained a lock, so both are measured per label within this
process, on the plugin's monotonic clock:

- *failover*: starts when a lock of the label stops being LEADER involuntarily (a failed
  or late probe, a broken session: LEADER to RECONNECTING, FOLLOWER or STOPPED not
  through RELEASING) while no other lock of the label in this process leads; it ends,
  and is recorded, when a lock of the label in this process becomes LEADER again (the
  same lock after flap damping or re-acquisition, or a standby lock in this process).
  When a standby of this process was granted the lock before the old one noticed its
  loss (a terminated backend frees the lock at once), the failover is recorded as 0.
- *hand-over*: starts when a leading lock of the label begins releasing it
  (``step_down()``, ``shutdown()``); ends, and is recorded, when a lock of the label in
  this process becomes LEADER (a standby, or the same lock after its retry delay).

A start with no end in this process (the next leader runs elsewhere) records nothing and
is forgotten once every lock of the label has stopped. So with one lock per process the
histograms show recoveries (flap damping, re-acquisition after a loss, a step-down
nobody took); run a standby lock in the process (or watch the new leader's
``pgleaderlock.leader``) for cross-process failovers.

Importing this module needs ``opentelemetry-api``; the rest of pgleaderlock never
imports it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._extras import needs_extra

with needs_extra(__name__, "opentelemetry-api", "otel"):
    from opentelemetry import metrics, trace
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from .. import __version__
from ..lowlevel import LockState, describe, hookimpl
from . import shared_plugin

if TYPE_CHECKING:
    from ..lowlevel import LeaderLock

__all__ = ["INSTRUMENTATION_NAME", "SPAN_NAME", "OpenTelemetryPlugin"]

INSTRUMENTATION_NAME = "pgleaderlock"
"""The name of the plugin's tracer and meter."""

SPAN_NAME = "pgleaderlock.leadership"
"""The name of every leadership span."""

S = LockState
_LEADING = frozenset({S.LEADER, S.RECONNECTING, S.RELEASING})
_LOCK = "pgleaderlock.lock"


@dataclass
class _Tracked:
    """What the plugin keeps of one lock: its label, last state and leadership span."""

    label: str
    state: LockState = S.STOPPED
    span: Span | None = None


@dataclass
class _Label:
    """Per label: when a failover and a hand-over began (the plugin's clock)."""

    failover_since: float | None = None
    handover_since: float | None = None
    locks: weakref.WeakSet[LeaderLock] = field(default_factory=weakref.WeakSet)


class OpenTelemetryPlugin:
    """Leadership spans and leader-election metrics through the OpenTelemetry API.

    Register it per lock with ``lock.plugins.register(plugin)``; one instance may serve
    many locks (each lock's [`label`][pgleaderlock.LeaderLock.label] is the value of the
    ``pgleaderlock.lock`` attribute). See the module documentation for the spans, the
    instruments and how the durations are defined.

    Args:
        tracer_provider: where spans go; default the global tracer provider.
        meter_provider: where metrics go; default the global meter provider.
        clock: a monotonic clock in seconds for the durations (tests inject one).
    """

    def __init__(
        self,
        *,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._mutex = threading.Lock()  # hooks run on the locks' loops, callbacks elsewhere
        self._tracked: weakref.WeakKeyDictionary[LeaderLock, _Tracked] = weakref.WeakKeyDictionary()
        self._labels: dict[str, _Label] = {}
        self._tracer = trace.get_tracer(
            INSTRUMENTATION_NAME, __version__, tracer_provider=tracer_provider
        )
        meter = metrics.get_meter(INSTRUMENTATION_NAME, __version__, meter_provider=meter_provider)
        self._transitions = meter.create_counter(
            "pgleaderlock.transitions", unit="{transition}", description="State changes of a lock."
        )
        self._failover = meter.create_histogram(
            "pgleaderlock.failover.duration",
            unit="s",
            description="Leaderless time after an involuntary loss, as this process sees it.",
        )
        self._handover = meter.create_histogram(
            "pgleaderlock.handover.duration",
            unit="s",
            description="Leaderless time after a voluntary release, as this process sees it.",
        )
        gauges = (
            ("pgleaderlock.leader", self._observe_leaders, "{lock}",
             "Locks of the label that are LEADER in this process."),
            ("pgleaderlock.leadership.confirmation.age", self._observe_confirmation_age, "s",
             "Seconds since the leadership was last confirmed (leaders only)."),
            ("pgleaderlock.lifecycle.stall", self._observe_stall, "s",
             "How far the lock's lifecycle task is behind its own schedule."),
        )  # fmt: skip
        for name, observe, unit, description in gauges:
            meter.create_observable_gauge(
                name, callbacks=[observe], unit=unit, description=description
            )

    # ------------------------------------------------------------------ for users

    def leadership_span(self, lock: LeaderLock) -> Span | None:
        """The span of ``lock``'s current leadership, or ``None`` when it does not lead:
        to parent the leader's own work (``trace.use_span(span)``) or link to it."""
        with self._mutex:
            tracked = self._tracked.get(lock)
            return None if tracked is None else tracked.span

    # ------------------------------------------------------------------ hooks

    @hookimpl
    def pgleaderlock_state_change(self, lock: LeaderLock, old: LockState, new: LockState) -> None:
        """Count the transition, open or end the leadership span, time failovers and
        hand-overs."""
        label = lock.label
        self._transitions.add(
            1,
            {
                _LOCK: label,
                "pgleaderlock.from_state": old.value,
                "pgleaderlock.to_state": new.value,
            },
        )
        stats = lock.statistics()
        now = self._clock()
        with self._mutex:
            tracked = self._track(lock)
            tracked.state = new
            group = self._labels[label]
            others_lead = any(
                other is not lock and self._state_of(other) is S.LEADER for other in group.locks
            )
            span = tracked.span
            if span is not None:
                span.add_event("state_change", _moved(old, new))
            if old is S.LEADER and new is not S.RELEASING and new is not S.LEADER:
                if span is not None and stats.last_error is not None:
                    span.add_event("probe_failed", _error_attributes(stats.last_error))
                elif span is not None and new is S.RECONNECTING:
                    span.add_event("probe_late")
                if others_lead:
                    self._failover.record(0.0, {_LOCK: label})
                elif group.failover_since is None:
                    group.failover_since = now
            if new is S.RELEASING and span is not None:
                span.add_event("hand_over")
                if not others_lead and group.handover_since is None:
                    group.handover_since = now
            if new is S.LEADER:
                self._lead(lock, tracked, group, old, stats.backend_pid, stats.term, now)
            elif new not in _LEADING and span is not None:
                self._end(tracked, old, stats.last_error)
            if new is S.STOPPED and all(self._state_of(o) is S.STOPPED for o in group.locks):
                group.failover_since = group.handover_since = None  # nobody here to end them

    @hookimpl
    def pgleaderlock_draining(self, lock: LeaderLock) -> None:
        """A graceful stop's drain began: an event on the leadership span."""
        span = self.leadership_span(lock)
        if span is not None:
            span.add_event("draining")

    @hookimpl
    def pgleaderlock_error(self, lock: LeaderLock, error: Exception) -> None:
        """An error during a leadership (a callback's, a failed release): an event."""
        span = self.leadership_span(lock)
        if span is not None:
            span.add_event("error", _error_attributes(error))

    # ------------------------------------------------------------------ internals

    def _track(self, lock: LeaderLock) -> _Tracked:
        tracked = self._tracked.get(lock)
        if tracked is None:
            tracked = self._tracked[lock] = _Tracked(lock.label)
        self._labels.setdefault(tracked.label, _Label()).locks.add(lock)
        return tracked

    def _state_of(self, lock: LeaderLock) -> LockState:
        tracked = self._tracked.get(lock)
        return S.STOPPED if tracked is None else tracked.state

    def _lead(
        self,
        lock: LeaderLock,
        tracked: _Tracked,
        group: _Label,
        old: LockState,
        backend_pid: int | None,
        term: int | None,
        now: float,
    ) -> None:
        """``lock`` became LEADER: open its span (or note the recovery), end the label's
        pending failover and hand-over."""
        if tracked.span is None:
            attributes: dict[str, str | int] = {
                _LOCK: tracked.label,
                "pgleaderlock.key1": lock.keys[0],
                "pgleaderlock.key2": lock.keys[1],
                "db.system.name": "postgresql",
            }
            if backend_pid is not None:
                attributes["pgleaderlock.backend_pid"] = backend_pid
            if term is not None:
                attributes["pgleaderlock.term"] = term
            tracked.span = self._tracer.start_span(
                SPAN_NAME, kind=SpanKind.INTERNAL, attributes=attributes
            )
            tracked.span.add_event("acquired", _moved(old, S.LEADER))
        elif old is S.RECONNECTING:
            pid = {} if backend_pid is None else {"pgleaderlock.backend_pid": backend_pid}
            tracked.span.add_event("recovered", pid)
        attributes_ = {_LOCK: tracked.label}
        if group.failover_since is not None:
            self._failover.record(max(0.0, now - group.failover_since), attributes_)
        if group.handover_since is not None:
            self._handover.record(max(0.0, now - group.handover_since), attributes_)
        group.failover_since = group.handover_since = None

    def _end(self, tracked: _Tracked, old: LockState, error: Exception | None) -> None:
        """The leadership ended (from ``old``): say how, end the span."""
        span, tracked.span = tracked.span, None
        assert span is not None
        if old is S.RELEASING:
            if error is not None:  # the unlock failed: the session was closed instead
                span.add_event("error", _error_attributes(error))
            span.add_event("released")
        else:
            span.add_event("lost")
            detail = "leadership lost" if error is None else f"leadership lost: {describe(error)}"
            span.set_status(Status(StatusCode.ERROR, detail))
        span.end()

    def _snapshot(self) -> list[tuple[str, LeaderLock]]:
        with self._mutex:
            return [(t.label, lock) for lock, t in list(self._tracked.items())]

    def _observe_leaders(self, options: CallbackOptions) -> Iterable[Observation]:
        leaders: dict[str, int] = {}
        for label, lock in self._snapshot():
            leaders[label] = leaders.get(label, 0) + (lock.state is S.LEADER)
        return [Observation(count, {_LOCK: label}) for label, count in sorted(leaders.items())]

    def _observe_confirmation_age(self, options: CallbackOptions) -> Iterable[Observation]:
        ages: dict[str, float] = {}
        now = time.time()
        for label, lock in self._snapshot():
            confirmed = lock.statistics().confirmed_at
            if confirmed is not None:
                ages[label] = max(ages.get(label, 0.0), max(0.0, now - confirmed))
        return [Observation(age, {_LOCK: label}) for label, age in sorted(ages.items())]

    def _observe_stall(self, options: CallbackOptions) -> Iterable[Observation]:
        stalls: dict[str, float] = {}
        for label, lock in self._snapshot():
            stalls[label] = max(stalls.get(label, 0.0), lock.statistics().stalled_s)
        return [Observation(stall, {_LOCK: label}) for label, stall in sorted(stalls.items())]


def _moved(old: LockState, new: LockState) -> dict[str, str]:
    return {"pgleaderlock.from_state": old.value, "pgleaderlock.to_state": new.value}


def _error_attributes(error: BaseException) -> dict[str, str]:
    return {"exception.type": type(error).__name__, "exception.message": describe(error)}


# ``plugin``: a shared [`OpenTelemetryPlugin`][pgleaderlock.plugins.otel.OpenTelemetryPlugin]
# on the global providers, created on first use, for the ``pgleaderlock.plugins``
# entry-point group:
#
# ```toml
# [project.entry-points."pgleaderlock.plugins"]
# otel = "pgleaderlock.plugins.otel:plugin"
# ```
__getattr__ = shared_plugin(__name__, OpenTelemetryPlugin)
