"""The claim's bound: how long a session that a wait was granted the lock may stay silent
(see ``docs/guarantees.md``, "A frozen next in line")."""

from __future__ import annotations

import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.core.config import claim_bound, lock_config


def test_the_default_claim_is_one_second() -> None:
    config = lock_config()
    assert config.claim_s == 1.0
    assert config.lease_s == 10.0


@pytest.mark.parametrize(
    ("health_timeout_s", "lease_s", "claim_s"),
    [
        (2.0, 10.0, 1.0),  # the defaults
        (0.5, 1.5, 1.0),  # short timings: never below a second ...
        (0.2, 0.5, 0.5),  # ... unless the lease is shorter: it ends the session anyway
        (6.0, 20.0, 3.0),  # a slow network: half a probe's timeout
        (2.0, 0.0, 1.0),  # no lease
    ],
)
def test_claim_bound(health_timeout_s: float, lease_s: float, claim_s: float) -> None:
    assert claim_bound(health_timeout_s, lease_s) == claim_s


def test_a_lock_asks_its_sessions_for_its_claim() -> None:
    lock = LeaderLock(
        "postgresql://db/app", 1, 2, health_interval_s=10, health_timeout_s=4, load_plugins=False
    )
    assert lock._connect_options.claim_s == 2.0
    assert lock._connect_options.lease_s == lock.lease_s
