"""A [`LeaderLock`][pgleaderlock.LeaderLock] in a child process that prints its events as
JSON lines.

**The child**, ``python -m pgleaderlock.testing.candidate --lock-name NAME`` (or
``--key1 K1 --key2 K2``), runs one lock against the DSN in ``$PGLEADERLOCK_CANDIDATE_DSN``
(or ``--dsn``) and prints one JSON object per line on stdout:

```json
{"t": 81234.567891, "event": "acquired", "backend_pid": 4242}
```

``t`` is ``time.monotonic()``: one clock for every process of a Linux host, network
namespaces included. The events are ``ready`` (the lock has started; ``pid``), ``state``
(``old``, ``new``), ``acquired`` (``term``: the fencing term, or ``null`` without
fencing; and ``slot`` for a semaphore, ``--slots N``), ``acquire_failed``, ``lost``,
``released``, ``error`` (``error``), ``stopped``, ``step_down_returned`` (``state``),
``shutdown_error`` (``error``) and, last, ``exit`` (``state``). stdin takes ``step_down``
and ``shutdown`` lines; EOF (the parent is gone), SIGTERM and SIGINT shut the lock down too.

**The parent**: [`CandidateProcess`][pgleaderlock.testing.candidate.CandidateProcess] starts
and observes one child from asyncio and can feed a
[`BeliefLog`][pgleaderlock.testing.beliefs.BeliefLog]. Other parents (threads, other
languages) build the command with
[`candidate_command`][pgleaderlock.testing.candidate.candidate_command] and read the lines
with [`parse_event`][pgleaderlock.testing.candidate.parse_event];
[`write_event`][pgleaderlock.testing.candidate.write_event] prints a line in the same
format, for programs of your own that should be observed the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Literal, Self

from ..lowlevel import LockState
from .candidate_child import main
from .candidate_protocol import DSN_ENV, MODULE, CandidateEvent, parse_event, write_event

if TYPE_CHECKING:
    from .beliefs import BeliefLog

__all__ = [
    "DSN_ENV",
    "CandidateEvent",
    "CandidateOptions",
    "CandidateProcess",
    "candidate_command",
    "main",
    "parse_event",
    "write_event",
]


@dataclass(frozen=True)
class CandidateOptions:
    """The [`LeaderLock`][pgleaderlock.LeaderLock] settings of a candidate process.

    The defaults are short timings for tests. ``None`` leaves a setting at the library's
    default;
    [`library_defaults`][pgleaderlock.testing.candidate.CandidateOptions.library_defaults]
    gives options with every timing there.

    Attributes:
        retry_s: the retry strategy is ``FixedInterval(retry_s)``; ``None``: the
            library's default (``ExponentialBackoff()``).
        step_down_timeout_s: bound of a ``step_down`` command.
        shutdown_timeout_s: bound of the final ``shutdown()``.
        quiet: silence the library's log; otherwise its warnings go to the child's
            stderr.
        fencing: ``Fencing(enabled=True)``: the term is bumped before every
            acquisition is announced (its ``acquired`` events carry it).
        fencing_table: the table of terms; ``None``: the library's default.
        acquire_delay_s: with fencing, ``acquire_delay_s``; ``None``: the default (0).
        lease_s: ``lease_s``; ``None``: the default (from ``health_interval_s``).
        fencing_grace_s: with fencing, ``fencing_grace_s``; ``None``: the default.
        backend: the driver backend (``"psycopg"``, ``"asyncpg"``, ...); ``None``: the
            default (from the DSN, else psycopg).
        slots: a [`Semaphore`][pgleaderlock.Semaphore] of this many slots named by the
            lock name instead of a lock (its ``acquired`` events carry the ``slot``);
            ``None``: a lock.
        rescan_s: with ``slots``, the semaphore's ``rescan_s``; ``None``: the default.
    """

    health_interval_s: float | None = 1.0
    health_timeout_s: float | None = 0.5
    tcp_user_timeout_s: float | None = None
    connect_timeout_s: float | None = 2.0
    command_timeout_s: float | None = 2.0
    retry_s: float | None = 0.2
    follower_mode: Literal["wait", "poll"] = "wait"
    reconnect_grace_s: float | None = None
    step_down_timeout_s: float = 5.0
    shutdown_timeout_s: float = 10.0
    application_name: str | None = None
    quiet: bool = False
    fencing: bool = False
    fencing_table: str | None = None
    acquire_delay_s: float | None = None
    lease_s: float | None = None
    fencing_grace_s: float | None = None
    backend: str | None = None
    slots: int | None = None
    rescan_s: float | None = None

    @classmethod
    def library_defaults(cls, **changes: Any) -> CandidateOptions:
        """Options that leave every timing at the library's default, then ``changes``."""
        base = cls(
            health_interval_s=None,
            health_timeout_s=None,
            connect_timeout_s=None,
            command_timeout_s=None,
            retry_s=None,
        )
        return dataclasses.replace(base, **changes)

    def argv(self) -> list[str]:
        """These options as command-line arguments of the child."""
        optional = {
            "--health-interval": self.health_interval_s,
            "--health-timeout": self.health_timeout_s,
            "--tcp-user-timeout": self.tcp_user_timeout_s,
            "--connect-timeout": self.connect_timeout_s,
            "--command-timeout": self.command_timeout_s,
            "--retry": self.retry_s,
            "--grace": self.reconnect_grace_s,
            "--application-name": self.application_name,
            "--fencing-table": self.fencing_table,
            "--acquire-delay": self.acquire_delay_s,
            "--lease": self.lease_s,
            "--fencing-grace": self.fencing_grace_s,
            "--backend": self.backend,
            "--slots": self.slots,
            "--rescan": self.rescan_s,
        }
        args = [f"{flag}={value}" for flag, value in optional.items() if value is not None]
        args += [
            f"--follower-mode={self.follower_mode}",
            f"--step-down-timeout={self.step_down_timeout_s}",
            f"--shutdown-timeout={self.shutdown_timeout_s}",
        ]
        if self.quiet:
            args.append("--quiet")
        if self.fencing:
            args.append("--fencing")
        return args


