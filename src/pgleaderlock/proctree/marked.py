"""The processes that a command run in this process starts never outlive the lock (the
Django singleton command).

The command runs here, in the process that holds the lock: it ends with that process,
whatever ends it. The processes it starts do not, so while it runs,
[`MarkedRun`][pgleaderlock.proctree.marked.MarkedRun] sets a mark in this process's
environment (``PGLEADERLOCK_KEEPER=<token>``), which every process started meanwhile
inherits, and starts a keeper ([`keeper`][pgleaderlock.proctree.keeper], ``marked``)
that holds a duplicate of the lock session's socket and the host's lock
([`hostlock`][pgleaderlock.proctree.hostlock]). At the end of the run the keeper
stops the marked processes (SIGTERM, then SIGKILL) before the lock is released; if this
process dies, the keeper SIGKILLs them and waits until they are gone before the session
can close. Linux only (``/proc``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import select
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future

from ..threaded import ThreadedLeaderLock
from .keeper import MARK
from .tree import held_by_keeper, keeper_argv

__all__ = ["MarkedRun"]

_SETTLE_S = 10.0
"""How long, beyond ``kill_after_s``, the end of a run waits for the keeper."""


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def _let_go(future: Future[tuple[int | None, int | None]]) -> None:
    """The descriptors a given-up `held_by_keeper` took after all."""
    if not future.cancelled() and future.exception() is None:
        for fd in future.result():
            _close(fd)


class MarkedRun:
    """One run of a command in this process, under a keeper that answers for the
    processes it starts; make one with
    [`start`][pgleaderlock.proctree.marked.MarkedRun.start], end it with
    [`stop`][pgleaderlock.proctree.marked.MarkedRun.stop]."""

    def __init__(self, keeper: subprocess.Popen[bytes], ctl: int, reports: int, token: str) -> None:
        self._keeper, self._ctl, self._reports, self._token = keeper, ctl, reports, token
        self._kill_after_s = 0.0

    @classmethod
    def start(
        cls,
        lock: ThreadedLeaderLock,
        kill_after_s: float,
        waiting: Callable[[], None] | None = None,
    ) -> MarkedRun | None:
        """Mark the processes started from now on, under a keeper that holds ``lock``'s
        session and the host's lock (which this waits for, calling ``waiting``, while
        the last leader's run on this host is being stopped: see
        [`held_by_keeper`][pgleaderlock.proctree.tree.held_by_keeper]); None where this
        cannot be done (not Linux, no session to hold).

        Raises:
            ConnectionError: the lock does not lead (any more).
        """
        loop = lock.loop
        if not sys.platform.startswith("linux") or loop is None:
            return None
        future = asyncio.run_coroutine_threadsafe(held_by_keeper(lock.lock, waiting), loop)
        try:
            sock, hostlock = future.result()
        except BaseException:  # interrupted here: what it takes later is let go
            future.cancel()
            future.add_done_callback(_let_go)
            raise
        if sock is None:
            _close(hostlock)
            return None
        token = secrets.token_hex(16)
        ctl_r, ctl_w = os.pipe()
        reports_r, reports_w = os.pipe()
        held = [fd for fd in (sock, hostlock) if fd is not None]
        try:
            keeper = subprocess.Popen(
                keeper_argv("marked", ctl_r, reports_w, (sock, hostlock), kill_after_s, [token]),
                pass_fds=(ctl_r, reports_w, *held),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(ctl_w)
            os.close(reports_r)
            raise
        finally:
            for fd in (ctl_r, reports_w, *held):
                os.close(fd)
        run = cls(keeper, ctl_w, reports_r, token)
        run._kill_after_s = kill_after_s
        os.environ[MARK] = token
        return run

    def stop(self) -> int:
        """Unmark; SIGTERM to the marked processes that still run, SIGKILL to those left
        after ``kill_after_s``; return once they are gone (or the keeper was given up
        on, ``kill_after_s`` + 10 s later), before the lock is released.

        Returns:
            How many marked processes were still running.
        """
        if os.environ.get(MARK) == self._token:
            del os.environ[MARK]
        with contextlib.suppress(OSError):
            os.write(self._ctl, b"stop\n")
        deadline = time.monotonic() + self._kill_after_s + _SETTLE_S
        data = b""
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([self._reports], [], [], deadline - time.monotonic())
                chunk = os.read(self._reports, 4096) if ready else b""
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(self._ctl)  # and if it did not finish in time: kill them now
            os.close(self._reports)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._keeper.wait(_SETTLE_S)
        for line in data.decode(errors="replace").splitlines():
            what, _, count = line.partition(" ")
            if what == "done":
                return int(count)
        return 0
