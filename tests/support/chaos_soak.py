"""The chaos soak's harness: a throwaway cluster, N replica processes
(``chaos_replica.py``: every feature at once), random faults for a while, a quiet tail,
a graceful stop, and the record of it all. ``chaos_check.check`` judges the record.

Faults, drawn from rounds of ``FAULT_DECK`` (every kind once first, then the rest, each
part shuffled: their counts stay in proportion, and a short run sees every kind) at
random intervals, from a seeded ``random.Random``:

- ``kill``: SIGKILL of a replica (the lock's leader half of the time), restarted at once;
- ``kill2``: two replicas SIGKILLed at once, both restarted;
- ``term``: SIGTERM (a graceful stop); restarted once it has exited (SIGKILLed after
  ``term_wait_s``: recorded as ``term_hung``);
- ``stop``: SIGSTOP for ``stop_s`` seconds, then SIGCONT (one frozen replica at most);
- ``terminate``: ``pg_terminate_backend`` of a lock's session: the lock's leader, a
  semaphore holder, or the holder of one of the coordinator's names;
- ``pg_fast`` / ``pg_immediate``: the server stopped in that mode and started again.

What it records, in ``out/``: ``harness.jsonl`` (``spawn``, ``fault``, ``cont``,
``exited``, ``term_hung``, ``server_up``, ``holder``: who holds the lock and the
semaphore's slots, sampled from ``pg_locks`` on every tick and written when it changes;
``sessions``: ``pg_stat_activity`` before and after the graceful stop, the sessions two
looks 3 s apart agree on; ``phase``), each
replica's own ``<cand>.jsonl`` and ``<cand>.err`` (its stderr: ``faulthandler``'s
traces), and ``db.json``: every fenced row with its commit time, every term bump with
its commit time (a trigger on the terms table copies each into ``chaos.term_history``;
``track_commit_timestamp`` is on), the schedule ledger and the checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg

from pgleaderlock import lock_keys, slot_keys
from pgleaderlock.cli.sql import setup_sql
from pgleaderlock.core.keys import key_to_oid
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.chaos_replica import DSN_ENV, GROUP, JOB, LOCK_NAME, SEM_NAME, SEM_SLOTS, name_of

__all__ = ["FAULT_DECK", "Soak", "SoakConfig"]

REPLICA = Path(__file__).with_name("chaos_replica.py")
FAULT_DECK = (
    *("kill",) * 3, *("term",) * 2, *("stop",) * 2, *("terminate",) * 3,
    "kill2", "pg_fast", "pg_immediate",
)  # fmt: skip
"""One round of faults: each kind once, in a random order, then the others shuffled."""
HARNESS = "harness"
TICK_S = 0.1

SETUP = """
CREATE SCHEMA chaos;
CREATE TABLE chaos.rows (kind text NOT NULL, key1 int4 NOT NULL, key2 int4 NOT NULL,
    term int8 NOT NULL, began int8 NOT NULL, cand text NOT NULL, item text NOT NULL,
    position int8);
CREATE TABLE chaos.term_history (key1 int4 NOT NULL, key2 int4 NOT NULL, term int8 NOT NULL,
    holder text);
CREATE FUNCTION chaos.record_term() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.term_history VALUES (NEW.key1, NEW.key2, NEW.term, NEW.holder);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_term_history AFTER INSERT OR UPDATE ON public.pgleaderlock_terms
    FOR EACH ROW EXECUTE FUNCTION chaos.record_term();