def candidate_command(
    *,
    lock_name: str | None = None,
    keys: tuple[int, int] | None = None,
    name: str | None = None,
    options: CandidateOptions | None = None,
    prefix: Sequence[str] = (),
) -> list[str]:
    """The argv of a candidate process; put the DSN in its environment as
    [`DSN_ENV`][pgleaderlock.testing.candidate.DSN_ENV].

    Args:
        lock_name: the lock is ``LeaderLock.from_name(lock_name)``...
        keys: ...or ``LeaderLock(dsn, *keys)``; give exactly one of the two.
        name: the candidate's name, shown in its argv (``ps``); the lock does not use it.
        options: the lock's settings; default ``CandidateOptions()``.
        prefix: argv prefix, e.g. ``ip netns exec NAME`` to run it in a network namespace.

    Returns:
        ``[*prefix, sys.executable, "-m", "pgleaderlock.testing.candidate", ...]``.

    Raises:
        ValueError: neither or both of ``lock_name`` and ``keys`` were given.
    """
    if (lock_name is None) == (keys is None):
        raise ValueError("give exactly one of lock_name and keys")
    argv = [*prefix, sys.executable, "-m", MODULE]
    if lock_name is not None:
        argv += ["--lock-name", lock_name]
    if keys is not None:
        argv += [f"--key1={keys[0]}", f"--key2={keys[1]}"]
    if name is not None:
        argv.append(f"--name={name}")
    return argv + (options or CandidateOptions()).argv()


# --------------------------------------------------------------------------- the parent


