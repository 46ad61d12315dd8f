"""The fan-out of the dashboard's refreshes to the open pages, as server-sent events.

The hub holds only the latest state: the snapshot's JSON (and a sequence number that
grows when what it says changes) and the latest tick (one per refresh: when, and what
the dashboard costs). A page's stream sends a ``snapshot`` event when the snapshot
changed since it last sent one, and a ``tick`` after each refresh; a slow page skips to
the latest, so nothing queues up per page. No page ever reads the database: the one
`Refresher` of the app does, and publishes here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["KEEPALIVE_S", "STREAM_MAX_S", "Hub", "TooManyClients"]

KEEPALIVE_S = 15.0
"""A comment line on an otherwise quiet stream this often, so proxies keep it open."""
STREAM_MAX_S = 300.0
"""A stream ends after this long (the page's ``EventSource`` reconnects by itself): a
server that waits for open responses before it stops waits at most this long."""


class TooManyClients(Exception):
    """The hub serves its most streams already."""


class Hub:
    """The latest snapshot and tick, and the streams that follow them.

    Args:
        max_clients: the most streams open at once (each holds a small task and a
            socket, never a database session).
    """

    def __init__(self, max_clients: int = 100) -> None:
        self.max_clients = max_clients
        self.clients = 0
        self.snapshot_seq = 0
        self.snapshot_json = "null"
        self.tick: dict[str, Any] = {"seq": 0}
        self.closed = False
        self._fingerprint: str | None = None
        self._changed = asyncio.Event()

    def publish(
        self, snapshot_json: str | None, fingerprint: str | None, tick: dict[str, Any]
    ) -> None:
        """A refresh's result: its snapshot (``None``: the refresh failed, keep the last
        one) and tick; wakes every stream."""
        if snapshot_json is not None and fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            self.snapshot_json = snapshot_json
            self.snapshot_seq += 1
        self.tick = {**tick, "clients": self.clients}
        self._wake()

    def close(self) -> None:
        """End every stream (the app shuts down)."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def stream(self) -> AsyncIterator[str]:
        """One page's server-sent events, until the hub closes (or the page leaves: the
        server cancels the stream).

        Raises:
            TooManyClients: ``max_clients`` streams are open.
        """
        if self.clients >= self.max_clients:
            raise TooManyClients(f"{self.clients} pages follow the dashboard already")
        self.clients += 1
        try:
            async for chunk in self._events():
                yield chunk
        finally:
            self.clients -= 1

    async def _events(self) -> AsyncIterator[str]:
        yield "retry: 2000\n\n"
        sent_snapshot, sent_tick = 0, -1
        loop = asyncio.get_running_loop()
        ends = loop.time() + STREAM_MAX_S
        while not self.closed and loop.time() < ends:
            changed = self._changed
            if self.snapshot_seq != sent_snapshot:
                sent_snapshot = self.snapshot_seq
                yield f"event: snapshot\ndata: {self.snapshot_json}\n\n"
            if self.tick["seq"] != sent_tick:
                sent_tick = self.tick["seq"]
                yield f"event: tick\ndata: {json.dumps(self.tick)}\n\n"
            try:
                await asyncio.wait_for(changed.wait(), KEEPALIVE_S)
            except TimeoutError:
                yield ": keep-alive\n\n"
