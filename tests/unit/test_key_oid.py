"""The one conversion between an int4 lock key and the oid pg_locks shows for it."""

from __future__ import annotations

import pytest

from pgleaderlock.core.keys import INT32_MAX, INT32_MIN, key_to_oid, oid_to_key

# (key, oid): what pg_locks.classid/objid show for a lock taken with that int4 key
# (``SELECT k::int8 & 4294967295`` on the server gives the same numbers).
GOLDEN = [
    (0, 0),
    (1, 1),
    (2_147_483_647, 2_147_483_647),
    (-2_147_483_648, 2_147_483_648),
    (-1, 4_294_967_295),
    (-2, 4_294_967_294),
    (-1_412_181_516, 2_882_785_780),
]


@pytest.mark.parametrize(("key", "oid"), GOLDEN)
def test_golden_values(key: int, oid: int) -> None:
    assert key_to_oid(key) == oid
    assert oid_to_key(oid) == key


@pytest.mark.parametrize("key", [INT32_MIN, -65_536, -1, 0, 1, 65_535, INT32_MAX])
def test_round_trip(key: int) -> None:
    assert oid_to_key(key_to_oid(key)) == key


@pytest.mark.parametrize("key", [INT32_MIN - 1, INT32_MAX + 1, 2**32])
def test_key_outside_int4_is_refused(key: int) -> None:
    with pytest.raises(ValueError, match="signed 32-bit"):
        key_to_oid(key)


@pytest.mark.parametrize("oid", [-1, 2**32])
def test_oid_outside_uint32_is_refused(oid: int) -> None:
    with pytest.raises(ValueError, match="unsigned 32-bit"):
        oid_to_key(oid)