class CandidateProcess:
    """A [`LeaderLock`][pgleaderlock.LeaderLock] in a child process, observed through its events.

    Args:
        name: the candidate's name in the
            [`BeliefLog`][pgleaderlock.testing.beliefs.BeliefLog] (and in the child's argv).
        dsn: the DSN the child connects to (passed in its environment, not its argv).
        key1: lock key.
        key2: lock key.
        options: the lock's settings.
        beliefs: where to record the child's beliefs (optional).
        prefix: argv prefix, e.g. ``ip netns exec NAME`` to run it in a network namespace.
        stderr: where the child's stderr (its log) goes; default: inherited.
    """

    def __init__(
        self,
        name: str,
        dsn: str,
        key1: int,
        key2: int,
        *,
        options: CandidateOptions | None = None,
        beliefs: BeliefLog | None = None,
        prefix: Sequence[str] = (),
        stderr: int | IO[Any] | None = None,
    ) -> None:
        self.name = name
        self.dsn = dsn
        self.keys = (key1, key2)
        self.options = options or CandidateOptions()
        self.beliefs = beliefs
        self.prefix = list(prefix)
        self._stderr = stderr
        self.events: list[CandidateEvent] = []
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._changed: asyncio.Condition | None = None
        self._killed_at: float | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def backend_pid(self) -> int | None:
        """The backend pid in the child's most recent event."""
        for event in reversed(self.events):
            if event.backend_pid is not None:
                return event.backend_pid
        return None

    @property
    def is_leader(self) -> bool:
        """True if the child's last state event entered LEADER."""
        for event in reversed(self.events):
            if event.event == "state":
                return bool(event.data.get("new") == LockState.LEADER.value)
        return False

    def argv(self) -> list[str]:
        """The child's command line (see
        [`candidate_command`][pgleaderlock.testing.candidate.candidate_command])."""
        return candidate_command(
            keys=self.keys, name=self.name, options=self.options, prefix=self.prefix
        )

    async def start(self, ready_timeout_s: float = 30.0) -> None:
        """Start the child and wait until its lock has started."""
        if self._proc is not None:
            raise RuntimeError("a CandidateProcess starts once")
        self._changed = asyncio.Condition()
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, DSN_ENV: self.dsn},
            start_new_session=True,
        )
        self._reader = asyncio.get_running_loop().create_task(self._read())
        try:
            await self.wait_event("ready", timeout_s=ready_timeout_s)
        except BaseException:
            await self.kill()
            raise

    async def _read(self) -> None:
        assert self._proc is not None
        assert self._proc.stdout is not None
        stdout = self._proc.stdout
        while True:
            line = await stdout.readline()
            if not line:
                break
            event = parse_event(line)
            if event is None:
                continue
            self.events.append(event)
            if self.beliefs is not None:
                self.beliefs.feed(
                    self.name,
                    event.event,
                    event.t,
                    old=event.data.get("old"),
                    new=event.data.get("new"),
                )
            await self._notify()
        await self._proc.wait()
        if self.beliefs is not None:
            # Died (or was killed) while it believed it led: the belief ended with it.
            ended = self._killed_at if self._killed_at is not None else time.monotonic()
            reason = "exited" if self._killed_at is None else "killed"
            self.beliefs.end(self.name, reason, ended)
        await self._notify()

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    def find(
        self,
        event: str,
        *,
        since: float | None = None,
        where: Callable[[CandidateEvent], bool] = lambda e: True,
    ) -> CandidateEvent | None:
        for e in self.events:
            if e.event == event and (since is None or e.t >= since) and where(e):
                return e
        return None

    async def wait_event(
        self,
        event: str,
        *,
        since: float | None = None,
        timeout_s: float = 10.0,
        where: Callable[[CandidateEvent], bool] = lambda e: True,
    ) -> CandidateEvent:
        """The first ``event`` at or after ``since``; waits for it up to ``timeout_s``.

        Raises:
            TimeoutError: it did not come (the message lists the events seen).
            RuntimeError: the child exited first.
        """
        assert self._changed is not None, "start() first"
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                while True:
                    found = self.find(event, since=since, where=where)
                    if found is not None:
                        return found
                    if self._reader is not None and self._reader.done():
                        raise RuntimeError(
                            f"candidate {self.name} exited ({self.returncode}) before "
                            f"{event!r}; events: {self._tail()}"
                        )
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"candidate {self.name}: no {event!r} within {timeout_s} s; events: {self._tail()}"
            ) from None

    def _tail(self, n: int = 12) -> str:
        return ", ".join(
            f"{e.event}{'(' + str(e.data.get('new')) + ')' if e.event == 'state' else ''}"
            for e in self.events[-n:]
        )

    async def send(self, command: Literal["step_down", "shutdown"] | str) -> None:
        """Write a command line to the child's stdin (ignored if it has exited):
        ``step_down``, ``shutdown``, or ``block SECONDS`` (the child blocks its event
        loop with a synchronous sleep, between a ``blocking`` and an ``unblocked``
        event)."""
        if self._proc is None or self._proc.stdin is None or not self.running:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            self._proc.stdin.write(command.encode() + b"\n")
            await self._proc.stdin.drain()

    def signal(self, signum: int) -> None:
        """Send the child ``signum`` (``SIGSTOP`` freezes it, ``SIGCONT`` thaws it);
        ignored if it has exited."""
        if self.running and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    async def kill(self) -> float:
        """SIGKILL the child; return the monotonic time of the kill once it is gone.

        The time is taken just before the signal is sent: the child may die at any
        moment of the call, and a survivor may take over (and say so) before the call
        returns here, so a time taken after it would make the two overlap."""
        proc = self._proc
        at = time.monotonic()
        if proc is not None and proc.returncode is None:
            at = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            self._killed_at = at
        await self._finish()
        return at

    async def stop(self, timeout_s: float = 15.0) -> int | None:
        """Ask the child to shut down; SIGKILL it if it does not exit within ``timeout_s``."""
        proc = self._proc
        if proc is None:
            return None
        if proc.returncode is None:
            await self.send("shutdown")
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                async with asyncio.timeout(timeout_s):
                    await proc.wait()
            except TimeoutError:
                await self.kill()
                return proc.returncode
        await self._finish()
        return proc.returncode

    async def _finish(self) -> None:
        proc = self._proc
        if proc is None:
            return
        await proc.wait()
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        if proc.stdin is not None:
            with contextlib.suppress(Exception):
                await proc.stdin.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if t is None:
            await self.stop()
        else:
            await self.kill()


if __name__ == "__main__":  # pragma: no cover - exercised as a subprocess
    sys.exit(main())
