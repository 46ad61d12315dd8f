"""A real Patroni cluster: one etcd, three Patroni nodes on PostgreSQL 15, and HAProxy
routing to the primary by Patroni's REST ``/primary`` check.

Synchronous, like :class:`~support.replication.PrimaryStandby`; from async code call
the slow methods through ``asyncio.to_thread``::

    with PatroniCluster(synchronous=True) as cluster:   # a leader and 2 streaming replicas
        cluster.haproxy_dsn        # postgresql://postgres@127.0.0.1:PORT/postgres
        cluster.multi_host_dsn     # host=a,b,c port=... target_session_attrs=read-write
        old = cluster.leader()     # the primary's member name ("n0")
        cluster.switchover()       # REST /switchover; returns the new primary's name
        cluster.crash_primary()    # SIGKILL of the primary's Patroni and postmaster

Everything runs from the Debian packages (``patroni``, ``etcd-server``, ``haproxy``) on
free 127.0.0.1 ports, with its files in one temp dir under /tmp; as root, Patroni (and
so PostgreSQL) runs as ``postgres`` with that dir handed to it. ``close()`` stops
everything and reaps every process, on every exit path.

Patroni's timing is small for tests: ``ttl`` 6 s, ``loop_wait`` 1 s, ``retry_timeout``
2 s (a crashed primary's leader key expires within ``ttl``; a switchover takes about 2
s). HAProxy checks ``/primary`` every 250 ms (``fall 2 rise 1``), ends the sessions of
a server marked down (``on-marked-down shutdown-sessions``), so no write goes on to a
demoted primary, and does not retry a refused connection (``retries 0``).

``patroni_unavailable_reason()`` says why the tier cannot run (a package missing:
``scripts/test.sh`` installs them with apt-get when run as root and passes on why it
could not in ``PGLEADERLOCK_TEST_PATRONI_MISSING``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

import psycopg

from pgleaderlock.testing.pg_bin import run_as
from pgleaderlock.testing.pg_process import cluster_pids, free_port, pid_alive, reap_cluster
from support.started import Started

__all__ = ["PG_BIN", "PatroniCluster", "patroni_unavailable_reason"]

PG_BIN: Final = Path(
    os.environ.get("PGLEADERLOCK_TEST_PATRONI_PG_BIN", "/usr/lib/postgresql/15/bin")
)
TTL_S: Final = 6
LOOP_WAIT_S: Final = 1
RETRY_TIMEOUT_S: Final = 2
_MISSING_ENV: Final = "PGLEADERLOCK_TEST_PATRONI_MISSING"
_BINARIES: Final = {"patroni": "patroni", "etcd": "etcd-server", "haproxy": "haproxy"}
_START_TIMEOUT_S: Final = 60.0
_HTTP_TIMEOUT_S: Final = 2.0


def _binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for where in ("/usr/sbin", "/usr/bin"):
        if os.access(f"{where}/{name}", os.X_OK):
            return f"{where}/{name}"
    return None


def patroni_unavailable_reason() -> str | None:
    """Why the HA tier cannot run here, or None."""
    missing = [package for name, package in _BINARIES.items() if _binary(name) is None]
    if not (PG_BIN / "postgres").exists():
        missing.append(f"PostgreSQL 15 ({PG_BIN})")
    if not missing:
        return None
    why = os.environ.get(_MISSING_ENV, "").strip()
    return (
        f"{', '.join(missing)} not installed" + (f": {why}" if why else "")
        + "; scripts/test.sh installs the Debian packages with apt-get when run as root"
    )  # fmt: skip


def _http(
    url: str, body: dict[str, Any] | None = None, timeout_s: float = _HTTP_TIMEOUT_S
) -> tuple[int, str]:
    """GET (or POST ``body`` as JSON) ``url``: the status and the text, bounded."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _until(condition: Any, timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            value = condition()
            if value:
                return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)


