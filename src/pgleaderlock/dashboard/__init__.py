"""A read-only web page of who leads what: locks, Coordinator groups, semaphores and
schedules, live.

Install it with ``pip install 'pgleaderlock[dashboard]'`` (Starlette and uvicorn) and
run ``pgleaderlock dashboard --dsn DSN`` (http://127.0.0.1:8800/), or mount a
[`Dashboard`][pgleaderlock.dashboard.Dashboard]'s ``app`` in your own ASGI app. See the
guide "The dashboard".

- `snapshot`: the read model (`pgleaderlock.status`) gathered into one snapshot;
- `refresher`: the app's one reader (two sessions, whatever the number of pages);
- `hub`: the snapshot fanned out to the pages as server-sent events;
- `app`: the ASGI app, its page (``static/``) and its security headers.

*Added in 0.2.0.*
"""

from __future__ import annotations

from .._extras import needs_extra

with needs_extra(__name__, "Starlette", "dashboard"):
    import starlette  # noqa: F401

from ..status.render import fingerprint
from .app import CSP, Dashboard, create_app
from .hub import Hub
from .refresher import Refresher
from .snapshot import History, Tables, build_snapshot

__all__ = [
    "CSP",
    "Dashboard",
    "History",
    "Hub",
    "Refresher",
    "Tables",
    "build_snapshot",
    "create_app",
    "fingerprint",
]
