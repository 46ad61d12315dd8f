"""Lock identity: deriving the two int4 advisory-lock keys from a name, and the one
conversion between a key and the oid that `pg_locks` shows for it."""

from __future__ import annotations

import hashlib
import unicodedata

from .errors import ConfigurationError
from .text import unsafe_characters

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "MAX_SLOTS",
    "check_key",
    "check_name",
    "find_slot",
    "key_to_oid",
    "lock_keys",
    "oid_to_key",
    "slot_keys",
]

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
_OID_MAX = 2**32 - 1


def key_to_oid(key: int) -> int:
    """The unsigned value `pg_locks` shows for an int4 key (its `classid` or `objid`).

    A lock taken with `pg_advisory_lock(key1, key2)` appears in `pg_locks` with
    `classid = key1`, `objid = key2` and `objsubid = 2`, both of type `oid`: unsigned,
    so a negative key shows as `key + 2**32`. [`oid_to_key`][pgleaderlock.core.keys.oid_to_key]
    is the inverse.

    Args:
        key: a signed 32-bit lock key.

    Returns:
        The key's two's-complement bits read as an unsigned 32-bit integer.

    Raises:
        ValueError: `key` is outside the signed 32-bit range.
    """
    if not INT32_MIN <= key <= INT32_MAX:
        raise ValueError(f"key {key} is outside the signed 32-bit range")
    return key & _OID_MAX


def oid_to_key(oid: int) -> int:
    """The int4 key whose lock `pg_locks` shows as `oid` (inverse of
    [`key_to_oid`][pgleaderlock.core.keys.key_to_oid]).

    Args:
        oid: an unsigned 32-bit value (a `classid` or `objid` of `pg_locks`).

    Returns:
        The same 32 bits read as a signed integer.

    Raises:
        ValueError: `oid` is outside the unsigned 32-bit range.
    """
    if not 0 <= oid <= _OID_MAX:
        raise ValueError(f"oid {oid} is outside the unsigned 32-bit range")
    return oid - 2**32 if oid > INT32_MAX else oid


def check_name(name: object, what: str = "lock name", *, max_chars: int | None = None) -> str:
    """A name the library may put in ``application_name``, in logs and on an operator's
    terminal: a non-empty string (of at most ``max_chars`` characters, when given)
    without a character of the Unicode categories in
    [`UNSAFE_CATEGORIES`][pgleaderlock.core.text.UNSAFE_CATEGORIES]: no control (a NUL
    would make every connection fail, a newline forge a log line, ESC or CSI U+009B
    drive a terminal), no format character (a bidi override such as U+202E shows one
    name as another), no surrogate, line or paragraph separator. The one rule for
    every name the library is given.

    Raises:
        ConfigurationError: anything else.
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"{what} must be a non-empty string, got {name!r}")
    if max_chars is not None and len(name) > max_chars:
        raise ConfigurationError(
            f"{what} must be at most {max_chars} characters, got {len(name)}: {name[:40]!r}..."
        )
    bad = unsafe_characters(name)
    if bad:
        codes = ", ".join(f"U+{ord(ch):04X} ({unicodedata.category(ch)})" for ch in bad)
        raise ConfigurationError(
            f"{what} must not contain control characters, nor format (bidi), surrogate, "
            f"line or paragraph separator ones (Unicode Cc, Cf, Cs, Zl, Zp), got {name!r}: "
            f"{codes}"
        )
    return name


def lock_keys(name: str) -> tuple[int, int]:
    """Derive ``(key1, key2)`` from a lock name, exactly as PostgreSQL would.

    The result equals, bit for bit,

    ```sql
    SELECT ('x' || substr(md5(name), 1, 8))::bit(32)::int,
           ('x' || substr(md5(name), 9, 8))::bit(32)::int;
    ```

    on a UTF-8 database, so SQL and Python agree on the lock a name stands for.

    Args:
        name: any non-empty string without control characters (it names the lock in
            ``application_name`` and in logs); it is hashed as UTF-8.

    Raises:
        ConfigurationError: if ``name`` is not a non-empty string, or holds a control
            character (NUL, a newline, ...).
    """
    check_name(name)
    digest = hashlib.md5(name.encode("utf-8"), usedforsecurity=False).hexdigest()
    return oid_to_key(int(digest[0:8], 16)), oid_to_key(int(digest[8:16], 16))


MAX_SLOTS = 1024
"""The most slots a [`Semaphore`][pgleaderlock.Semaphore] may have. Each holder is a
database session of its own (a server's ``max_connections`` is 100 by default, a few
thousand at most in practice). Past it, use a lock per worker, or a Coordinator's
names."""

SLOT_SEPARATOR = "\x1f"
"""Between a semaphore's name and a slot's index in the string its slot keys are derived
from: a control character (ASCII unit separator), which no lock name may hold, so no
[`lock_keys`][pgleaderlock.lock_keys] of any name gives a slot's keys."""


def slot_keys(name: str, slots: int) -> list[tuple[int, int]]:
    """The advisory-lock keys of each slot of the semaphore ``name`` (see
    [`Semaphore`][pgleaderlock.Semaphore]): slot ``i`` has the keys derived as
    [`lock_keys`][pgleaderlock.lock_keys] derives them, from ``name + "\\x1f" + str(i)``
    (hashed as UTF-8), i.e.

    ```sql
    SELECT ('x' || substr(md5(name || chr(31) || i), 1, 8))::bit(32)::int,
           ('x' || substr(md5(name || chr(31) || i), 9, 8))::bit(32)::int;
    ```

    The separator is a control character, which `lock_keys` refuses in a name: no
    `LeaderLock.from_name`, `Semaphore` of another name, or other name-derived lock can
    share a slot's keys (short of an MD5 collision of 64 bits).

    Args:
        name: the semaphore's name (as for `lock_keys`).
        slots: how many slots, 1 to `MAX_SLOTS` (1,024).

    Raises:
        ConfigurationError: a bad name, or ``slots`` not an int from 1 to 1,024.
    """
    check_name(name)
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ConfigurationError(
            f"slots must be an int from 1 to {MAX_SLOTS} (each holder is a session of its "
            f"own), got {slots!r}"
        )
    return [_slot_key(name, index) for index in range(slots)]


def _slot_key(name: str, index: int) -> tuple[int, int]:
    digest = hashlib.md5(f"{name}{SLOT_SEPARATOR}{index}".encode(), usedforsecurity=False)
    hexdigest = digest.hexdigest()
    return oid_to_key(int(hexdigest[0:8], 16)), oid_to_key(int(hexdigest[8:16], 16))


def find_slot(name: str, keys: tuple[int, int], limit: int = MAX_SLOTS) -> int | None:
    """Which slot of the semaphore ``name`` has ``keys`` (among the first ``limit``), or
    ``None``: for ``pgleaderlock status``, which sees a slot's keys and its holder's
    ``application_name`` (the semaphore's name) but not how many slots it has."""
    return next((i for i in range(limit) if _slot_key(name, i) == keys), None)


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
