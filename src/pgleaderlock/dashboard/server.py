"""The dashboard served by uvicorn (``pgleaderlock dashboard``, and the tests).

A page's event stream never ends by itself, and uvicorn's shutdown waits for open
responses before it runs the app's lifespan exit. `DashboardServer` closes the
dashboard's hub first, so the open pages' streams end at once and the shutdown needs
no grace period; the lifespan exit then stops the refresher (its tasks cancelled and
awaited, its sessions closed).

Mounted in another app served by another server, the streams end when that server
cancels them (uvicorn's ``timeout_graceful_shutdown``) or after at most
`pgleaderlock.dashboard.hub.STREAM_MAX_S` (the page reconnects by itself).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from .app import Dashboard

__all__ = ["DashboardServer"]


class DashboardServer(uvicorn.Server):
    """A ``uvicorn.Server`` for one `Dashboard`'s app, which ends the pages' streams
    when it shuts down.

    Args:
        board: the dashboard.
        **config: ``uvicorn.Config``'s arguments besides the app (``lifespan`` is
            always ``"on"``: it runs the refresher).
    """

    def __init__(self, board: Dashboard, **config: Any) -> None:
        self.board = board
        self.stopped_by: list[int] = []
        """The signals that stopped the server."""
        super().__init__(uvicorn.Config(board.app, **{**config, "lifespan": "on"}))

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's signal handling, without raising the signal again once the server
        has stopped: SIGINT/SIGTERM is how the dashboard is meant to stop, and the
        command then exits 0 (as ``pgleaderlock run`` does)."""
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                self.stopped_by = list(captured)
                captured.clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.board.refresher.hub.close()
        await super().shutdown(sockets)
