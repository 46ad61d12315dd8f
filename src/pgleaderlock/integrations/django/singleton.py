"""``manage.py pgleaderlock_singleton``: run a management command on one replica of a
fleet, the one that holds the lock; like ``pgleaderlock exec`` for ``call_command``.

The lock runs in its own thread (a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock]);
the command runs in the calling thread, in-process, with ``call_command``, while the lock
leads. Its parts and exit codes are the command line's (`pgleaderlock.cli`): the server
is checked first (`preflight`), the wait is a `Deadline` on the server, and the codes are
``pgleaderlock exec``'s:

| Code | Meaning |
|---|---|
| the command's | it ran (0, or the code of its ``SystemExit``/``CommandError``) |
| 75 | the lock is held elsewhere (``--no-wait``, or ``--wait`` ran out): not run |
| 76 | leadership was lost while the command ran: it was interrupted |
| 2 | bad input, bad settings, an unreachable server or one that refuses this client |
| 127 | no such management command |
| 128+N | stopped by signal N (SIGINT 130, SIGTERM 143) |

Leadership lost while the command runs: it is interrupted (an exception raised in it,
from a Python-level signal handler, so it unwinds through its ``finally`` blocks and
transactions roll back), and if it is still running ``--kill-after`` seconds later, the
process exits 76 at once (``os._exit``), as ``exec`` sends SIGKILL. Both need the main
thread: from another thread (``call_command`` in a thread) the command is never
interrupted, and the result is 76 when it ends. Fence its database writes
(``fencing=True``) for a guarantee that does not depend on timing.

Processes the command starts never outlive the lock (on Linux, from the main thread):
they carry a mark in their environment, and a keeper process that holds the lock's
session stops them (SIGTERM, SIGKILL after ``--kill-after``) when the command ends,
before the lock is released, and kills them before the session can close if this
process dies (`pgleaderlock.proctree.marked`).
"""

from __future__ import annotations

import _thread
import asyncio
import math
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TextIO

from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command, get_commands
from django.core.management.base import CommandError

from ..._extras import needs_extra

with needs_extra("manage.py pgleaderlock_singleton", "click and loguru", "django"):
    import click  # noqa: F401 - the singleton reuses the command line's parts (below)
    import loguru  # noqa: F401

from ...cli.exits import (
    EXIT_HELD,
    EXIT_LOST,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CliError,
    first_line,
    signal_exit,
)
from ...cli.options import Common, Target
from ...cli.retry import Deadline
from ...cli.runtime import not_acquired_error, permanent_error, preflight
from ...lowlevel import (
    ConfigurationError,
    LeaderLock,
    LockState,
    ShutdownError,
    check_name,
    follow_state,
    is_permanent,
    mask_dsn,
    not_negative,
    positive,
)
from ...proctree.marked import MarkedRun
from ...threaded import ThreadedLeaderLock
from .conf import build_dsn, load, make_lock

__all__ = ["Interrupted", "Singleton"]

_WAKE = signal.SIGWINCH
"""Sent to the main thread to wake a blocking system call when leadership is lost
(ignored by default, so one that arrives after the command ended is harmless)."""


class Interrupted(BaseException):
    """Raised in the command: a signal (``signum``) or the loss of leadership
    (``signum`` is None). A ``BaseException``, so that ``except Exception`` in the
    command does not swallow it."""

    def __init__(self, signum: int | None) -> None:
        super().__init__("leadership lost" if signum is None else f"signal {signum}")
        self.signum = signum


@dataclass
class _Shared:
    """What the lock's thread and the command's thread share (under ``mutex``)."""

    mutex: threading.Lock = field(default_factory=threading.Lock)
    settled: threading.Event = field(default_factory=threading.Event)
    running: bool = False
    started: bool = False
    interruptible: bool = True
    lost: bool = False
    main_thread: int | None = None
    killer: threading.Timer | None = None


