"""A server a test starts on 127.0.0.1 in a process of its own (``pgleaderlock
dashboard``, ``manage.py pgleaderlock_dashboard``): a free port to give it (`free_port`)
and its first answer (`first_answer`)."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx

__all__ = ["first_answer", "free_port"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_answer(
    url: str, proc: subprocess.Popen[str] | None = None, within_s: float = 20
) -> httpx.Response:
    """``GET url`` again while nothing listens, until an answer (any status) comes, at
    most ``within_s`` seconds; fails at once, with its stderr, if ``proc`` (the server)
    has exited."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return httpx.get(url, timeout=5)
        except httpx.ConnectError:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(
                    f"the server exited ({proc.returncode}): {proc.communicate()[1]}"
                ) from None
            assert time.monotonic() < deadline, f"{url} never answered"
            time.sleep(0.1)
