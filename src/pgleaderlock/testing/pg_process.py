"""A throwaway cluster's processes, seen from outside: a free port, whether a process
lives, whether the server accepts connections (a startup packet, no driver), and its
leftover processes, found and killed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["cluster_pids", "free_port", "pid_alive", "ping", "reap_cluster"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def pid_state(pid: int) -> str | None:
    """Return the /proc state letter of ``pid``, or None if it does not exist."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return "?"
    # "pid (comm) S ..." -- comm may contain spaces and parentheses.
    return data.rsplit(")", 1)[-1].split()[0]


def pid_alive(pid: int) -> bool:
    if Path("/proc").is_dir():
        state = pid_state(pid)
        return state is not None and state not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ping(address: str | tuple[str, int], timeout_s: float = 1.0) -> bool:
    """Speak just enough of the protocol to tell if the server accepts connections.

    Returns True once the server answers a startup packet with anything but
    ``57P03 cannot_connect_now`` (an authentication error still means "up").
    """
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    if isinstance(address, tuple) and ":" in address[0]:
        family = socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(address)
            params = b"user\x00postgres\x00database\x00postgres\x00\x00"
            sock.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
            head = b""
            while len(head) < 5:
                chunk = sock.recv(5 - len(head))
                if not chunk:
                    return False
                head += chunk
            kind, length = head[:1], struct.unpack("!i", head[1:])[0]
            if kind == b"E":
                body = b""
                while len(body) < length - 4:
                    chunk = sock.recv(length - 4 - len(body))
                    if not chunk:
                        break
                    body += chunk
                return b"C57P03\x00" not in body
            with contextlib.suppress(OSError):
                sock.sendall(b"X\x00\x00\x00\x04")
            return kind == b"R"
    except OSError:
        return False


def cluster_pids(data_dir: Path | None, pgid: int | None) -> list[int]:
    """Live processes belonging to a cluster (process group ``pgid``, the postmaster's,
    or cwd = ``data_dir``); none without a data directory."""
    proc_root = Path("/proc")
    if data_dir is None or not proc_root.is_dir():
        return []
    data = os.path.realpath(data_dir)
    found: list[int] = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid == os.getpid() or not pid_alive(pid):
            continue
        try:
            if pgid is not None and os.getpgid(pid) == pgid:
                found.append(pid)
                continue
            if os.readlink(entry / "cwd") == data:
                found.append(pid)
        except OSError:
            continue
    return found


def reap_cluster(scan: Callable[[], list[int]], pgid: int | None, timeout_s: float = 5.0) -> None:
    """Kill leftover processes of a cluster (``scan()`` finds them; process group
    ``pgid`` first) and wait until they are gone.

    Every pid seen once is followed until it is gone or a zombie: a process that is
    still exiting may briefly be missed by the scan.
    """
    if pgid is not None:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    quiet_scans = 0
    while quiet_scans < 2:
        seen.update(scan())
        alive = [pid for pid in seen if pid_alive(pid)]
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        quiet_scans = 0 if alive else quiet_scans + 1
        if alive and time.monotonic() > deadline:
            raise RuntimeError(f"could not kill leftover PostgreSQL processes {alive}")
        time.sleep(0.01)
