"""What a session can learn of its own socket, below the driver: whether the server has
acknowledged every byte sent (a late probe is slow, not lost), and TCP keepalives for a
wait on the server that outlives the calls."""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Iterator

__all__ = ["set_keepalive", "tcp_acknowledged"]

_TCP_INFO_LEN = 104
_UNACKED_OFFSET = 24  # struct tcp_info: 8 bytes of u8 fields, then u32 rto, ato, snd_mss,
# rcv_mss, unacked (Linux include/uapi/linux/tcp.h)


def tcp_acknowledged(fd: int) -> bool | None:
    """Has the peer acknowledged every byte sent on this socket?

    True for a unix socket (there is no network to lose), ``None`` where TCP_INFO is
    not available (not Linux, or not a socket).

    Args:
        fd: the socket's file descriptor (left open).

    Returns:
        Whether the server's kernel has received all we sent.
    """
    with _borrowed(fd) as sock:
        if sock is None:
            return None
        if sock.family == socket.AF_UNIX:
            return True
        tcp_info = getattr(socket, "TCP_INFO", None)
        if tcp_info is None:
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, _TCP_INFO_LEN)
        except OSError:
            return None
        if len(info) < _UNACKED_OFFSET + 4:
            return None
        (unacked,) = struct.unpack_from("I", info, _UNACKED_OFFSET)
        return bool(unacked == 0)


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """The driver's socket ``fd`` as a socket object (None if it is not one), left open
    for the driver, which owns the descriptor."""
    try:
        sock = socket.socket(fileno=fd) if fd >= 0 else None
    except OSError:
        sock = None
    try:
        yield sock
    finally:
        if sock is not None:
            sock.detach()


def set_keepalive(fd: int, idle_s: int, interval_s: int, count: int) -> bool:
    """Turn on TCP keepalives on a socket: a silent peer (a partition, a dead host) is
    noticed after about ``idle_s + interval_s * count`` seconds without traffic.

    Args:
        fd: the socket's file descriptor (left open).

    Returns:
        True once set, and for a unix socket (there is no network to lose); False when
        they cannot be set here (not a socket, or an OS without the options).
    """
    with _borrowed(fd) as sock:
        if sock is None:
            return False
        if sock.family == socket.AF_UNIX:
            return True
        options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
        for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s),
                            ("TCP_KEEPCNT", count)):  # fmt: skip
            option = getattr(socket, name, None)
            if option is None:
                return False
            options.append((socket.IPPROTO_TCP, option, value))
        try:
            for level, option, value in options:
                sock.setsockopt(level, option, value)
        except OSError:
            return False
        return True
