"""The skeleton of a test's child process (``tests/faults/*_worker.py``,
``tests/frameworks/scheduler_worker.py``): commands on stdin, stopped by ``shutdown``,
by EOF (the parent is gone) or by a signal.

A worker runs by path, so its own folder, not ``tests/``, is on ``sys.path``: it puts
``tests/`` there before it imports ``support``."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable

__all__ = ["stdin_commands", "watch_stdin"]


@contextlib.asynccontextmanager
async def stdin_commands(
    stop: asyncio.Event,
    on_line: Callable[[str], object] | None = None,
    signals: tuple[signal.Signals, ...] = (),
) -> AsyncIterator[None]:
    """While the block runs, stdin is read line by line: ``shutdown`` or EOF sets
    ``stop``, any other line goes to ``on_line``; each of ``signals`` sets ``stop``."""
    loop = asyncio.get_running_loop()
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
    )

    async def read() -> None:
        while not stop.is_set():
            line = (await reader.readline()).decode().strip()
            if line == "shutdown" or not line:
                stop.set()
            elif on_line is not None:
                on_line(line)

    task = loop.create_task(read())
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        transport.close()


def watch_stdin(stop: Callable[[], object]) -> None:
    """Call ``stop`` from a daemon thread when stdin ends (the parent is gone)."""

    def watch() -> None:
        sys.stdin.read()
        stop()

    threading.Thread(target=watch, daemon=True).start()
