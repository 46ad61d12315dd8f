"""A network namespace behind a veth link, cut silently like a real partition. Root only.

:class:`NetnsLink` puts a network namespace behind a veth pair on a private /30 of the
benchmarking range 198.18.0.0/15, so a process inside (``link.exec_prefix()``) can be cut
off *silently* (``ip link set HOSTEND down``: no FIN, no RST).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
import sys
from typing import Final

from support.started import Started

__all__ = ["NetnsLink", "NetnsUnavailableError", "netns_unavailable_reason"]


class NetnsUnavailableError(RuntimeError):
    """Network namespaces cannot be used here (not root, no ``ip``, no permission)."""


def netns_unavailable_reason() -> str | None:
    """Why :class:`NetnsLink` cannot work here, or None if it should."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


_TEST_RANGE: Final = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544: benchmarking only
_BLACKHOLE_METRIC: Final = 4242
_IP_TIMEOUT_S: Final = 10.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    ip = shutil.which("ip") or "ip"
    result = subprocess.run(
        [ip, *args],
        capture_output=True,
        text=True,
        timeout=_IP_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if check and result.returncode != 0:
        raise NetnsUnavailableError(
            f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}"
        )
    return result


def _networks_in_use() -> list[ipaddress.IPv4Network]:
    found: list[ipaddress.IPv4Network] = []
    text = _ip("-o", "-4", "addr", "show", check=False).stdout
    text += "\n" + _ip("-4", "route", "show", "table", "all", check=False).stdout
    for token in text.split():
        with contextlib.suppress(ValueError):
            found.append(ipaddress.IPv4Network(token, strict=False))
    return [n for n in found if n.overlaps(_TEST_RANGE)]


class NetnsLink(Started):
    """A network namespace joined to the host by a veth pair on a private /30.

    ``host_addr`` (on the host end) and ``ns_addr`` (inside the namespace) are the two
    usable addresses of a random /30 of 198.18.0.0/15, which is reserved for network
    benchmark tests. A blackhole route for the /30 (behind the link's own route) keeps
    traffic for ``ns_addr`` on this host while the link is cut, instead of following the
    default route. Names are unique to the process, so parallel runs do not collide.

    Use as a context manager; :meth:`close` removes the link, the namespace and the route,
    even after a failure. Kill processes running inside the namespace first.

    Raises:
        NetnsUnavailableError: on entering, when the namespace cannot be created.
    """

    def __init__(self, tag: str | None = None) -> None:
        token = tag or f"{os.getpid() & 0xFFFF:04x}{random.getrandbits(16):04x}"
        self.name = f"pgll-{token}"
        self.host_if = f"pgll{token}h"[:15]
        self.ns_if = f"pgll{token}n"[:15]
        self.subnet: ipaddress.IPv4Network | None = None
        self._created: list[str] = []

    @property
    def host_addr(self) -> str:
        assert self.subnet is not None, "start() first"
        return str(self.subnet.network_address + 1)

    @property
    def ns_addr(self) -> str:
        assert self.subnet is not None, "start() first"
        return str(self.subnet.network_address + 2)

    def exec_prefix(self) -> list[str]:
        """argv prefix that runs a command inside the namespace."""
        return [shutil.which("ip") or "ip", "netns", "exec", self.name]

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _networks_in_use()
        rng = random.Random()
        for _ in range(50):
            offset = rng.randrange(0, _TEST_RANGE.num_addresses // 4) * 4
            candidate = ipaddress.IPv4Network(f"{_TEST_RANGE.network_address + offset}/30")
            if not any(candidate.overlaps(n) for n in used):
                return candidate
        raise NetnsUnavailableError("no free /30 in 198.18.0.0/15")  # pragma: no cover

    def start(self) -> None:
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsUnavailableError(reason)
        try:
            _ip("netns", "add", self.name)
            self._created.append("netns")
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._created.append("link")
            _ip("link", "set", self.ns_if, "netns", self.name)
            self.subnet = self._pick_subnet()
            _ip("route", "add", "blackhole", str(self.subnet), "metric", str(_BLACKHOLE_METRIC))
            self._created.append("route")
            _ip("addr", "add", f"{self.host_addr}/30", "dev", self.host_if)
            inside = ["netns", "exec", self.name, shutil.which("ip") or "ip"]
            _ip(*inside, "addr", "add", f"{self.ns_addr}/30", "dev", self.ns_if)
            _ip(*inside, "link", "set", "lo", "up")
            _ip(*inside, "link", "set", self.ns_if, "up")
            _ip("link", "set", self.host_if, "up")
        except BaseException:
            self.close()
            raise

    def cut(self) -> None:
        """Cut the link silently: the host end goes down (no FIN, no RST)."""
        _ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        """Bring the host end back up."""
        _ip("link", "set", self.host_if, "up")

    def close(self) -> None:
        """Remove everything that :meth:`start` created. Safe to call repeatedly."""
        errors: list[str] = []
        if "link" in self._created:
            result = _ip("link", "del", self.host_if, check=False)
            if result.returncode != 0 and "Cannot find" not in result.stderr:
                errors.append(result.stderr.strip())
        if "netns" in self._created:
            result = _ip("netns", "del", self.name, check=False)
            if result.returncode != 0:
                errors.append(result.stderr.strip())
        if "route" in self._created and self.subnet is not None:
            _ip(
                "route",
                "del",
                "blackhole",
                str(self.subnet),
                "metric",
                str(_BLACKHOLE_METRIC),
                check=False,
            )
        self._created.clear()
        if errors:
            raise RuntimeError("NetnsLink cleanup: " + "; ".join(errors))

    def __repr__(self) -> str:
        return f"<NetnsLink {self.name} {self.host_if}={self.subnet}>"
