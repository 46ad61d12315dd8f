"""A command run under a lock whose process tree never outlives the lock (``pgleaderlock
exec`` and ``cron``).

[`CommandTree`][pgleaderlock.proctree.tree.CommandTree] starts the keeper
([`keeper`][pgleaderlock.proctree.keeper]), which starts COMMAND and holds a duplicate
of the lock session's socket: whatever ends this process, the lock is freed on the
server only once the keeper has seen every process of COMMAND's tree gone. This process
gives the orders: forward a signal, stop the tree (SIGTERM, then SIGKILL), kill it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..lowlevel import LeaderLock, SessionSlot, SocketSession, lock_settings, run_on_session
from .hostlock import host_lock
from .keeper import _PR_SET_CHILD_SUBREAPER, descendants, prctl, processes

__all__ = [
    "KEEPER",
    "CommandTree",
    "Report",
    "become_subreaper",
    "end_orphans",
    "held_by_keeper",
    "keeper_argv",
    "session_socket",
    "start_keeper",
]

KEEPER = Path(__file__).with_name("keeper.py")

Report = Callable[[str, int], None]
"""Called with what the keeper reports while the tree runs: ``("left", N)`` (COMMAND
ended and left N processes running, -1: some; they are being stopped), ``("killed",
N)`` (N processes needed SIGKILL), ``("orphans", N)`` (the keeper died: N processes
re-parented to this process were killed)."""


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux): if a keeper dies, what is left of
    its tree is re-parented here, where `end_orphans` finds it. False elsewhere."""
    return prctl(_PR_SET_CHILD_SUBREAPER, 1)


def end_orphans(timeout_s: float = 10.0) -> int:
    """SIGKILL every process below this one and reap those that are its children; for
    a subreaper whose keeper died. Blocking (run it in a thread).

    Returns:
        How many processes were found.
    """
    me, found = os.getpid(), set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = descendants(me)
        if not pids:
            break
        found.update(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _reap_children(me)
        time.sleep(0.005)
    _reap_children(me)
    return len(found)


def _reap_children(me: int) -> None:
    for pid, (ppid, state) in processes().items():
        if ppid == me and state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


async def held_by_keeper(
    lock: LeaderLock, waiting: Callable[[], None] | None = None
) -> tuple[int | None, int | None]:
    """What a keeper of ``lock``'s command holds: a duplicate of the session's socket
    (`session_socket`) and the host's lock
    ([`host_lock`][pgleaderlock.proctree.hostlock.host_lock], which waits, calling
    ``waiting``, while the last leader's command on this host is being stopped). The
    caller closes both (after the keeper started).

    Raises:
        ConnectionError: the lock does not lead (any more).
    """
    hostlock = await host_lock(lock, waiting)
    try:
        return await session_socket(lock), hostlock
    except BaseException:
        if hostlock is not None:
            os.close(hostlock)
        raise


async def session_socket(lock: LeaderLock) -> int | None:
    """A duplicate of the descriptor of ``lock``'s session socket (the caller closes
    it), taken while it leads; None when its session cannot give one.

    Raises:
        ConnectionError: the lock does not lead (or lost its session meanwhile).
    """

    async def dup(slot: SessionSlot) -> int | None:
        session = slot.session
        if isinstance(session, SocketSession):
            fd = session.fileno()
            if fd >= 0:
                return os.dup(fd)
        return None

    return await run_on_session(lock, dup, lock_settings(lock).command_timeout_s)


def keeper_argv(
    kind: str,
    ctl: int,
    report: int,
    held: tuple[int | None, int | None],
    kill_after_s: float,
    arguments: Sequence[str],
) -> list[str]:
    """The keeper's command line (see [`keeper`][pgleaderlock.proctree.keeper]);
    ``held``: the session's socket and the host's lock, or None."""
    sock, hostlock = ("-" if fd is None else str(fd) for fd in held)
    return [sys.executable, "-I", "-S", str(KEEPER), kind, str(ctl), str(report), sock,
            hostlock, repr(kill_after_s), *arguments]  # fmt: skip


async def start_keeper(
    kind: str,
    held: tuple[int | None, int | None],
    kill_after_s: float,
    arguments: Sequence[str],
    env: dict[str, str] | None = None,
) -> tuple[asyncio.subprocess.Process, int, int]:
    """Start the keeper (``python -I -S keeper.py KIND ...``) in a session of its own,
    holding ``held`` (the session's socket and the host's lock, or None).

    Returns:
        The keeper's process, the descriptor this process writes orders to, and the one
        it reads reports from (both this process's to close).
    """
    ctl_r, ctl_w = os.pipe()
    report_r, report_w = os.pipe()
    fds = [ctl_r, report_w, *(fd for fd in held if fd is not None)]
    argv = keeper_argv(kind, ctl_r, report_w, held, kill_after_s, arguments)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, pass_fds=fds, start_new_session=True
        )
    except BaseException:
        os.close(ctl_w)
        os.close(report_r)
        raise
    finally:
        os.close(ctl_r)
        os.close(report_w)
    return proc, ctl_w, report_r


