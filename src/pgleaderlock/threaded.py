"""The sync path: a [`LeaderLock`][pgleaderlock.LeaderLock] in its own thread (no extra needed).

[`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock] runs a lock on an event loop in a
dedicated thread, for code without an event loop: Flask or Django apps, scripts,
``BackgroundScheduler`` jobs, any threaded code that asks "am I the leader?". With
``Fencing(enabled=True)`` it also fences the caller's transactions on synchronous psycopg
connections ([`fence`][pgleaderlock.ThreadedLeaderLock.fence]).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from typing import Self

from .lowlevel import (
    ConfigurationError,
    LeaderLock,
    Leadership,
    LockState,
    ShutdownError,
    not_negative,
    positive,
)

__all__ = ["ThreadedLeaderLock"]


class ThreadedLeaderLock:
    """Runs a [`LeaderLock`][pgleaderlock.LeaderLock] on its own event loop in a dedicated thread.

    For code without an event loop: a Flask or Django app, a script, ``BackgroundScheduler``
    jobs. The lock's callbacks and plugins run in that thread.
    [`is_leader`][pgleaderlock.ThreadedLeaderLock.is_leader],
    [`state`][pgleaderlock.ThreadedLeaderLock.state] and
    [`term`][pgleaderlock.ThreadedLeaderLock.term] may be read from any thread (each is
    one attribute read), and [`fence`][pgleaderlock.ThreadedLeaderLock.fence] called
    from any thread; [`start`][pgleaderlock.ThreadedLeaderLock.start],
    [`shutdown`][pgleaderlock.ThreadedLeaderLock.shutdown],
    [`step_down`][pgleaderlock.ThreadedLeaderLock.step_down] and
    [`wait_for_leadership`][pgleaderlock.ThreadedLeaderLock.wait_for_leadership] block the
    calling thread.

    Args:
        lock: a lock that is not started yet, made with its options (a
            [`LockOptions`][pgleaderlock.LockOptions], as any lock); this object starts
            and shuts it down.
        start_timeout_s: how long [`start`][pgleaderlock.ThreadedLeaderLock.start] waits for
            the thread's loop to start the lock.

    Example:

    ```python
    fenced = LockOptions(fencing=Fencing(enabled=True))
    lock = ThreadedLeaderLock(LeaderLock.from_name("reports", dsn=DSN, options=fenced))
    with lock:                      # start(), and shutdown() on exit
        scheduler = BackgroundScheduler()
        bind_scheduler(scheduler, lock)
        ...
    ```
    """

    def __init__(self, lock: LeaderLock, *, start_timeout_s: float = 30.0) -> None:
        if not isinstance(lock, LeaderLock):
            raise ConfigurationError(f"ThreadedLeaderLock needs a LeaderLock, got {lock!r}")
        self._lock = lock
        self._start_timeout_s = positive("start_timeout_s", start_timeout_s)
        self._mutex = threading.Lock()
        # Callers blocked in wait_for_leadership(): released when the thread ends, even
        # if the loop closed before their coroutine could run.
        self._waiting: set[concurrent.futures.Future[bool]] = set()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_timeout_s: float | None = None
        self._error: BaseException | None = None

    # ------------------------------------------------------------------ properties

    @property
    def lock(self) -> LeaderLock:
        """The wrapped lock. Call its coroutines only on
        [`loop`][pgleaderlock.ThreadedLeaderLock.loop]."""
        return self._lock

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The lock thread's event loop while running, else ``None``."""
        return self._loop

    @property
    def running(self) -> bool:
        """True between [`start`][pgleaderlock.ThreadedLeaderLock.start] and the end of
        [`shutdown`][pgleaderlock.ThreadedLeaderLock.shutdown]."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def is_leader(self) -> bool:
        """True while the lock is LEADER (thread-safe)."""
        return self._lock.is_leader

    @property
    def state(self) -> LockState:
        """The lock's state (thread-safe)."""
        return self._lock.state

    @property
    def draining(self) -> bool:
        """True while a graceful stop lets leader work finish its current unit (the
        lock's ``drain_s``; thread-safe): see
        [`LeaderLock.draining`][pgleaderlock.LeaderLock.draining]."""
        return self._lock.draining

    @property
    def leader_since(self) -> float | None:
        """``time.time()`` when the current leadership began, or ``None``."""
        return self._lock.leader_since

    @property
    def name(self) -> str | None:
        """The lock's name."""
        return self._lock.name

    @property
    def term(self) -> int | None:
        """With ``Fencing(enabled=True)``: the fencing term of the current leadership, as
        [`LeaderLock.term`][pgleaderlock.LeaderLock.term]; ``None`` when not LEADER or
        without fencing (thread-safe).

        A value read here may be outdated by the time it is used, like
        [`is_leader`][pgleaderlock.ThreadedLeaderLock.is_leader]: only
        [`fence`][pgleaderlock.ThreadedLeaderLock.fence] inside a transaction says
        whether that transaction may still commit under it.
        """
        return self._lock.term

    # ------------------------------------------------------------------ fencing

    def leadership(self, *, term: int | None = None) -> Leadership:
        """The leadership the calling thread works under (thread-safe): as
        [`LeaderLock.leadership`][pgleaderlock.LeaderLock.leadership]. Bind it to a
        unit of work with ``with``, so that the unit's fences are refused once that
        leadership has ended, even if the lock leads again by then:

        ```python
        with lock.leadership():              # this thread's work: the current term
            rows = read_batch()
            with conn.transaction():
                lock.fence(conn)             # FencedError once that term has ended
                write(conn, rows)
        ```

        A thread started inside the block does not inherit it, unless it runs in a
        copy of the context (``contextvars.copy_context().run``); the APScheduler
        helpers bind each run's leadership themselves.

        Raises:
            FencedError: no leadership is bound and the lock is not LEADER.
            ConfigurationError: the lock has no fencing.
        """
        return self._lock.leadership(term=term)

    def fence(self, conn: object, *, term: int | None = None) -> int:
        """Fence the caller's transaction on a synchronous psycopg ``Connection``: call
        it inside the transaction, first (before its writes, and before the reads they
        depend on); the transaction may commit only if this returns. Any thread may
        call it; it blocks that thread for one round trip on ``conn`` (longer while a
        new leader's term bump holds the row). It calls
        [`LeaderLock.fence_sync`][pgleaderlock.LeaderLock.fence_sync].

        It fences with the term of the leadership the calling thread works under (a
        ``with lock.leadership():`` block, an APScheduler helper's run; else the lock's
        current term), or with ``term``. The server checks that the lock's term row still
        holds it, and keeps a shared lock on the row until the transaction ends, so
        the next leader's term bump waits for this transaction: a transaction fenced
        here under term *t* that commits is ordered before every transaction fenced
        under a later term. See the Fencing page of the documentation.

        ```python
        with conn.transaction():
            term = lock.fence(conn)      # FencedError: roll back, do not retry as is
            conn.execute("INSERT INTO sink ...")
        ```

        Avoid calling it from the lock's own callbacks: it would block the lock's event
        loop for the round trip (await ``lock.lock.fence(aconn)`` on an async
        connection there).

        Args:
            conn: a psycopg ``Connection`` inside a transaction (``with
                conn.transaction():``, or a connection not in autocommit mode).
            term: fence with this term (one handed on from where the work began).

        Returns:
            The term the transaction runs under.

        Raises:
            FencedError: the leadership the work runs under has ended (this lock is not
                LEADER, or leads under another term, or the term has moved on): roll
                back.
            ConfigurationError: the lock has no fencing, or ``conn`` is not in a
                transaction, or not a synchronous psycopg connection.
        """
        return self._lock.fence_sync(conn, term=term)

    @contextlib.contextmanager
    def fenced(self, conn: object, *, term: int | None = None) -> Iterator[int]:
        """``with lock.fenced(conn) as term:``:
        [`fence`][pgleaderlock.ThreadedLeaderLock.fence] on entry; the caller's
        transaction then commits or rolls back as usual."""
        yield self.fence(conn, term=term)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the thread and, in it, the lock. Idempotent.

        Returns once the lock has started (as ``LeaderLock.start()``: acquisition goes
        on in the background).

        After [`shutdown`][pgleaderlock.ThreadedLeaderLock.shutdown] it may be started
        again, on a new thread and event loop.

        Raises:
            TimeoutError: the thread did not start the lock within ``start_timeout_s``.
        """
        with self._mutex:
            if self.running:
                return
            ready = threading.Event()
            self._error = None
            self._thread = threading.Thread(
                target=self._main,
                args=(ready,),
                name=f"pgleaderlock:{self._lock.label}",
                daemon=True,
            )
            self._thread.start()
        if not ready.wait(self._start_timeout_s):
            raise TimeoutError(f"the lock thread did not start within {self._start_timeout_s} s")
        if self._error is not None:
            self._join()
            raise self._error

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Shut the lock down (releasing it), stop the loop and join the thread.
        Idempotent.

        Args:
            timeout_s: as for ``LeaderLock.shutdown()``.

        Raises:
            ShutdownError: as ``LeaderLock.shutdown()``; the thread has ended anyway.
            RuntimeError: when called from the lock's own thread (a callback): await
                ``lock.shutdown()`` there instead.
        """
        with self._mutex:
            thread, loop, stop = self._thread, self._loop, self._stop
            if thread is None:
                return
            if threading.current_thread() is thread:
                raise RuntimeError(
                    "ThreadedLeaderLock.shutdown() was called from the lock's own thread; "
                    "await lock.shutdown() there instead"
                )
            self._stop_timeout_s = timeout_s
            if loop is not None and stop is not None:
                with contextlib.suppress(RuntimeError):  # the loop has already closed
                    loop.call_soon_threadsafe(stop.set)
        self._join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def step_down(self, timeout_s: float | None = None) -> None:
        """``LeaderLock.step_down()`` on the lock's loop; blocks until it returns."""
        loop = self._loop
        if loop is None or not self.running:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("step_down() from the lock's own thread: await it there")
        asyncio.run_coroutine_threadsafe(self._lock.step_down(timeout_s), loop).result()

    def wait_for_leadership(self, timeout_s: float | None = None) -> bool:
        """Block until the lock is LEADER and its
        [`on_acquired`][pgleaderlock.LeaderLock.on_acquired] callbacks have run, as
        [`LeaderLock.wait_for_leadership`][pgleaderlock.LeaderLock.wait_for_leadership]
        (which it runs on the lock's loop).

        Returns:
            True once LEADER; False after ``timeout_s``, or when the lock is not running
                (or stops while waiting).

        Raises:
            PgLeaderLockError: as ``LeaderLock.wait_for_leadership()``: the lock stopped
                on an error that retrying cannot mend.
            RuntimeError: when called from the lock's own thread (a callback).
        """
        timeout_s = None if timeout_s is None else not_negative("timeout_s", timeout_s)
        loop = self._loop
        if loop is None or not self.running:
            return False
        if threading.current_thread() is self._thread:
            raise RuntimeError("wait_for_leadership() from the lock's own thread: await it there")
        with self._mutex:
            if self._loop is not loop:
                return False  # the thread ended meanwhile
            try:
                waiting = asyncio.run_coroutine_threadsafe(
                    self._lock.wait_for_leadership(timeout_s), loop
                )
            except RuntimeError:  # the loop is closing
                return False
            self._waiting.add(waiting)
        try:
            return waiting.result()
        except concurrent.futures.CancelledError:  # the thread ended first (_main)
            return False
        finally:
            with self._mutex:
                self._waiting.discard(waiting)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<ThreadedLeaderLock {self._lock!r} running={self.running}>"

    # ------------------------------------------------------------------ the thread

    def _join(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._mutex:
            self._thread = None

    def _main(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._serve(ready))
        except BaseException as exc:  # pragma: no cover - asyncio.run itself failed
            self._error = exc
        finally:
            with self._mutex:
                self._loop = self._stop = None
                waiting = list(self._waiting)
            for future in waiting:
                future.cancel()
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        stop = self._stop = asyncio.Event()
        try:
            await self._lock.start()
        except Exception as exc:
            self._error = exc
            ready.set()
            return
        ready.set()
        await stop.wait()
        try:
            await self._lock.shutdown(timeout_s=self._stop_timeout_s)
        except ShutdownError as exc:
            self._error = exc
