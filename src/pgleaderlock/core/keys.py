"""Lock identity: deriving the two int4 advisory-lock keys from a name."""

from __future__ import annotations

import hashlib

from .errors import ConfigurationError

__all__ = ["INT32_MAX", "INT32_MIN", "check_key", "lock_keys"]

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def _hex_to_int4(hex8: str) -> int:
    value = int(hex8, 16)
    return value - 2**32 if value > INT32_MAX else value


def lock_keys(name: str) -> tuple[int, int]:
    """Derive ``(key1, key2)`` from a lock name, exactly as PostgreSQL would.

    The result equals, bit for bit::

        SELECT ('x' || substr(md5(name), 1, 8))::bit(32)::int,
               ('x' || substr(md5(name), 9, 8))::bit(32)::int;

    on a UTF-8 database, so SQL and Python agree on the lock a name stands for.

    Args:
        name: any non-empty string; it is hashed as UTF-8.

    Raises:
        ConfigurationError: if ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"lock name must be a non-empty string, got {name!r}")
    digest = hashlib.md5(name.encode("utf-8"), usedforsecurity=False).hexdigest()
    return _hex_to_int4(digest[0:8]), _hex_to_int4(digest[8:16])


def check_key(name: str, value: object) -> int:
    """Return ``value`` if it is an int in the signed 32-bit range, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not INT32_MIN <= value <= INT32_MAX:
        raise ConfigurationError(
            f"{name}={value} is outside the signed 32-bit range "
            f"[{INT32_MIN}, {INT32_MAX}] that pg_try_advisory_lock(int, int) accepts"
        )
    return value
