"""The bundled Prometheus metrics plugin, on the in-memory FakeServer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from pgleaderlock import ConnectionError, LeaderLock, LockOptions, LockState
from pgleaderlock.plugins.metrics import MetricsPlugin
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorded, MakeRecorder

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def value(registry: CollectorRegistry, name: str, lock: str = "1,2", **labels: str) -> float:
    sample = registry.get_sample_value(name, {"lock": lock, **labels})
    assert sample is not None, f"no sample {name}{{lock={lock!r}, {labels}}}"
    return sample


def state_of(registry: CollectorRegistry, lock: str = "1,2") -> str:
    current = [
        s.value
        for s in LockState
        if value(registry, "pgleaderlock_state", lock, state=s.value) == 1
    ]
    assert len(current) == 1, current
    return current[0]


async def test_leader_lifecycle_is_counted(
    make_lock: MakeLock, registry: CollectorRegistry
) -> None:
    lock = make_lock()
    lock.plugins.register(MetricsPlugin(registry))
    assert registry.get_sample_value("pgleaderlock_is_leader", {"lock": "1,2"}) is None

    await lock.start()
    assert await lock.wait_for_leadership(5)
    assert value(registry, "pgleaderlock_is_leader") == 1
    assert state_of(registry) == "leader"
    assert value(registry, "pgleaderlock_acquired_total") == 1
    assert value(registry, "pgleaderlock_acquire_attempts_total") == 1
    assert value(registry, "pgleaderlock_acquire_failures_total") == 0
    assert value(registry, "pgleaderlock_released_total") == 0

    await lock.shutdown()
    assert value(registry, "pgleaderlock_is_leader") == 0
    assert state_of(registry) == "stopped"
    assert value(registry, "pgleaderlock_released_total") == 1
    assert value(registry, "pgleaderlock_lost_total") == 0
    transitions = {
        (old, new): value(registry, "pgleaderlock_transitions_total", from_state=old, to_state=new)
        for old, new in [
            ("stopped", "follower"),
            ("follower", "acquiring"),
            ("acquiring", "leader"),
            ("leader", "releasing"),
            ("releasing", "stopped"),
        ]
    }
    assert set(transitions.values()) == {1}


async def test_time_as_leader_is_live_and_accumulates(
    make_lock: MakeLock, registry: CollectorRegistry
) -> None:
    clock = FakeClock()
    lock = make_lock()
    lock.plugins.register(MetricsPlugin(registry, clock=clock))
    await lock.start()
    assert await lock.wait_for_leadership(5)
    assert value(registry, "pgleaderlock_leader_duration_seconds") == 0

    clock.now += 7.5  # read at scrape time: no event needed
    assert value(registry, "pgleaderlock_leader_duration_seconds") == 7.5
    assert value(registry, "pgleaderlock_leader_seconds_total") == 7.5

    await lock.step_down()
    clock.now += 100  # not leader: the total does not grow
    assert value(registry, "pgleaderlock_leader_duration_seconds") == 0
    assert value(registry, "pgleaderlock_leader_seconds_total") == 7.5

    assert await lock.wait_for_leadership(5)  # no competitor: it takes the lock back
    clock.now += 2.5
    assert value(registry, "pgleaderlock_leader_duration_seconds") == 2.5
    assert value(registry, "pgleaderlock_leader_seconds_total") == 10.0
    assert value(registry, "pgleaderlock_acquired_total") == 2
    assert value(registry, "pgleaderlock_released_total") == 1


async def test_attempts_and_failures_under_contention(
    server: FakeServer, registry: CollectorRegistry, recorded: MakeRecorded
) -> None:
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    lock, rec = recorded()
    lock.plugins.register(MetricsPlugin(registry))
    await lock.start()
    await rec.wait_event("acquire_failed", count=3)

    failures = value(registry, "pgleaderlock_acquire_failures_total")
    attempts = value(registry, "pgleaderlock_acquire_attempts_total")
    assert failures >= 3
    assert attempts - failures in (0, 1)  # an attempt may be in flight
    assert value(registry, "pgleaderlock_is_leader") == 0
    assert value(registry, "pgleaderlock_acquired_total") == 0

    await holder.close()  # the holder goes away: the follower takes over
    assert await lock.wait_for_leadership(5)
    assert value(registry, "pgleaderlock_acquired_total") == 1
    assert value(registry, "pgleaderlock_is_leader") == 1


async def test_loss_and_errors_are_counted(
    server: FakeServer, registry: CollectorRegistry, recorded: MakeRecorded
) -> None:
    lock, rec = recorded()
    lock.plugins.register(MetricsPlugin(registry))
    await lock.start()
    assert await lock.wait_for_leadership(5)

    server.refuse_connections = ConnectionError("server down")
    server.terminate()
    await rec.wait_event("lost")
    await rec.wait_event("error", count=2)
    assert value(registry, "pgleaderlock_lost_total") == 1
    assert value(registry, "pgleaderlock_is_leader") == 0
    assert value(registry, "pgleaderlock_errors_total", error="ConnectionError") >= 2
    assert value(registry, "pgleaderlock_leader_duration_seconds") == 0

    server.refuse_connections = None
    assert await lock.wait_for_leadership(5)
    assert value(registry, "pgleaderlock_acquired_total") == 2
    assert (
        value(registry, "pgleaderlock_transitions_total", from_state="leader", to_state="follower")
        == 1
    )


async def test_one_plugin_many_locks_labelled_by_name(
    make_lock: MakeLock, server: FakeServer, registry: CollectorRegistry
) -> None:
    plugin = MetricsPlugin(registry)
    named = make_lock(name="billing-scheduler")
    no_plugins = LockOptions(load_plugins=False)
    by_keys = LeaderLock(None, 3, -4, connect_fn=server.connect, options=no_plugins)
    assert named.label == "billing-scheduler"
    assert by_keys.label == "3,-4"
    named.plugins.register(plugin)
    by_keys.plugins.register(plugin)
    try:
        await named.start()
        await by_keys.start()
        assert await named.wait_for_leadership(5)
        assert await by_keys.wait_for_leadership(5)
        await by_keys.shutdown()
        assert value(registry, "pgleaderlock_is_leader", "billing-scheduler") == 1
        assert value(registry, "pgleaderlock_is_leader", "3,-4") == 0
        assert value(registry, "pgleaderlock_released_total", "billing-scheduler") == 0
        assert value(registry, "pgleaderlock_released_total", "3,-4") == 1
    finally:
        await by_keys.shutdown()


async def test_locks_that_share_a_label_add_up(
    make_lock: MakeLock, registry: CollectorRegistry
) -> None:
    plugin = MetricsPlugin(registry)
    for _ in range(2):  # one after the other: the second takes the lock the first let go
        lock = make_lock(name="shared")
        lock.plugins.register(plugin)
        await lock.start()
        assert await lock.wait_for_leadership(5)
        assert lock.statistics().acquisitions == 1
        await lock.shutdown()
    assert value(registry, "pgleaderlock_acquired_total", "shared") == 2
    assert value(registry, "pgleaderlock_released_total", "shared") == 2
    assert value(registry, "pgleaderlock_is_leader", "shared") == 0


async def test_concurrent_locks_with_one_name_add_up_and_never_overwrite(
    make_lock: MakeLock,
    registry: CollectorRegistry,
    recorder: MakeRecorder,
) -> None:
    """Two live locks named alike, one leader and one follower: the gauges count both
    (the follower's events do not hide the leader), the counters are their sums."""
    clock = FakeClock()
    plugin = MetricsPlugin(registry, clock=clock)
    leader, follower = make_lock(name="shared"), make_lock(name="shared", follower_mode="poll")
    for lock in (leader, follower):
        lock.plugins.register(plugin)
    await leader.start()
    assert await leader.wait_for_leadership(5)
    rec = recorder(follower)
    await follower.start()
    await rec.wait_event("acquire_failed", count=2)  # its events came after the leader's
    assert follower.state is not LockState.LEADER

    assert value(registry, "pgleaderlock_is_leader", "shared") == 1
    assert value(registry, "pgleaderlock_state", "shared", state="leader") == 1
    in_follower_states = sum(
        value(registry, "pgleaderlock_state", "shared", state=s) for s in ("follower", "acquiring")
    )
    assert in_follower_states == 1
    assert (
        sum(value(registry, "pgleaderlock_state", "shared", state=s.value) for s in LockState) == 2
    )
    clock.now += 4.0
    assert value(registry, "pgleaderlock_leader_duration_seconds", "shared") == 4.0
    assert value(registry, "pgleaderlock_leader_seconds_total", "shared") == 4.0
    assert value(registry, "pgleaderlock_acquire_failures_total", "shared") >= 2
    assert value(registry, "pgleaderlock_acquired_total", "shared") == 1

    await leader.shutdown()  # the follower takes over: both leaderships count
    assert await follower.wait_for_leadership(5)
    clock.now += 1.0
    assert value(registry, "pgleaderlock_acquired_total", "shared") == 2
    assert value(registry, "pgleaderlock_released_total", "shared") == 1
    assert value(registry, "pgleaderlock_is_leader", "shared") == 1
    assert value(registry, "pgleaderlock_state", "shared", state="stopped") == 1
    assert value(registry, "pgleaderlock_leader_duration_seconds", "shared") == 1.0
    assert value(registry, "pgleaderlock_leader_seconds_total", "shared") == 5.0


async def test_exposition_reads_well(make_lock: MakeLock, registry: CollectorRegistry) -> None:
    lock = make_lock(name="nightly-report")
    lock.plugins.register(MetricsPlugin(registry))
    await lock.start()
    assert await lock.wait_for_leadership(5)
    text = generate_latest(registry).decode()
    assert "# TYPE pgleaderlock_is_leader gauge" in text
    assert 'pgleaderlock_is_leader{lock="nightly-report"} 1.0' in text
    assert 'pgleaderlock_state{lock="nightly-report",state="leader"} 1.0' in text
    assert 'pgleaderlock_state{lock="nightly-report",state="follower"} 0.0' in text
    assert "# TYPE pgleaderlock_acquired_total counter" in text
    assert 'pgleaderlock_acquired_total{lock="nightly-report"} 1.0' in text


def test_plugins_share_a_registry_and_clashes_are_reported(registry: CollectorRegistry) -> None:
    first = MetricsPlugin(registry)
    second = MetricsPlugin(registry)  # same metrics, no "Duplicated timeseries"
    assert first._collector is second._collector
    MetricsPlugin(registry, namespace="other")  # another namespace: its own collector

    clashing = CollectorRegistry()
    Counter("pgleaderlock_acquired", "someone else's metric", registry=clashing)
    with pytest.raises(ValueError, match="pgleaderlock_acquired"):
        MetricsPlugin(clashing)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_core_never_imports_prometheus_client() -> None:
    result = run_python(
        """
        import sys
        import pgleaderlock, pgleaderlock.plugins
        from pgleaderlock import LeaderLock
        LeaderLock("postgresql://u@h/db", 1, 2)
        assert "prometheus_client" not in sys.modules, "core imported prometheus_client"
        """
    )
    assert result.returncode == 0, result.stderr


def test_missing_prometheus_client_names_the_extra() -> None:
    result = run_python(
        """
        import sys
        sys.modules["prometheus_client"] = None  # as if it were not installed
        import pgleaderlock.plugins.metrics
        """
    )
    assert result.returncode == 1
    assert "pip install 'pgleaderlock[metrics]'" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("ImportError:")


def test_entry_point_object_is_one_shared_plugin_on_the_default_registry() -> None:
    result = run_python(
        """
        from prometheus_client import REGISTRY
        from pgleaderlock.plugins import metrics
        assert metrics.plugin is metrics.plugin
        assert metrics.plugin.registry is REGISTRY
        try:
            metrics.nothing
        except AttributeError:
            pass
        else:
            raise AssertionError("no AttributeError")
        """
    )
    assert result.returncode == 0, result.stderr
