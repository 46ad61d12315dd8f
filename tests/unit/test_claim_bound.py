"""The claim's bound: how long a session that a wait was granted the lock may stay silent
(see ``docs/guarantees.md``, "A frozen next in line")."""

from __future__ import annotations

import gc

import pytest

from pgleaderlock import ConnectOptions, LeaderLock, LockOptions, Timing
from pgleaderlock.core._logging import get_logger
from pgleaderlock.core.config import claim_bound, lock_config
from pgleaderlock.core.slot import _SLOTS, CLAIM_PER_SLOT_S, SessionSlot


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
    options = LockOptions(timing=Timing(health_timeout_s=4), load_plugins=False)
    lock = LeaderLock("postgresql://db/app", 1, 2, health_interval_s=10, options=options)
    assert lock._connect_options.claim_s == 2.0
    assert lock._connect_options.lease_s == lock.lease_s


def _slot(claim_s: float = 1.0, lease_s: float = 10.0) -> SessionSlot:
    async def connect() -> object:
        raise AssertionError("not connected here")

    return SessionSlot(
        backend=None,
        dsn=None,
        options=ConnectOptions("claim-test", 1.0, lease_s=lease_s, claim_s=claim_s),
        connect_fn=connect,
        log=get_logger(),
        fields={},
    )


def test_a_process_with_many_locks_claims_longer() -> None:
    """Each other lock (slot) of the process adds ``CLAIM_PER_SLOT_S``: a process that
    runs many locks may have to claim all their grants at once."""
    gc.collect()
    base = len(_SLOTS)
    slot = _slot()
    assert slot.session_options().claim_s == pytest.approx(1.0 + base * CLAIM_PER_SLOT_S)
    others = [_slot() for _ in range(50)]
    assert slot.session_options().claim_s == pytest.approx(1.0 + (base + 50) * CLAIM_PER_SLOT_S)
    more = [_slot() for _ in range(2000)]
    assert slot.session_options().claim_s == 10.0  # never beyond the lease
    del others, more
    gc.collect()
    assert slot.session_options().claim_s == pytest.approx(1.0 + base * CLAIM_PER_SLOT_S)


def test_an_unclaimed_grant_doubles_the_claim_until_grants_are_claimed_again() -> None:
    gc.collect()
    slot = _slot()
    if len(_SLOTS) > 1:
        pytest.skip("other locks of this process make the claim longer")
    slot.claim_failed()
    assert slot.session_options().claim_s == 2.0
    slot.claim_failed()
    slot.claim_failed()
    assert slot.session_options().claim_s == 8.0
    slot.claim_failed()
    assert slot.session_options().claim_s == 10.0  # the lease
    slot.granted()  # 16 -> 8
    slot.granted()  # -> 4
    assert slot.session_options().claim_s == 4.0
    for _ in range(5):
        slot.granted()
    assert slot.session_options().claim_s == 1.0


def test_no_claim_stays_no_claim() -> None:
    slot = _slot(claim_s=0.0)
    slot.claim_failed()
    assert slot.session_options().claim_s == 0.0
