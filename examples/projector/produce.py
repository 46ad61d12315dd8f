"""Append random account events (deposits and withdrawals) to the ``events`` table.

Each transaction appends 1-5 events while holding a table lock that only appenders
take (readers are not blocked): appends are serialised, so event ids become visible in
increasing order and a projector that reads ``id > checkpoint`` never skips one that
commits late. Run it next to the projectors (see README.md)::

    python produce.py --dsn postgresql://user:pass@localhost/db --rate 200

It stops after ``--count`` events or ``--seconds``, or on SIGTERM/SIGINT, and prints
one JSON line: ``{"event": "produced", "count": ..., "last_id": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import time

from projector import connect, say, setup_schema


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("PG_DSN"))
    parser.add_argument("--rate", type=float, default=200.0, help="events per second")
    parser.add_argument("--accounts", type=int, default=20)
    parser.add_argument("--count", type=int, default=None, help="stop after this many")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if not args.dsn:
        sys.exit("set PG_DSN or pass --dsn")
    rng = random.Random(args.seed)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await setup_schema(args.dsn)

    produced, last_id = 0, None
    started = time.monotonic()
    async with await connect(args.dsn, "projector-producer") as conn:
        while not stop.is_set():
            if args.count is not None and produced >= args.count:
                break
            if args.seconds is not None and time.monotonic() - started >= args.seconds:
                break
            n = rng.randint(1, 5)
            if args.count is not None:
                n = min(n, args.count - produced)
            rows = [
                (
                    f"acct-{rng.randrange(args.accounts):03d}",
                    rng.choices(("deposit", "withdrawal"), (0.6, 0.4))[0],
                    rng.randint(1, 1000),
                )
                for _ in range(n)
            ]
            async with conn.transaction():
                await conn.execute("LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE")
                cur = await conn.execute(
                    "INSERT INTO events (account, kind, amount)"
                    " SELECT * FROM unnest(%s::text[], %s::text[], %s::int8[])"
                    " RETURNING id",
                    ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]),
                )
                last_id = max(row[0] for row in await cur.fetchall())
            produced += n
            with contextlib.suppress(TimeoutError):  # pace: n events at --rate
                await asyncio.wait_for(stop.wait(), n / args.rate)
    say("produced", count=produced, last_id=last_id)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