@dataclass
class Singleton:
    """One run of a management command under the lock ``name`` (see the module); make
    one for each run.

    Attributes:
        name: the lock's name.
        argv: the management command and its arguments.
        wait_s: how long to wait for the lock (``0``: one attempt, ``inf``: forever).
        held_exit_code: the exit code when the lock is held elsewhere.
        kill_after_s: after a loss, how long the command has to stop before the
            process exits.
        health_interval_s: the lock's probe interval while the command runs.
        stdout: where the command writes (default: ``sys.stdout``).
        stderr: where it and this writes errors (default: ``sys.stderr``).
        verbosity: Django's; from 1 on (the default), a line on ``stderr`` says that
            this waits, when the lock was not taken within a second.
    """

    name: str
    argv: Sequence[str]
    wait_s: float = math.inf
    held_exit_code: int = EXIT_HELD
    kill_after_s: float = 10.0
    health_interval_s: float = 5.0
    stdout: TextIO | None = None
    stderr: TextIO | None = None
    verbosity: int = 1
    _shared: _Shared = field(default_factory=_Shared, init=False, repr=False)

    def __post_init__(self) -> None:
        """Check what it was given, before any I/O.

        Raises:
            ConfigurationError: a bad name or number.
        """
        check_name(self.name, "name")
        if not (isinstance(self.wait_s, int | float) and math.isinf(self.wait_s)):
            not_negative("wait_s", self.wait_s)  # inf: forever
        elif self.wait_s < 0:
            raise ConfigurationError(f"wait_s must not be negative, got {self.wait_s!r}")
        positive("kill_after_s", self.kill_after_s)
        positive("health_interval_s", self.health_interval_s)
        code = self.held_exit_code
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
            raise ConfigurationError(f"held_exit_code must be an int 0..255, got {code!r}")

    def run(self) -> int:
        """Wait for the lock, run the command while it leads, release it.

        Returns:
            0 when the command returned (or the lock was held elsewhere and
            ``held_exit_code`` is 0); otherwise raises.

        Raises:
            CommandError: with ``returncode`` one of the module's codes.
            SystemExit: the command's own.
        """
        if not self.argv:
            raise CommandError("which command? put it after --", returncode=EXIT_USAGE)
        command = self.argv[0]
        if command not in get_commands():
            raise CommandError(f"unknown management command {command!r}", returncode=EXIT_NOT_FOUND)
        deadline = Deadline(self.wait_s)
        lock, common = self._lock(deadline)
        try:
            asyncio.run(preflight(common, lock))
        except CliError as exc:
            raise CommandError(exc.message, returncode=EXIT_USAGE) from None
        deadline.start()  # the wait counts from here, as the CLI's
        threaded = ThreadedLeaderLock(lock)
        shared = self._shared
        follow_state(lock, self._state_changed)
        with _handlers(shared):
            try:
                try:
                    threaded.start()
                except Exception as exc:
                    raise CommandError(
                        f"the lock {lock.label!r} did not start: {first_line(exc)}",
                        returncode=EXIT_USAGE,
                    ) from None
                if not shared.settled.wait(1.0) and self.verbosity >= 1:
                    forever = math.isinf(self.wait_s)
                    (self.stderr or sys.stderr).write(
                        f"the lock {lock.label!r} is held elsewhere: waiting for it "
                        f"({'forever' if forever else f'up to {self.wait_s:g} s'})\n"
                    )
                # A loop of this shape, not ``while <condition>:``: on CPython 3.13.0 an
                # exception a signal handler raises in some of those escapes the try.
                while True:
                    if shared.settled.wait(1.0):
                        break
                if not lock.is_leader:
                    return self._not_leading(lock, common)
                return self._call(lock, threaded)
            except Interrupted as exc:
                if exc.signum is None:
                    raise CommandError(
                        f"leadership of {lock.label!r} was lost while {command} ran: it "
                        "was interrupted"
                        if shared.started
                        else f"leadership of {lock.label!r} was lost before {command} "
                        "began: it was not run",
                        returncode=EXIT_LOST,
                    ) from None
                raise CommandError(
                    f"stopped by signal {signal.Signals(exc.signum).name}"
                    + ("" if shared.started else f": {command} was not run"),
                    returncode=signal_exit(signal.Signals(exc.signum)),
                ) from None
            finally:
                with shared.mutex:
                    shared.running = shared.interruptible = False
                    if shared.killer is not None:
                        shared.killer.cancel()
                # A release that does not complete in time closes the session, which
                # frees the lock on the server all the same.
                with suppress(ShutdownError):
                    threaded.shutdown()

    def _lock(self, deadline: Deadline) -> tuple[LeaderLock, Common]:
        try:
            settings = load()
            dsn = build_dsn(settings.database)
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        options: dict[str, Any] = {
            **settings.options,
            "retry_strategy": deadline,
            "auto_reacquire": False,
            "health_interval_s": self.health_interval_s,
        }
        try:
            lock = make_lock(self.name, dsn, options)
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        common = Common(
            dsn=dsn,
            target=Target(self.name, *lock.keys),
            backend=settings.options.get("backend"),
            connect_timeout_s=lock.connect_options.connect_timeout_s,
        )
        return lock, common

    def _not_leading(self, lock: LeaderLock, common: Common) -> int:
        """The lock settled without leading: held elsewhere (``held_exit_code``; 0 is
        returned, with the reason on stderr), or an error.

        Raises:
            CommandError: held elsewhere (a non-zero ``held_exit_code``), or why not.
        """
        stats = lock.statistics()
        if stats.last_error is not None and is_permanent(stats.last_error):
            error: CliError = permanent_error(common, stats.last_error)
        elif stats.failed_attempts:
            held = f"the lock {lock.label!r} is held elsewhere: {self.argv[0]} was not run"
            if self.held_exit_code == 0:
                (self.stderr or sys.stderr).write(held + "\n")
                return 0
            raise CommandError(held, returncode=self.held_exit_code)
        else:
            error = not_acquired_error(common, lock)
        raise CommandError(mask_dsn(error.message), returncode=EXIT_USAGE)

    def _call(self, lock: LeaderLock, threaded: ThreadedLeaderLock) -> int:
        shared = self._shared
        with shared.mutex:
            if shared.lost or not lock.is_leader:
                raise Interrupted(None)
            shared.running = shared.started = True
        marked = self._mark(threaded)
        streams = {k: v for k, v in (("stdout", self.stdout), ("stderr", self.stderr)) if v}
        try:
            call_command(*self.argv, **streams)
        except SystemExit:
            if shared.lost:
                raise Interrupted(None) from None
            raise
        finally:
            if marked is not None:
                self._unmark(marked)
        with shared.mutex:
            shared.running = False
            if shared.lost:
                raise Interrupted(None)
        return 0

    def _mark(self, threaded: ThreadedLeaderLock) -> MarkedRun | None:
        """In the main thread (on Linux): mark the processes the command starts, under a
        keeper that ends them before the lock can be freed (see `pgleaderlock.proctree`).
        From another thread the mark, which is process-wide, would catch the processes
        of other threads too: none then."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def waiting() -> None:  # in the lock's thread
            if self.verbosity >= 1:
                (self.stderr or sys.stderr).write(
                    f"the last run of {self.argv[0]} on this host is still being stopped: "
                    "waiting for it\n"
                )

        try:
            return MarkedRun.start(threaded, self.kill_after_s, waiting)
        except ConnectionError:  # lost since it was granted
            raise Interrupted(None) from None

    def _unmark(self, marked: MarkedRun) -> None:
        """Stop what the command left running (SIGTERM, SIGKILL after ``kill_after_s``)."""
        left = marked.stop()
        if left and self.verbosity >= 1:
            (self.stderr or sys.stderr).write(
                f"{self.argv[0]} left {left} process{'es' if left > 1 else ''} running: "
                "terminated before the lock is released\n"
            )

    def _state_changed(self, old: LockState, new: LockState) -> None:
        """In the lock's thread: settle the wait; on a loss, interrupt the command."""
        shared = self._shared
        if new is LockState.LEADER or new is LockState.STOPPED:
            shared.settled.set()
        if old is not LockState.LEADER or new is LockState.LEADER:
            return
        with shared.mutex:
            if not shared.running:
                return  # a release at the end, or a loss before the command began
            shared.lost = True
            if shared.main_thread is None:
                return  # not the main thread: the command cannot be interrupted
            _thread.interrupt_main(signal.SIGTERM)
            signal.pthread_kill(shared.main_thread, _WAKE)
            shared.killer = threading.Timer(self.kill_after_s, os._exit, (EXIT_LOST,))
            shared.killer.daemon = True
            shared.killer.start()


@contextmanager
def _handlers(shared: _Shared) -> Iterator[None]:
    """In the main thread: SIGTERM and SIGINT raise `Interrupted` (a loss, when
    ``shared.lost``), and `_WAKE` is caught (so that it interrupts a blocking call)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: types.FrameType | None) -> None:
        if shared.interruptible:  # not while the lock is being released
            raise Interrupted(None if shared.lost else signum)

    def wake(signum: int, frame: types.FrameType | None) -> None:
        pass

    ours: dict[signal.Signals, Callable[[int, types.FrameType | None], None]] = {
        signal.SIGTERM: interrupt,
        signal.SIGINT: interrupt,
        _WAKE: wake,
    }
    previous = {sig: signal.signal(sig, handler) for sig, handler in ours.items()}
    shared.main_thread = threading.get_ident()
    try:
        yield
    finally:
        with shared.mutex:
            shared.main_thread = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