class CommandTree:
    """COMMAND and every process it starts, under a keeper process; make one with
    [`start`][pgleaderlock.proctree.tree.CommandTree.start].

    Attributes:
        pid: COMMAND's pid (the leader of its process group).
        returncode: COMMAND's exit status once the tree is gone (negative: killed by
            that signal); the keeper's, if the keeper itself died.
        keeper_died: the keeper ended without reporting (it was killed).
    """

    def __init__(
        self,
        keeper: asyncio.subprocess.Process,
        ctl: int,
        reports: asyncio.StreamReader,
        transport: asyncio.BaseTransport,
        report: Report | None,
    ) -> None:
        self._keeper, self._ctl, self._reports = keeper, ctl, reports
        self._transport, self._report = transport, report
        self.pid = 0
        self.returncode: int | None = None
        self.keeper_died = False
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        command: Sequence[str],
        *,
        session_fd: int | None,
        kill_after_s: float,
        hostlock_fd: int | None = None,
        env: dict[str, str] | None = None,
        report: Report | None = None,
    ) -> CommandTree:
        """Start COMMAND under a keeper that holds ``session_fd`` (a socket descriptor)
        and ``hostlock_fd`` (the host's lock, see
        [`host_lock`][pgleaderlock.proctree.hostlock.host_lock]) until the tree is gone;
        both are left open here: the caller closes its own.

        Raises:
            FileNotFoundError: COMMAND is not found.
            OSError: it cannot be executed, or the keeper could not start.
        """
        proc, ctl, report_r = await start_keeper(
            "tree", (session_fd, hostlock_fd), kill_after_s, ["--", *command], env
        )
        reader = asyncio.StreamReader()
        transport: asyncio.BaseTransport | None = None
        try:
            transport, _ = await asyncio.get_running_loop().connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(report_r, "rb", 0)
            )
            first = (await reader.readline()).decode(errors="replace").split(maxsplit=2)
        except BaseException:  # cancelled: the end of the order pipe ends the keeper
            os.close(ctl)
            if transport is None:
                os.close(report_r)
            else:
                transport.close()
            await asyncio.shield(_reap(proc))
            raise
        tree = cls(proc, ctl, reader, transport, report)
        if first[:1] == ["started"]:
            tree.pid = int(first[1])
            tree._reader = asyncio.get_running_loop().create_task(
                tree._follow(), name=f"pgleaderlock-keeper-{proc.pid}"
            )
            return tree
        tree._close_orders()
        transport.close()
        await _reap(proc)
        if first[:1] == ["failed"]:
            code = int(first[1])
            message = first[2].strip() if len(first) > 2 else os.strerror(code)
            raise (FileNotFoundError if code == errno.ENOENT else OSError)(code, message)
        raise OSError(f"the keeper process did not start (exit status {proc.returncode})")

    async def _follow(self) -> None:
        while line := await self._reports.readline():
            what, _, value = line.decode(errors="replace").strip().partition(" ")
            if what == "exit":
                self.returncode = int(value)
            elif what in ("left", "killed") and self._report is not None:
                self._report(what, int(value))
        self._transport.close()
        self._close_orders()
        await self._keeper.wait()
        if self.returncode is None:  # the keeper was killed: its tree came to us
            self.keeper_died = True
            self.returncode = self._keeper.returncode
            orphans = await asyncio.to_thread(end_orphans)
            if self._report is not None:
                self._report("orphans", orphans)

    def _order(self, line: str) -> None:
        with contextlib.suppress(OSError):  # the keeper is gone: nothing to order
            os.write(self._ctl, (line + "\n").encode())

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to COMMAND's process group."""
        self._order(f"signal {int(sig)}")

    def kill(self) -> None:
        """SIGKILL every process of the tree now (see `wait`)."""
        self._order("kill")

    async def stop(self) -> int:
        """SIGTERM to every process of the tree, SIGKILL to what is left after the
        keeper's ``kill_after_s``; return COMMAND's exit status once all is gone."""
        self._order("stop")
        return await self.wait()

    async def wait(self) -> int:
        """COMMAND's exit status, once every process of its tree is gone (and the
        keeper, which frees the session it held)."""
        assert self._reader is not None
        await asyncio.shield(self._reader)
        assert self.returncode is not None
        return self.returncode

    async def aclose(self) -> None:
        """Kill what runs of the tree (if anything) and wait until it is gone."""
        self._close_orders()
        if self._reader is not None:
            await asyncio.shield(self._reader)

    def _close_orders(self) -> None:
        """Close the order pipe (idempotent): for the keeper, an order to kill."""
        if self._ctl >= 0:
            os.close(self._ctl)
            self._ctl = -1


async def _reap(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
