"""Run several outbox relays (relay.py) against $PG_DSN, fault the leader over and over
while rows keep arriving, then check the sink: every outbox row relayed exactly once, in
order.

The faults, at random: SIGKILL of the leader's process (a new replica is started in its
place); ``pg_terminate_backend`` of the leader's lock session; and the stale leader:
the leader is frozen (SIGSTOP) while a batch is open, its lock session is terminated,
and it is thawed (SIGCONT) a moment later.

    PG_DSN=postgresql://user:pass@localhost/db python run.py
    python run.py --faults 40 --seed 7
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from pgleaderlock import lock_keys
from pgleaderlock.backends import key_to_oid

HERE = Path(__file__).parent
RELAY = HERE / "relay.py"
LOCK_NAME = "example-fencing-outbox"  # as in relay.py
TERMS_TABLE = "outbox_relay_terms"
Conn = psycopg.AsyncConnection[Any]

SETUP = f"""
DROP TABLE IF EXISTS outbox, sink, relay_checkpoint, {TERMS_TABLE};
CREATE TABLE outbox (id bigserial PRIMARY KEY, payload text NOT NULL);
CREATE TABLE sink (
    seq bigserial PRIMARY KEY,  -- the order in which rows reached the sink
    outbox_id bigint NOT NULL,  -- deliberately not unique: a duplicate must show up
    payload text NOT NULL,
    term bigint NOT NULL        -- the fencing term of the batch that relayed it
);
CREATE TABLE relay_checkpoint (last_id bigint NOT NULL);
INSERT INTO relay_checkpoint VALUES (0);
"""


@dataclass
class Relay:
    """One relay process and what it printed."""

    proc: asyncio.subprocess.Process
    reader: asyncio.Task[None] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid


class Demo:
    def __init__(self, dsn: str, args: argparse.Namespace) -> None:
        self.dsn = dsn
        self.args = args
        self.relays: list[Relay] = []
        self.faults: Counter[str] = Counter()
        self.key1, self.key2 = lock_keys(LOCK_NAME)

    # ------------------------------------------------------------ relay processes

    async def spawn(self) -> Relay:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(RELAY),
            "--batch",
            str(self.args.batch),
            "--hold-ms",
            str(self.args.hold_ms),
            *(["--no-fence"] if self.args.no_fence else []),
            env={**os.environ, "PG_DSN": self.dsn},  # not on the command line: ps shows it
            stdout=asyncio.subprocess.PIPE,
        )
        relay = Relay(proc)
        relay.reader = asyncio.create_task(self.read(relay))
        self.relays.append(relay)
        return relay

    async def read(self, relay: Relay) -> None:
        assert relay.proc.stdout is not None
        async for line in relay.proc.stdout:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                relay.events.append(event)
                if self.args.verbose or event["event"] in ("leading", "fenced"):
                    detail = {k: v for k, v in event.items() if k not in ("event", "pid", "at")}
                    print(f"  relay {relay.pid}: {event['event']} {detail or ''}".rstrip())

    async def stop_all(self) -> None:
        for relay in self.relays:
            if relay.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    relay.proc.send_signal(signal.SIGCONT)
                    relay.proc.terminate()
        for relay in self.relays:
            try:
                await asyncio.wait_for(relay.proc.wait(), 15)
            except TimeoutError:
                relay.proc.kill()
                await relay.proc.wait()
            if relay.reader is not None:
                await relay.reader

    # ------------------------------------------------------------ looking at the server

    async def leader(self, admin: Conn) -> tuple[int, int] | None:
        """(relay process pid, its lock session's backend pid) of the current leader."""
        cur = await admin.execute(
            "SELECT a.application_name, l.pid FROM pg_locks l JOIN pg_stat_activity a"
            " USING (pid) WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
            " AND l.classid = %s::int8::oid AND l.objid = %s::int8::oid",
            (key_to_oid(self.key1), key_to_oid(self.key2)),
        )
        row = await cur.fetchone()
        if row is None or not str(row[0]).startswith("outbox-relay pid="):
            return None
        return int(str(row[0]).removeprefix("outbox-relay pid=")), int(row[1])

    async def relayed(self, admin: Conn) -> int:
        """How many distinct outbox rows reached the sink."""
        cur = await admin.execute("SELECT count(DISTINCT outbox_id) FROM sink")
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def progress(self, admin: Conn, timeout_s: float = 30.0) -> tuple[int, int]:
        """Wait until a leader relays again (the sink grows); that leader."""
        start = await self.relayed(admin)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = await self.leader(admin)
            if found is not None and await self.relayed(admin) >= start + self.args.batch:
                return found
            await asyncio.sleep(0.01)
        raise SystemExit(f"no relay made progress within {timeout_s} s")

    async def in_transaction(self, admin: Conn, pid: int, timeout_s: float = 2.0) -> bool:
        """Wait until relay ``pid`` has a batch open (its data session idle in transaction)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            cur = await admin.execute(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = %s"
                " AND state = 'idle in transaction'",
                (f"outbox-relay-data pid={pid}",),
            )
            if await cur.fetchone():
                return True
            await asyncio.sleep(0.001)
        return False

    # ------------------------------------------------------------ faults

    async def fault(self, admin: Conn, rng: random.Random) -> None:
        pid, backend = await self.progress(admin)
        relay = next(r for r in self.relays if r.pid == pid)
        kind = rng.choice(["kill", "terminate", "freeze", "freeze"])
        print(f"fault {sum(self.faults.values()) + 1}: {kind} (relay {pid})")
        if kind == "kill":
            relay.proc.kill()
            await relay.proc.wait()
            await self.spawn()
        elif kind == "terminate":
            await admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
        else:
            if await self.in_transaction(admin, pid):
                kind = "freeze mid-batch"
            relay.proc.send_signal(signal.SIGSTOP)
            await admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
            await asyncio.sleep(rng.uniform(0.2, 1.0))  # others may take the lock meanwhile
            relay.proc.send_signal(signal.SIGCONT)
        self.faults[kind] += 1


@contextlib.asynccontextmanager
async def producing(dsn: str, rows_per_s: float) -> AsyncIterator[None]:
    """Insert outbox rows at about ``rows_per_s`` until the block ends."""

    async def produce() -> None:
        async with await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, connect_timeout=5
        ) as conn:
            n = 0
            while True:
                n += 1
                await conn.execute("INSERT INTO outbox (payload) VALUES (%s)", (f"event {n}",))
                await asyncio.sleep(1 / rows_per_s)

    task = asyncio.create_task(produce())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def check(admin: Conn) -> int:
    """Compare the sink with the outbox; print the verdict; the number of violations."""
    cur = await admin.execute("SELECT max(id) FROM outbox")
    (last,) = await cur.fetchone() or (0,)
    cur = await admin.execute("SELECT outbox_id, term FROM sink ORDER BY seq")
    rows = await cur.fetchall()
    ids = [row[0] for row in rows]
    terms = [row[1] for row in rows]
    duplicates = len(ids) - len(set(ids))
    missing = len(set(range(1, last + 1)) - set(ids))
    out_of_order = sum(1 for a, b in itertools.pairwise(ids) if b <= a)
    term_regressions = sum(1 for a, b in itertools.pairwise(terms) if b < a)
    distinct_terms = sorted(set(terms) - {0})
    span = f" ({distinct_terms[0]} .. {distinct_terms[-1]})" if distinct_terms else ""
    print(f"outbox rows: {last}; relayed: {len(ids)}; terms: {len(distinct_terms)}{span}")
    print(
        f"duplicates: {duplicates}; missing: {missing}; out of order: {out_of_order}; "
        f"term going back: {term_regressions}"
    )
    return duplicates + missing + out_of_order + term_regressions


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("PG_DSN"))
    parser.add_argument("--relays", type=int, default=3, help="relay processes (default 3)")
    parser.add_argument("--faults", type=int, default=20, help="faults to inject (default 20)")
    parser.add_argument("--rows-per-s", type=float, default=400.0, help="outbox rate")
    parser.add_argument("--batch", type=int, default=20, help="rows per relay transaction")
    parser.add_argument("--hold-ms", type=float, default=20.0, help="time inside each batch")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-fence", action="store_true", help="relays without fencing")
    parser.add_argument("--setup-only", action="store_true", help="create the tables and exit")
    parser.add_argument("--verbose", action="store_true", help="print every relay event")
    args = parser.parse_args()
    if not args.dsn:
        sys.exit("set PG_DSN or pass --dsn")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(seed)

    async with await psycopg.AsyncConnection.connect(
        args.dsn, autocommit=True, connect_timeout=5
    ) as admin:
        await admin.execute(SETUP.encode())
        if args.setup_only:
            return 0
        print(f"seed {seed}: {args.relays} relays, {args.faults} faults")
        demo = Demo(args.dsn, args)
        try:
            for _ in range(args.relays):
                await demo.spawn()
            async with producing(args.dsn, args.rows_per_s):
                for _ in range(args.faults):
                    await demo.fault(admin, rng)
                await demo.progress(admin)
            # the outbox is complete: wait until the leader has relayed all of it
            cur = await admin.execute("SELECT max(id) FROM outbox")
            (last,) = await cur.fetchone() or (0,)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if await demo.relayed(admin) >= last:
                    break
                await asyncio.sleep(0.05)
        finally:
            await demo.stop_all()
        fenced = sum(1 for r in demo.relays for e in r.events if e["event"] == "fenced")
        print(f"faults: {dict(demo.faults)}; batches refused by fence(): {fenced}")
        return 1 if await check(admin) else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