"""
HOLDERS = (
    "SELECT a.application_name, l.classid::int8, l.objid::int8, l.pid"
    " FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
)
SESSIONS = (
    "SELECT application_name, pid FROM pg_catalog.pg_stat_activity"
    " WHERE backend_type = 'client backend' AND pid <> pg_catalog.pg_backend_pid()"
)
COMMITTED = "extract(epoch FROM pg_catalog.pg_xact_commit_timestamp(xmin))::float8"


@dataclass(frozen=True)
class SoakConfig:
    """How long, how many replicas, which faults how often."""

    seconds: float = 120.0
    """The whole run: faults, then ``tail_s`` without any."""
    replicas: int = 4
    seed: int = 0
    names: int = 16
    period_s: float = 2.0
    fault_every_s: tuple[float, float] = (2.0, 9.0)
    stop_s: tuple[float, float] = (12.0, 20.0)
    tail_s: float = 20.0
    term_wait_s: float = 30.0
    max_connections: int = 400
    watchdog: bool = False
    """Replicas dump their stacks when their event loop stalls (``chaos_replica.py``'s
    ``--watchdog``: a diagnostic that reads a running thread's frames)."""


class EventFile:
    """A JSON-lines file, one ``os.write`` per line."""

    def __init__(self, path: Path, cand: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.cand = cand

    def __call__(self, event: str, /, **data: Any) -> float:
        now = time.monotonic()
        line = {"e": event, "c": self.cand, "t": time.time(), "m": now, **data}
        os.write(self.fd, (json.dumps(line) + "\n").encode())
        return now

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Proc:
    cand: str
    replica: int
    popen: subprocess.Popen[bytes]
    stderr: IO[bytes]
    state: str = "live"  # live, frozen, terming, dead
    until: float = 0.0  # frozen: when to continue; terming: when to kill
    member: str | None = None
    read: int = 0  # bytes of its events file read so far


@dataclass
class Soak:
    """One run: ``Soak(config, out).run()`` leaves its record in ``out``."""

    config: SoakConfig
    out: Path
    say: Callable[[str], None] = print
    procs: dict[str, Proc] = field(default_factory=dict)
    _incarnations: dict[int, int] = field(default_factory=dict)
    _conn: psycopg.Connection[Any] | None = None
    _holders: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(self.config.seed)
        self.emit = EventFile(self.out / "harness.jsonl", HARNESS)
        self.deck: list[str] = []
        self.pg = ThrowawayPostgres(
            max_connections=self.config.max_connections,
            settings={"track_commit_timestamp": "on"},
        )
        self.lock_oids = oids(lock_keys(LOCK_NAME))
        self.slot_oids = [oids(keys) for keys in slot_keys(SEM_NAME, SEM_SLOTS)]

    # ------------------------------------------------------------------ the run

    def run(self) -> None:
        cfg = self.config
        self.say(f"chaos soak: seed {cfg.seed}, {cfg.replicas} replicas, {cfg.seconds:.0f} s")
        self.pg.start()
        try:
            with contextlib.closing(psycopg.connect(self.pg.dsn, autocommit=True)) as conn:
                conn.execute(setup_sql())
                conn.execute(SETUP)
            for i in range(1, cfg.replicas + 1):
                self.spawn(i)
            self.wait_ready()
            start = self.emit("phase", name="faults", seed=cfg.seed)
            faults_end = start + max(0.0, cfg.seconds - cfg.tail_s)
            next_fault = start + self.rng.uniform(*cfg.fault_every_s)
            while time.monotonic() < faults_end:
                self.tick()
                if time.monotonic() >= next_fault:
                    self.fault()
                    next_fault = time.monotonic() + self.rng.uniform(*cfg.fault_every_s)
                time.sleep(TICK_S)
            self.emit("phase", name="quiet")
            for proc in self.live(frozen=True):
                if proc.state == "frozen":
                    proc.until = 0.0
            while time.monotonic() < start + cfg.seconds:
                self.tick()
                time.sleep(TICK_S)
            self.tick()
            self.sessions("live")
            self.emit("phase", name="shutdown")
            self.stop_all()
            self.sessions("after")
            self.emit("phase", name="end")
            self.gather()
        finally:
            self.kill_all()
            self.emit.close()
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()
            self.pg.close()

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick()
            if all(p.member for p in self.live()) and self._holders.get("lock"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the replicas were not ready within {timeout_s:.0f} s")

    # ------------------------------------------------------------------ processes

    def spawn(self, replica: int) -> Proc:
        k = self._incarnations[replica] = self._incarnations.get(replica, 0) + 1
        cand = f"r{replica}.{k}"
        cfg = self.config
        stderr = open(self.out / f"{cand}.err", "wb")  # noqa: SIM115 - closed when reaped
        popen = subprocess.Popen(
            [sys.executable, str(REPLICA), "--cand", cand,
             "--events", str(self.out / f"{cand}.jsonl"),
             "--names", str(cfg.names), "--period", str(cfg.period_s),
             *(["--watchdog"] if cfg.watchdog else [])],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr,
            env={**os.environ, DSN_ENV: self.pg.dsn},
        )  # fmt: skip
        proc = self.procs[cand] = Proc(cand, replica, popen, stderr)
        self.emit("spawn", cand=cand, pid=popen.pid)
        return proc

    def live(self, *, frozen: bool = False) -> list[Proc]:
        ok = ("live", "frozen") if frozen else ("live",)
        return [p for p in self.procs.values() if p.state in ok]

    def reaped(self, proc: Proc, how: str) -> None:
        proc.state = "dead"
        proc.stderr.close()
        if proc.popen.stdin is not None:
            proc.popen.stdin.close()
        self.emit("exited", cand=proc.cand, rc=proc.popen.returncode, how=how)

    def tick(self) -> None:
        now = time.monotonic()
        for proc in list(self.procs.values()):
            self.read_events(proc)
            if proc.state == "frozen" and now >= proc.until:
                proc.popen.send_signal(signal.SIGCONT)
                proc.state = "live"
                self.emit("cont", cand=proc.cand)
            elif proc.state == "terming" and proc.popen.poll() is not None:
                self.reaped(proc, "term")
                self.spawn(proc.replica)
            elif proc.state == "terming" and now >= proc.until:
                self.emit("term_hung", cand=proc.cand)
                proc.popen.kill()
                proc.popen.wait()
                self.reaped(proc, "term_hung")
                self.spawn(proc.replica)
            elif proc.state == "live" and proc.popen.poll() is not None:
                self.reaped(proc, "died")  # nobody asked it to
                self.spawn(proc.replica)
        self.sample_holders()

    def read_events(self, proc: Proc) -> None:
        if proc.member is not None:
            return  # all the harness needs: its member id
        with contextlib.suppress(OSError), open(self.out / f"{proc.cand}.jsonl", "rb") as f:
            f.seek(proc.read)
            for line in f:
                if not line.endswith(b"\n"):
                    break
                proc.read += len(line)
                event = json.loads(line)
                if event["e"] == "ready":
                    proc.member = str(event["member"])

    def stop_all(self) -> None:
        for proc in self.live(frozen=True):
            if proc.state == "frozen":
                proc.popen.send_signal(signal.SIGCONT)
                self.emit("cont", cand=proc.cand)
            proc.popen.send_signal(signal.SIGTERM)
            proc.state = "terming"
        deadline = time.monotonic() + self.config.term_wait_s
        for proc in self.procs.values():
            if proc.state != "terming":
                continue
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
                self.reaped(proc, "term")
            except subprocess.TimeoutExpired:
                self.emit("term_hung", cand=proc.cand)
                proc.popen.kill()
                proc.popen.wait()
                self.reaped(proc, "term_hung")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.state != "dead":
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.popen.kill()
                proc.popen.wait()
                self.reaped(proc, "cleanup")

    # ------------------------------------------------------------------ faults

    def fault(self) -> None:
        for _ in range(len(FAULT_DECK)):
            if not self.deck:  # each kind once first, then the rest of the round
                kinds = sorted(set(FAULT_DECK))
                rest = list(FAULT_DECK)
                for kind in kinds:
                    rest.remove(kind)
                self.rng.shuffle(kinds)
                self.rng.shuffle(rest)
                self.deck = rest + kinds  # popped from the end
            kind = self.deck.pop()
            if getattr(self, f"fault_{kind}")():
                return
            self.deck.insert(0, kind)  # not now (no target): later in the round

    def target(self, count: int = 1) -> list[Proc] | None:
        live = [p for p in self.live() if p.member is not None]
        if len(live) < count:
            return None
        leader = self.procs.get(next(iter(self._holders.get("lock") or []), ""))
        chosen = self.rng.sample(live, count)
        if leader in live and leader not in chosen and self.rng.random() < 0.5:
            chosen[0] = leader
        return chosen

    def fault_kill(self, count: int = 1) -> bool:
        procs = self.target(count)
        if procs is None:
            return False
        self.emit("fault", kind="kill" if count == 1 else "kill2", targets=[p.cand for p in procs])
        for proc in procs:
            proc.popen.kill()
        for proc in procs:
            proc.popen.wait()
            self.reaped(proc, "killed")
            self.spawn(proc.replica)
        return True

    def fault_kill2(self) -> bool:
        return self.fault_kill(2)

    def fault_term(self) -> bool:
        procs = self.target()
        if procs is None:
            return False
        (proc,) = procs
        self.emit("fault", kind="term", targets=[proc.cand])
        proc.popen.terminate()
        proc.state, proc.until = "terming", time.monotonic() + self.config.term_wait_s
        return True

    def fault_stop(self) -> bool:
        procs = self.target()
        if procs is None or any(p.state == "frozen" for p in self.procs.values()):
            return False
        (proc,) = procs
        for_s = self.rng.uniform(*self.config.stop_s)
        self.emit("fault", kind="stop", targets=[proc.cand], for_s=round(for_s, 3))
        proc.popen.send_signal(signal.SIGSTOP)
        proc.state, proc.until = "frozen", time.monotonic() + for_s
        return True

    def fault_terminate(self) -> bool:
        rows = self.query(HOLDERS)
        if not rows:
            return False
        roles = {"lock": [self.lock_oids], "sem": self.slot_oids}
        names = {
            oids(lock_keys(f"{GROUP}:{name_of(i)}")): name_of(i) for i in range(self.config.names)
        }
        members = {p.member: p.cand for p in self.procs.values() if p.state == "live"}
        found: list[tuple[str, str, int, str | None]] = []  # role, cand, pid, name
        for app, classid, objid, pid in rows:
            held = (classid, objid)
            cand = self.cand_of(str(app or ""), members)
            if cand is None or self.procs[cand].state != "live":
                continue
            for role, keys in roles.items():
                if held in keys:
                    found.append((role, cand, pid, None))
            if held in names:
                found.append(("name", cand, pid, names[held]))
        if not found:
            return False
        weights = {"lock": 4.0, "sem": 3.0, "name": 3.0 / len(names)}
        role, cand, pid, name = self.rng.choices(found, [weights[f[0]] for f in found])[0]
        self.emit("fault", kind="terminate", targets=[cand], role=role, name=name, pid=pid)
        self.query("SELECT pg_catalog.pg_terminate_backend(%s)", (pid,))
        return True

    @staticmethod
    def cand_of(app: str, members: dict[str | None, str]) -> str | None:
        """The replica whose session ``app`` is (``chaos:<cand>:<role>``, or a
        coordinator's ``pgl:<group>:<member>:<role>``)."""
        parts = app.split(":")
        if parts[0] == "chaos" and len(parts) >= 3:
            return parts[1]
        if parts[0] == "pgl" and len(parts) >= 4 and parts[1] == GROUP:
            return members.get(parts[2])
        return None

    def connected(self) -> list[str]:
        """The replicas a restart of the server reaches: every one not dead."""
        return [p.cand for p in self.procs.values() if p.state != "dead"]

    def fault_pg_fast(self) -> bool:
        self.emit("fault", kind="pg_fast", targets=self.connected())
        self.pg.restart("fast")
        self.emit("server_up")
        return True

    def fault_pg_immediate(self) -> bool:
        self.emit("fault", kind="pg_immediate", targets=self.connected())
        self.pg.stop("immediate")
        self.pg.start_again()
        self.emit("server_up")
        return True

    # ------------------------------------------------------------------ the database

    def query(self, sql: str, params: tuple[Any, ...] | None = None) -> list[Any] | None:
        """Rows of ``sql``, or None if the server did not answer (a restart)."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(
                    self.pg.dsn, autocommit=True, connect_timeout=3,
                    application_name=HARNESS, options="-c statement_timeout=5000",
                )  # fmt: skip
            cur = self._conn.execute(sql, params)
            return cur.fetchall() if cur.description else []
        except psycopg.Error:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return None

    def sample_holders(self) -> None:
        rows = self.query(HOLDERS)
        now: dict[str, Any] = {}
        if rows is None:
            now = {"lock": None, "sem": None}
        else:
            held = {(r[1], r[2]): self.cand_of(str(r[0] or ""), {}) for r in rows}
            now["lock"] = [c for c in [held.get(self.lock_oids)] if c]
            now["sem"] = sorted(c for k in self.slot_oids if (c := held.get(k)))
        for what, holders in now.items():
            if what not in self._holders or self._holders[what] != holders:
                self.emit("holder", what=what, holders=holders)
        self._holders = now

    def sessions(self, when: str, again_s: float = 3.0) -> None:
        """The client sessions, as two looks ``again_s`` apart agree (a session that
        is closing, or just opened, is not a leak): those in both."""
        first = {r[1]: str(r[0] or "") for r in self.query(SESSIONS) or []}
        until = time.monotonic() + again_s
        while time.monotonic() < until:
            self.tick()
            time.sleep(TICK_S)
        rows = [[app, pid] for app, pid in sorted(
            (str(r[0] or ""), r[1]) for r in self.query(SESSIONS) or [] if r[1] in first
        )]  # fmt: skip
        alive = [p.cand for p in self.live(frozen=True)]
        members = {p.member: p.cand for p in self.procs.values() if p.member}
        self.emit("sessions", when=when, rows=rows, alive=alive, members=members)

    def gather(self) -> None:
        def rows(sql: str) -> list[list[Any]]:
            with contextlib.closing(psycopg.connect(self.pg.dsn, autocommit=True)) as conn:
                return [list(r) for r in conn.execute(sql).fetchall()]

        db = {
            "rows": rows(
                "SELECT kind, key1, key2, term, began, cand, item, position,"
                f" {COMMITTED} FROM chaos.rows"
            ),
            "bumps": rows(f"SELECT key1, key2, term, {COMMITTED} FROM chaos.term_history"),
            "ledger": rows(
                "SELECT extract(epoch FROM slot)::float8, outcome, term, attempt"
                f" FROM public.pgleaderlock_runs WHERE schedule = '{LOCK_NAME}:{JOB}'"
            ),
            "checkpoints": rows(
                "SELECT subscription_name, last_position FROM public.pgleaderlock_subscriptions"
            ),
        }
        (self.out / "db.json").write_text(json.dumps(db))


def oids(keys: tuple[int, int]) -> tuple[int, int]:
    """How ``pg_locks`` shows a lock's keys (``classid``, ``objid``)."""
    return key_to_oid(keys[0]), key_to_oid(keys[1])
