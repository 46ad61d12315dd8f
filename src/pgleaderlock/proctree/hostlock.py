"""The host's own lock: on one host, a leader's command starts only once the last
leader's command tree is gone, however the last leadership ended.

The keeper holds the lock's session until the tree it answers for is gone, so a holder
that dies frees the lock only after that. But the server may end the session first (a
terminated backend, a restart, a partition, the lease): the lock is free at once, and
a leader on the same host could start its command while the last one's is still being
stopped. So each leader also takes a lock of this host, ``flock(2)`` on a file named by
the database and the lock's keys, before its command starts, and hands it to the keeper
(and, as flock(1) does, to COMMAND and its descendants, which inherit it): it is free
again only once every process that holds it has ended.

The file lives in a directory of this user (``$XDG_RUNTIME_DIR`` or the temporary
directory, ``pgleaderlock-<uid>``, mode 0700): processes of other users neither share
it nor can hold it against this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..lowlevel import (
    LeaderLock,
    QuerySession,
    Semaphore,
    SessionSlot,
    get_logger,
    lock_settings,
    run_on_session,
)

__all__ = ["guard_dir", "host_lock", "lock_file"]

log = get_logger("pgleaderlock.proctree")

_POLL_S = 0.02
"""How often a leader that waits for the host's lock looks again (and whether it
still leads)."""

_PRIVILEGE = (
    "SELECT pg_catalog.has_function_privilege('pg_catalog.pg_control_system()', 'EXECUTE'),"
    " pg_catalog.current_database()::text,"
    " COALESCE(pg_catalog.host(pg_catalog.inet_server_addr()), '')"
    " || ':' || pg_catalog.current_setting('port')"
)
_SYSTEM = "SELECT system_identifier::text FROM pg_catalog.pg_control_system()"


def guard_dir() -> Path | None:
    """This user's directory for the host's locks (made if missing), or None if it
    cannot be trusted (not a directory of this user's, or open to others)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"pgleaderlock-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        info = path.lstat()
    except OSError:
        return None
    ours = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    return path if ours and not info.st_mode & 0o077 else None


async def lock_file(lock: LeaderLock) -> str | None:
    """The name of the host's lock file for ``lock``'s current leadership: the
    database (its cluster's ``system_identifier`` where this role may read it, else its
    server address and port) and the keys it holds (a semaphore's: its slot's). None if
    the session cannot tell."""

    async def identify(slot: SessionSlot) -> str | None:
        session = slot.session
        if not isinstance(session, QuerySession):
            return None
        ((allowed, database, server),) = await session.query(_PRIVILEGE, ())
        if allowed:
            ((server,),) = await session.query(_SYSTEM, ())
        return f"{server}/{database}"

    where = await run_on_session(lock, identify, lock_settings(lock).command_timeout_s)
    keys = lock.held_keys if isinstance(lock, Semaphore) else lock.keys
    if where is None or keys is None:
        return None
    digest = hashlib.sha256(f"{where}/{keys[0]}/{keys[1]}".encode()).hexdigest()
    return f"{digest[:32]}.lock"


async def host_lock(lock: LeaderLock, waiting: Callable[[], None] | None = None) -> int | None:
    """Take the host's lock for ``lock``'s leadership; its descriptor (the caller's to
    close, or to hand over), or None where there is none to take (no trusted directory,
    a session that cannot tell the database).

    Args:
        lock: a lock that leads.
        waiting: called once if the host's lock is held (the last leader's command on
            this host is still being stopped) and this waits for it.

    Raises:
        ConnectionError: ``lock`` stopped leading before the host's lock was free.
    """
    directory = guard_dir()
    name = await lock_file(lock)
    if directory is None or name is None:
        log.warning("host_lock_unavailable", lock=lock.label, reason="no directory of this "
                    "user's alone" if directory is None else "the session cannot tell the "
                    "database")  # fmt: skip
        return None
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(directory / name, flags, 0o600)
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                pass
            if not lock.is_leader:
                raise ConnectionError("the lock was lost while the last command ended")
            if not told and waiting is not None:
                told = True
                waiting()
            await asyncio.sleep(_POLL_S)
    except BaseException:
        os.close(fd)
        raise
