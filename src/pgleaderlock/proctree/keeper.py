"""The keeper: the small process that makes a command's process tree end before its lock.

It holds a duplicate of the lock session's socket, so the server cannot free the lock
while the keeper lives, and it lives until every process it answers for is gone. Its
parent (``pgleaderlock exec``/``cron``, the Django singleton command) writes orders to it
on a pipe; if the parent dies, even by SIGKILL, the pipe ends, and the keeper SIGKILLs
everything it answers for, waits until all of it is gone, and only then exits, which
closes the socket and frees the lock. So the next leader's command cannot start (on
any host) while a process of the last one runs.

Two kinds of work (the first argument):

- ``tree``: start COMMAND and answer for it and every descendant. On Linux the keeper
  is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a descendant whose parent ends
  (a double fork, ``setsid``, a daemon) is re-parented to the keeper, never to init, so
  "every descendant" is "every process below the keeper" (``/proc``), and the keeper
  knows it is gone when it has no child left. COMMAND dies with the keeper
  (``PR_SET_PDEATHSIG``). Elsewhere it answers for COMMAND's process group.
- ``marked`` (Linux): the command runs in the parent; the keeper answers for every
  process whose environment carries ``PGLEADERLOCK_KEEPER=<token>``, which the parent
  sets while its command runs, so the processes that command starts inherit it.

Orders, one a line: ``signal N`` (send signal N to COMMAND's process group), ``stop``
(SIGTERM to everything, SIGKILL to what is left after KILL_AFTER seconds), ``kill``
(SIGKILL now); the end of the pipe is ``kill``. Reports, one a line: ``started PID``,
``failed ERRNO MESSAGE`` (COMMAND could not be started), ``left N`` (COMMAND ended and
left N processes running: they are stopped), ``killed N`` (N processes needed SIGKILL),
``exit CODE`` (COMMAND's exit status, negative: killed by that signal; written once
everything is gone), ``done N`` (``marked``: N processes were stopped).

Standard library only, and little of it: it runs as ``python -I -S keeper.py`` (see
[`start_keeper`][pgleaderlock.proctree.tree.start_keeper]) so that it starts in tens of
milliseconds and imports nothing of the environment::

    keeper.py tree CTL REPORT SOCKET HOSTLOCK KILL_AFTER -- COMMAND...
    keeper.py marked CTL REPORT SOCKET HOSTLOCK KILL_AFTER TOKEN

SOCKET (the session's socket) and HOSTLOCK (the host's lock, see
[`hostlock`][pgleaderlock.proctree.hostlock]) are descriptors held until the keeper
exits, or ``-``; COMMAND inherits HOSTLOCK (as flock(1)'s command does), never SOCKET.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import time

# Nothing that imports collections (contextlib, typing, collections.abc): each costs the
# keeper's start, which delays COMMAND's, tens of milliseconds on a busy host.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["MARK", "descendants", "keeper_main", "marked", "prctl", "processes"]

MARK = "PGLEADERLOCK_KEEPER"
"""The environment variable whose value names the run (``marked``)."""

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.01
"""How often the keeper looks again when no signal tells it that something ended."""


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; False elsewhere or when it fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        call = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return False
    return bool(call(option, value, 0, 0, 0) == 0)


def processes() -> dict[int, tuple[int, str]]:
    """Every process of ``/proc``: its parent's pid and its state (empty without /proc)."""
    found: dict[int, tuple[int, str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
        except (OSError, ValueError):  # ended meanwhile
            continue
        found[int(entry)] = (int(ppid), state.decode())
    return found


def descendants(root: int) -> list[int]:
    """The pids of the processes below ``root`` that run (zombies left out).

    Walks the ``children`` files of ``/proc`` (reads a few files per process of the
    tree) where the kernel has them, else reads every process of ``/proc``. Either may
    miss a process that forks or ends during the walk: callers look again until what
    they wait for (no child left) is true."""
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return _descendants_by_scan(root)
    found, todo = [], _children(root)
    while todo:
        pid = todo.pop()
        todo.extend(_children(pid))
        if _state(pid) not in ("Z", "X", None):
            found.append(pid)
    return found


def _children(pid: int) -> list[int]:
    """``pid``'s children, from the ``children`` file of each of its threads."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # ended
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return found


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def _descendants_by_scan(root: int) -> list[int]:
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        if table[pid][1] not in ("Z", "X"):
            found.append(pid)
    return found


def marked(token: str, exclude: Iterable[int] = ()) -> list[int]:
    """The pids of the running processes whose environment holds ``MARK=token``."""
    needle = f"\0{MARK}={token}\0".encode()
    skip = {os.getpid(), *exclude}
    found = []
    for pid, (_, state) in processes().items():
        if pid in skip or state in ("Z", "X"):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = b"\0" + f.read()
        except OSError:  # ended, or not ours to read (nor to signal)
            continue
        if needle in environ or environ.endswith(needle[:-1]):
            found.append(pid)
    return found


def _signal(pids: Iterable[int], sig: int) -> int:
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent += 1
        except (ProcessLookupError, PermissionError):
            pass
    return sent


class _Keeper:
    """What both kinds share: the order pipe, the report pipe, stop and kill."""

    def __init__(self, ctl: int, report: int, kill_after_s: float) -> None:
        self.ctl: int | None = ctl
        self.out = report
        self.kill_after_s = kill_after_s
        self.deadline: float | None = None  # stopping: SIGKILL at this time
        self.stopping = False
        self.killing = False
        self.killed_reported = False
        self.found = 0  # how many processes ran when it was told to stop (or kill)

    def report(self, line: str) -> None:
        try:  # noqa: SIM105 - no contextlib (see the imports)
            os.write(self.out, (line + "\n").encode())
        except OSError:  # the parent is gone: nobody to tell
            pass

    def running(self) -> list[int]:
        raise NotImplementedError

    def send(self, sig: int) -> int:
        return _signal(self.running(), sig)

    def stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.found = self.send(signal.SIGTERM)
            self.deadline = time.monotonic() + self.kill_after_s

    def kill(self) -> None:
        if not self.stopping:
            self.found = self.send(signal.SIGKILL)
        self.stopping = self.killing = True
        self.deadline = None
        self.send(signal.SIGKILL)

    def order(self, line: str) -> None:
        if line == "stop":
            self.stop()
        elif line == "kill":
            self.kill()

    def read_orders(self) -> None:
        assert self.ctl is not None
        try:
            data = os.read(self.ctl, 4096)
        except OSError:
            data = b""
        if not data:  # the parent is gone (or gave up on us): nothing may outlive it
            os.close(self.ctl)
            self.ctl = None
            self.kill()
            return
        for line in data.decode(errors="replace").splitlines():
            self.order(line.strip())

    def tick(self) -> None:
        """After each wake-up: SIGKILL once the grace ran out, and again and again while
        killing (a process forked while the last SIGKILL was sent is caught)."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.deadline = None
            left = len(self.running())
            if left and not self.killed_reported:
                self.killed_reported = True
                self.report(f"killed {left}")
            self.killing = True
        if self.killing:
            self.send(signal.SIGKILL)

    def wait(self, extra: list[int], timeout_s: float | None) -> list[int]:
        """Sleep until an order, a signal (``extra``) or ``timeout_s``; the readable fds."""
        fds = [*extra, *([self.ctl] if self.ctl is not None else [])]
        if self.deadline is not None:
            left = max(0.0, self.deadline - time.monotonic())
            timeout_s = left if timeout_s is None else min(timeout_s, left)
        if self.killing:
            timeout_s = _POLL_S if timeout_s is None else min(timeout_s, _POLL_S)
        readable, _, _ = select.select(fds, [], [], timeout_s)
        if self.ctl is not None and self.ctl in readable:
            self.read_orders()
        return readable


class _TreeKeeper(_Keeper):
    """``tree``: COMMAND and its descendants (its process group without a subreaper)."""

    def __init__(self, ctl: int, report: int, kill_after_s: float) -> None:
        super().__init__(ctl, report, kill_after_s)
        self.subreaper = prctl(_PR_SET_CHILD_SUBREAPER, 1) and os.path.isdir("/proc/self/task")
        self.pid = 0
        self.status: int | None = None
        self.no_children = False

    def running(self) -> list[int]:
        if self.subreaper:
            return descendants(os.getpid())
        return [-self.pid] if self._group_runs() else []  # -pgid: the whole group

    def _group_runs(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def order(self, line: str) -> None:
        what, _, value = line.partition(" ")
        if what == "signal" and value.isdigit():
            try:  # noqa: SIM105
                os.killpg(self.pid, int(value))
            except (ProcessLookupError, PermissionError):
                pass
        else:
            super().order(line)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.no_children = True
                return
            if pid == 0:
                self.no_children = False
                return
            if pid == self.pid:
                self.status = os.waitstatus_to_exitcode(status)

    def gone(self) -> bool:
        if self.status is None:
            return False
        if self.subreaper:
            return self.no_children
        return not self._group_runs()

    def run(self, command: list[str]) -> int:
        try:
            self.pid = _spawn(command)
        except OSError as exc:
            self.report(f"failed {exc.errno or 0} {exc.strerror or exc}")
            return 0
        self.report(f"started {self.pid}")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, _ignore)
        while True:
            self.reap()
            if self.gone():
                break
            if self.status is not None and not self.stopping:
                left = len(self.running()) if self.subreaper else -1
                if left:
                    self.report(f"left {left}")
                self.stop()
            # Without a subreaper, nothing signals the end of a group's last process.
            poll = None if self.subreaper or self.status is None else _POLL_S
            if wake_r in self.wait([wake_r], poll):
                try:  # noqa: SIM105
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            self.tick()
        self.report(f"exit {self.status}")
        return 0


class _MarkedKeeper(_Keeper):
    """``marked``: the processes that carry the run's token."""

    def __init__(self, ctl: int, report: int, kill_after_s: float, token: str) -> None:
        super().__init__(ctl, report, kill_after_s)
        self.token = token
        self.parent = os.getppid()

    def running(self) -> list[int]:
        return marked(self.token, exclude=(self.parent,))

    def run(self) -> int:
        while not (self.stopping and not self.running()):
            self.wait([], _POLL_S if self.stopping else None)
            self.tick()
        self.report(f"done {self.found}")
        return 0


def _spawn(command: list[str]) -> int:
    """Fork and exec ``command`` in a process group of its own, to die with this
    process (Linux); its pid.

    Raises:
        OSError: it could not be executed (the child's errno, sent on a pipe that the
            exec closes).
    """
    keeper = os.getpid()
    errors_r, errors_w = os.pipe()  # close-on-exec
    pid = os.fork()
    if pid == 0:  # the child: this process has one thread, so fork is safe
        try:
            os.setpgid(0, 0)
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
            if os.getppid() != keeper:  # the keeper died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them: not COMMAND
                signal.signal(sig, signal.SIG_DFL)
            os.execvp(command[0], command)
        except OSError as exc:
            os.write(errors_w, f"{exc.errno or 0} {exc.strerror or exc}".encode())
        finally:
            os._exit(127)
    os.close(errors_w)
    with open(errors_r, "rb") as errors:
        failure = errors.read()
    if failure:
        os.waitpid(pid, 0)
        code, _, message = failure.decode(errors="replace").partition(" ")
        raise OSError(int(code), message)
    return pid


def _ignore(signum: int, frame: object) -> None:
    """A handler that does nothing (unlike SIG_IGN, not inherited through exec)."""


def keeper_main(argv: list[str]) -> int:
    """The keeper's entry point (see the module)."""
    kind, ctl, report, sock, hostlock, kill_after = argv[:6]
    # Outlive whoever signals the group or the session it came from: only its orders
    # (or the end of their pipe) stop it.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _ignore)
    # The descriptors it was given are not COMMAND's to inherit; the session's socket is
    # held open (never used) until this process exits.
    for fd in (ctl, report, sock):
        if fd != "-":
            os.set_inheritable(int(fd), False)
    if kind == "tree":
        if hostlock != "-":  # COMMAND's descendants hold the host's lock too
            os.set_inheritable(int(hostlock), True)
        return _TreeKeeper(int(ctl), int(report), float(kill_after)).run(argv[7:])
    return _MarkedKeeper(int(ctl), int(report), float(kill_after), argv[6]).run()


if __name__ == "__main__":
    sys.exit(keeper_main(sys.argv[1:]))