class Node:
    """One Patroni member: its REST and PostgreSQL ports, data dir and process."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.pg_port = free_port()
        self.rest_port = free_port()
        self.data_dir = root / name
        self.config = root / f"{name}.yml"
        self.log = root / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def rest(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.pg_port}/postgres"

    def postmaster_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        return None


class PatroniCluster(Started):
    """etcd, three Patroni nodes and HAProxy (see the module docstring).

    Args:
        synchronous: Patroni's ``synchronous_mode`` (one synchronous standby; with it a
            commit is acknowledged once a standby has it).
        nodes: How many Patroni members.
    """

    def __init__(self, *, synchronous: bool = True, nodes: int = 3) -> None:
        self.synchronous = synchronous
        self._count = nodes
        self._root: Path | None = None
        self._run_as: list[str] = []
        self.nodes: list[Node] = []
        self._etcd: subprocess.Popen[bytes] | None = None
        self._haproxy: subprocess.Popen[bytes] | None = None
        self.haproxy_port = 0
        self.scope = f"pgl{os.getpid()}x{int(time.monotonic() * 1000) % 100000}"
        self.setup_s: float | None = None

    # ------------------------------------------------------------------ addresses

    @property
    def haproxy_dsn(self) -> str:
        """The primary through HAProxy."""
        return f"postgresql://postgres@127.0.0.1:{self.haproxy_port}/postgres"

    @property
    def multi_host_dsn(self) -> str:
        """Every node, ``target_session_attrs=read-write`` (a libpq key/value DSN)."""
        hosts = ",".join("127.0.0.1" for _ in self.nodes)
        ports = ",".join(str(n.pg_port) for n in self.nodes)
        return (
            f"host={hosts} port={ports} user=postgres dbname=postgres "
            "target_session_attrs=read-write"
        )

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """etcd, the nodes (the first bootstraps), HAProxy; returns once the leader and
        every replica stream (and a synchronous standby is chosen, when synchronous) and
        HAProxy routes to the leader. Nothing is left behind on an error."""
        if self._root is not None:
            raise RuntimeError("PatroniCluster is already started")
        began = time.monotonic()
        try:
            self._root = Path(tempfile.mkdtemp(prefix="pgl-patroni-"))
            self._run_as, _ = run_as(self._root)
            self._start_etcd()
            self.nodes = [Node(f"n{i}", self._root) for i in range(self._count)]
            for node in self.nodes:
                self._write_config(node)
            self._launch(self.nodes[0])
            _until(lambda: self.leader() == "n0", _START_TIMEOUT_S, self._why("n0 leads"))
            for node in self.nodes[1:]:
                self._launch(node)
            self.wait_healthy()
            self._start_haproxy()
            time.sleep(1.0)  # its first checks
            _until(self._haproxy_routes, 20.0, "HAProxy routes to the leader")
        except BaseException:
            self.close()
            raise
        self.setup_s = time.monotonic() - began

    def close(self) -> None:
        """Stop HAProxy, kill the nodes (SIGKILL: Patroni, then every PostgreSQL process
        of its data dir), stop etcd; delete the temp dir. Safe to call repeatedly."""
        for proc in (self._haproxy,):
            self._end(proc)
        self._haproxy = None
        for node in self.nodes:  # throwaway: no clean shutdown, just every process gone
            if node.proc is not None:
                with contextlib.suppress(OSError):
                    os.killpg(node.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.proc.wait(5.0)
            data = node.data_dir
            reap_cluster(lambda d=data: cluster_pids(d, None), None)  # type: ignore[misc]
        self._end(self._etcd)
        self._etcd = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
        self._root = None

    @staticmethod
    def _end(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5.0)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # what it left in its group

    def _why(self, what: str) -> str:
        tails = []
        for node in self.nodes:
            with contextlib.suppress(OSError):
                tails.append(f"--- {node.log}\n" + node.log.read_text()[-1500:])
        return what + "\n" + "\n".join(tails)

    def _spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                argv,
                cwd=self._root,
                env={k: v for k, v in os.environ.items() if not k.startswith("PG")},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _start_etcd(self) -> None:
        assert self._root is not None
        self.etcd_port, peer = free_port(), free_port()
        client, peer_url = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer}"
        etcd = _binary("etcd")
        assert etcd is not None
        self._etcd = self._spawn(
            [*self._run_as, etcd, "--name", "e0", "--data-dir", str(self._root / "etcd"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"e0={peer_url}", "--log-level", "warn"],
            self._root / "etcd.log",
        )  # fmt: skip
        _until(lambda: _http(f"{client}/health")[0] == 200, 20.0, "etcd healthy")

    def _write_config(self, node: Node) -> None:
        assert self._root is not None
        config = {
            "scope": self.scope,
            "name": node.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{node.rest_port}",
                "connect_address": f"127.0.0.1:{node.rest_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL_S,
                    "loop_wait": LOOP_WAIT_S,
                    "retry_timeout": RETRY_TIMEOUT_S,
                    "maximum_lag_on_failover": 16 * 1024 * 1024,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "max_connections": 100,
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "128MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.pg_port}",
                "connect_address": f"127.0.0.1:{node.pg_port}",
                "data_dir": str(node.data_dir),
                "bin_dir": str(PG_BIN),
                "pgpass": str(self._root / f"{node.name}.pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                    "rewind": {"username": "postgres"},
                },
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "parameters": {
                    "unix_socket_directories": str(self._root),
                    "fsync": "off",
                    "full_page_writes": "off",
                },
            },
            "tags": {"nofailover": False, "noloadbalance": False},
        }
        # JSON is YAML.
        node.config.write_text(json.dumps(config, indent=1))
        if self._run_as:
            shutil.chown(node.config, "postgres")

    def _launch(self, node: Node) -> None:
        patroni = _binary("patroni")
        assert patroni is not None
        node.proc = self._spawn([*self._run_as, patroni, str(node.config)], node.log)

    def _start_haproxy(self) -> None:
        assert self._root is not None
        self.haproxy_port = free_port()
        servers = "\n".join(
            f"    server {n.name} 127.0.0.1:{n.pg_port} check port {n.rest_port}"
            for n in self.nodes
        )
        config = self._root / "haproxy.cfg"
        config.write_text(HAPROXY_CONFIG.format(port=self.haproxy_port, servers=servers))
        haproxy = _binary("haproxy")
        assert haproxy is not None
        self._haproxy = self._spawn([haproxy, "-db", "-f", str(config)], self._root / "haproxy.log")

    def _haproxy_routes(self) -> bool:
        """Six connections in a row land on the primary (HAProxy starts every server UP
        until its checks say otherwise)."""
        for _ in range(6):
            with psycopg.connect(self.haproxy_dsn, connect_timeout=2, autocommit=True) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
                if row is None or row[0] is not False:
                    return False
        return True

    # ------------------------------------------------------------------ state

    def members(self) -> list[dict[str, Any]]:
        """Patroni's ``/cluster`` members, from the first node that answers."""
        for node in self.nodes:
            with contextlib.suppress(OSError, ValueError):
                status, text = _http(f"{node.rest}/cluster")
                if status == 200:
                    members: list[dict[str, Any]] = json.loads(text)["members"]
                    return members
        return []

    def leader(self) -> str | None:
        """The member Patroni calls leader (running), or None."""
        for member in self.members():
            if member["role"] == "leader" and member["state"] == "running":
                return str(member["name"])
        return None

    def _healthy(self) -> bool:
        members = self.members()
        alive = {n.name for n in self.nodes if n.proc is not None and n.proc.poll() is None}
        members = [m for m in members if m["name"] in alive]  # a crashed one lingers
        if len(members) < len(alive):
            return False
        roles = sorted(m["role"] for m in members)
        want_sync = "sync_standby" in roles or not self.synchronous or len(alive) == 1
        streaming = all(
            m["state"] in ("running", "streaming") for m in members if m["role"] != "leader"
        )
        return roles.count("leader") == 1 and want_sync and streaming

    def wait_healthy(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Wait for one leader and every live member running (and a synchronous standby
        when synchronous and there is another member)."""
        _until(self._healthy, timeout_s, self._why("the cluster healthy"), poll_s=0.1)

    def primary_writable(self, name: str) -> bool:
        """``name``'s PostgreSQL accepts a connection and is not in recovery."""
        try:
            with psycopg.connect(self.node(name).dsn, connect_timeout=1, autocommit=True) as c:
                row = c.execute("SELECT pg_is_in_recovery()").fetchone()
                return row is not None and row[0] is False
        except psycopg.Error:
            return False

    # ------------------------------------------------------------------ events

    def switchover(self, candidate: str | None = None, timeout_s: float = 30.0) -> str:
        """A switchover through the leader's REST ``/switchover``; the new primary, once
        Patroni reports it leading."""
        old = self.leader()
        assert old is not None, "no leader to switch over from"
        body: dict[str, Any] = {"leader": old}
        if candidate is not None:
            body["candidate"] = candidate
        # Patroni answers once the switchover is done (or failed).
        status, text = _http(f"{self.node(old).rest}/switchover", body, timeout_s)
        if status not in (200, 503):  # 503: "status unknown", it may still happen
            raise RuntimeError(f"switchover refused: {status} {text}")
        new: str = _until(
            lambda: (lambda l: l if l not in (None, old) else None)(self.leader()),
            timeout_s, "a new leader after the switchover",
        )  # fmt: skip
        return new

    def crash_primary(self) -> str:
        """SIGKILL the primary's Patroni, then its postmaster and backends; the old
        primary's name. It stays down (a crashed machine)."""
        old = self.leader()
        assert old is not None, "no leader to crash"
        node = self.node(old)
        assert node.proc is not None
        with contextlib.suppress(OSError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait(5.0)
        pid = node.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        reap_cluster(lambda: cluster_pids(node.data_dir, None), None)
        return old

    def freeze_replication(self) -> list[int]:
        """SIGSTOP the primary's WAL senders: nothing more leaves it (a standby's own
        receiver would still drain its socket's buffers later). With synchronous mode
        commits wait; without, they are acknowledged and only the primary has them. Their
        pids, for `thaw` (a crash of the primary ends them anyway)."""
        leader = self.leader()
        assert leader is not None, "no primary"
        with psycopg.connect(self.node(leader).dsn, connect_timeout=2, autocommit=True) as conn:
            rows = conn.execute("SELECT pid FROM pg_stat_replication").fetchall()
        pids = [int(pid) for (pid,) in rows]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    @staticmethod
    def thaw(pids: list[int]) -> None:
        for pid in pids:
            if pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGCONT)

    def rejoin(self, name: str, timeout_s: float = 60.0) -> None:
        """Start a crashed member's Patroni again; wait until the cluster is healthy."""
        self._launch(self.node(name))
        self.wait_healthy(timeout_s)


HAPROXY_CONFIG: Final = """\
global
    maxconn 500

defaults
    mode tcp
    timeout connect 2s
    # A connection the server refuses fails at once (HAProxy's default is 3 retries, 1 s
    # apart): the client tries again on its own cadence, possibly on the new primary.
    retries 0
    timeout client 30m
    timeout server 30m
    timeout check 1s

listen primary
    bind 127.0.0.1:{port}
    balance first
    option httpchk
    http-check send meth GET uri /primary
    http-check expect status 200
    default-server inter 250ms fastinter 250ms downinter 250ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
"""
