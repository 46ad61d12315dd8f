"""Prometheus metrics for leader election: a plugin built on the lock's hooks.

Install the extra, then register the plugin on each lock (one instance may serve any
number of locks):

```bash
pip install 'pgleaderlock[metrics]'
```

```python
from prometheus_client import start_http_server
from pgleaderlock.plugins.metrics import MetricsPlugin

metrics = MetricsPlugin()              # the default prometheus_client registry
lock.plugins.register(metrics)
start_http_server(9100)
```

Every series carries the label ``lock``:
[`LeaderLock.label`][pgleaderlock.LeaderLock.label], that is the lock's name
([`LeaderLock.from_name`][pgleaderlock.LeaderLock.from_name]), or ``"key1,key2"`` for a lock
made from keys. Locks that share a label share its series, and their values add up:
counters are sums, ``state{state=S}`` counts the locks in state S and ``is_leader`` the
locks that lead, ``leader_seconds_total`` adds up their time as leader and
``leader_duration_seconds`` is the longest current leadership among them. The metrics,
with the default namespace ``pgleaderlock``:

| Metric | Type | Meaning |
|---|---|---|
| ``pgleaderlock_is_leader`` | gauge | 1 while this process holds the lock |
| ``pgleaderlock_state{state=...}`` | gauge | 1 for the current state, 0 for the others |
| ``pgleaderlock_leader_duration_seconds`` | gauge | length of the current leadership, 0 if none |
| ``pgleaderlock_leader_seconds_total`` | counter | total time spent as leader (live) |
| ``pgleaderlock_transitions_total`` | counter | state changes, by ``from_state``, ``to_state`` |
| ``pgleaderlock_acquired_total`` | counter | leadership acquired |
| ``pgleaderlock_lost_total`` | counter | leadership lost involuntarily |
| ``pgleaderlock_released_total`` | counter | leadership given up (step_down/shutdown) |
| ``pgleaderlock_acquire_attempts_total`` | counter | attempts (entries into ACQUIRING) |
| ``pgleaderlock_acquire_failures_total`` | counter | attempts that found the lock held elsewhere |
| ``pgleaderlock_errors_total{error=...}`` | counter | errors reported to ``on_error``, by type |

The values are computed when the registry is scraped, so the time metrics are current
at every scrape. Importing this module needs ``prometheus_client``; the rest of
pgleaderlock never imports it.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._extras import needs_extra

with needs_extra(__name__, "prometheus_client", "metrics"):
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..lowlevel import LockState, hookimpl
from . import shared_plugin

if TYPE_CHECKING:
    from ..lowlevel import LeaderLock

__all__ = ["MetricsPlugin"]

DEFAULT_NAMESPACE = "pgleaderlock"

_Family = CounterMetricFamily | GaugeMetricFamily


_COUNTS = ("acquisitions", "losses", "releases", "failed_attempts")
"""The [`LockStatistics`][pgleaderlock.LockStatistics] counters exported as they are."""


@dataclass
class _Stats:
    """The series of one value of the ``lock`` label, summed over the locks that carry it.

    The four counters of ``_COUNTS`` come from the locks'
    [`statistics()`][pgleaderlock.LeaderLock.statistics]. The rest is the plugin's own
    bookkeeping, as statistics do not hold it: transitions by (from, to) pair, entries
    into ACQUIRING, errors by type (callback errors included), and the time as leader of
    leaderships that have ended, on the plugin's injectable clock.
    """

    counts: Counter[str] = field(default_factory=Counter)
    transitions: Counter[tuple[str, str]] = field(default_factory=Counter)
    attempts: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    leader_seconds: float = 0.0


@dataclass
class _Seen:
    """What the plugin last saw of one lock: its state, its counters at its last event
    (the label's counters grow by the difference), and when its current leadership began
    (``clock()``), if it leads."""

    label: str
    state: LockState = LockState.STOPPED
    counts: Counter[str] = field(default_factory=Counter)
    leader_since: float | None = None


class _LockCollector:
    """One collector per (registry, namespace): every plugin on that registry shares it,
    so registering several plugins, or one plugin on many locks, never duplicates a
    time series.

    Locks that share a label add up: counters are the sums of their counters (a lock
    that is gone keeps its share), ``state{state=S}`` counts the locks in state S,
    ``is_leader`` the locks that lead, and the time metrics cover every leadership
    among them (see [`MetricsPlugin`][pgleaderlock.plugins.metrics.MetricsPlugin]).
    """

    def __init__(self, namespace: str, clock: Callable[[], float]) -> None:
        self.namespace = namespace
        self.clock = clock
        self._mutex = threading.Lock()  # scrapes run in the exporter's thread
        self._stats: dict[str, _Stats] = {}
        self._seen: weakref.WeakKeyDictionary[LeaderLock, _Seen] = weakref.WeakKeyDictionary()

    def update(
        self, lock: LeaderLock, change: Callable[[_Stats, _Seen], None] | None = None
    ) -> None:
        """Read ``lock``'s statistics into its label's series, then apply ``change``."""
        snapshot = lock.statistics()
        counts = Counter({name: getattr(snapshot, name) for name in _COUNTS})
        label = lock.label
        with self._mutex:
            stats = self._stats.get(label)
            if stats is None:
                stats = self._stats[label] = _Stats()
            seen = self._seen.get(lock)
            if seen is None:
                seen = self._seen[lock] = _Seen(label)
            stats.counts.update(counts)
            stats.counts.subtract(seen.counts)
            seen.counts = counts
            seen.state = snapshot.state
            if change is not None:
                change(stats, seen)

    def _families(self) -> dict[str, _Family]:
        ns = self.namespace

        def counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{ns}_{name}", doc, labels=["lock", *labels])

        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{ns}_{name}", doc, labels=["lock", *labels])

        return {
            "is_leader": gauge(
                "is_leader",
                "1 while this process holds the lock, else 0 (locks sharing the label: "
                "how many lead).",
            ),
            "state": gauge(
                "state",
                "The lock's state: 1 for the current state, 0 for the others (locks "
                "sharing the label: how many are in each state).",
                "state",
            ),
            "duration": gauge(
                "leader_duration_seconds",
                "Seconds since the current leadership began; 0 when not leader (locks "
                "sharing the label: the longest).",
            ),
            "leader_seconds": counter(
                "leader_seconds", "Total seconds this process has spent as leader."
            ),
            "transitions": counter(
                "transitions", "State changes of the lock.", "from_state", "to_state"
            ),
            "acquired": counter("acquired", "Times leadership was acquired."),
            "lost": counter("lost", "Times leadership was lost involuntarily."),
            "released": counter(
                "released", "Times leadership was given up voluntarily (step_down, shutdown)."
            ),
            "attempts": counter(
                "acquire_attempts", "Acquisition attempts (transitions into ACQUIRING)."
            ),
            "failures": counter(
                "acquire_failures", "Acquisition attempts that found the lock held elsewhere."
            ),
            "errors": counter(
                "errors", "Errors reported to on_error (database or callback), by type.", "error"
            ),
        }

    def describe(self) -> Iterator[Metric]:
        """The metric families, without samples (lets the registry detect clashes)."""
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        """The metric families with one sample set per label, computed now."""
        fam = self._families()
        with self._mutex:
            now = self.clock()
            locks: dict[str, list[_Seen]] = {}
            for seen in list(self._seen.values()):
                locks.setdefault(seen.label, []).append(seen)
            for label, s in sorted(self._stats.items()):
                members = locks.get(label, [])
                spans = [now - m.leader_since for m in members if m.leader_since is not None]
                in_state = Counter(m.state for m in members)
                fam["is_leader"].add_metric([label], float(in_state[LockState.LEADER]))
                for state in LockState:
                    fam["state"].add_metric([label, state.value], float(in_state[state]))
                fam["duration"].add_metric([label], max(spans, default=0.0))
                fam["leader_seconds"].add_metric([label], s.leader_seconds + sum(spans))
                for (old, new), count in sorted(s.transitions.items()):
                    fam["transitions"].add_metric([label, old, new], count)
                fam["acquired"].add_metric([label], s.counts["acquisitions"])
                fam["lost"].add_metric([label], s.counts["losses"])
                fam["released"].add_metric([label], s.counts["releases"])
                fam["attempts"].add_metric([label], s.attempts)
                fam["failures"].add_metric([label], s.counts["failed_attempts"])
                for error, count in sorted(s.errors.items()):
                    fam["errors"].add_metric([label, error], count)
        yield from fam.values()


_COLLECTORS: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, _LockCollector]] = (
    weakref.WeakKeyDictionary()
)
_COLLECTORS_MUTEX = threading.Lock()


def _collector_for(
    registry: CollectorRegistry, namespace: str, clock: Callable[[], float]
) -> _LockCollector:
    with _COLLECTORS_MUTEX:
        by_namespace = _COLLECTORS.setdefault(registry, {})
        collector = by_namespace.get(namespace)
        if collector is None:
            collector = _LockCollector(namespace, clock)
            registry.register(collector)
            by_namespace[namespace] = collector
        return collector


class MetricsPlugin:
    """Prometheus counters and gauges for every lock it is registered on.

    Register it per lock with ``lock.plugins.register(plugin)``; the same instance may
    be registered on many locks (each lock's
    [`label`][pgleaderlock.LeaderLock.label] is one value of the ``lock`` label). Several
    instances on one registry share their metrics.

    Locks with the same label add up, they never overwrite each other: the counters are
    sums over them, ``state{state=S}`` is how many of them are in state S,
    ``is_leader`` how many lead, ``leader_seconds_total`` their time as leader added up
    and ``leader_duration_seconds`` the longest current leadership among them. Give
    locks distinct names to tell them apart.

    Args:
        registry: the ``prometheus_client`` registry to expose the metrics in; default
            the global ``prometheus_client.REGISTRY``.
        namespace: prefix of every metric name.
        clock: a monotonic clock in seconds, for the time metrics (tests inject one).
            Only the first plugin on a (registry, namespace) pair sets it.

    Raises:
        ValueError: the registry already has other metrics with the same names.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry if registry is not None else REGISTRY
        self._collector = _collector_for(self.registry, namespace, clock)

    # ------------------------------------------------------------------ hooks

    @hookimpl
    def pgleaderlock_state_change(self, lock: LeaderLock, old: LockState, new: LockState) -> None:
        """Track the transition counts, attempts and the time as leader."""
        now = self._collector.clock()

        def change(s: _Stats, seen: _Seen) -> None:
            s.transitions[(old.value, new.value)] += 1
            if new is LockState.ACQUIRING:
                s.attempts += 1
            if old is LockState.LEADER and seen.leader_since is not None:
                s.leader_seconds += max(0.0, now - seen.leader_since)
                seen.leader_since = None
            if new is LockState.LEADER:
                seen.leader_since = now

        self._collector.update(lock, change)

    @hookimpl
    def pgleaderlock_acquired(self, lock: LeaderLock) -> None:
        """Read the lock's statistics: after an acquisition, and likewise (the same
        method) after an involuntary loss (``pgleaderlock_lost``), a voluntary release
        (``pgleaderlock_released``) and an attempt that found the lock held elsewhere
        (``pgleaderlock_acquire_failed``)."""
        self._collector.update(lock)

    pgleaderlock_lost = pgleaderlock_released = pgleaderlock_acquire_failed = pgleaderlock_acquired

    @hookimpl
    def pgleaderlock_error(self, lock: LeaderLock, error: Exception) -> None:
        """Count an error by its type name."""
        kind = type(error).__name__

        def change(s: _Stats, seen: _Seen) -> None:
            s.errors[kind] += 1

        self._collector.update(lock, change)


# ``plugin``: a shared [`MetricsPlugin`][pgleaderlock.plugins.metrics.MetricsPlugin] on
# the default registry, created on first use, for the ``pgleaderlock.plugins`` entry-point
# group:
#
# ```toml
# [project.entry-points."pgleaderlock.plugins"]
# metrics = "pgleaderlock.plugins.metrics:plugin"
# ```
__getattr__ = shared_plugin(__name__, MetricsPlugin)
