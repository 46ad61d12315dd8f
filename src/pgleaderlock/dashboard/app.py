"""The dashboard as an ASGI app (Starlette): a page, its script and style, the snapshot as
JSON and the server-sent events that keep the page live.

Routes (all ``GET``; any other method is refused with 405):

| path | what |
|---|---|
| ``/`` | the page (``index.html``: no inline script or style) |
| ``/static/NAME`` | its script, style and icon, from the package (no CDN) |
| ``/api/snapshot`` | the latest snapshot, JSON |
| ``/api/events`` | server-sent events: ``snapshot`` when it changes, ``tick`` per refresh |

Every response carries a Content-Security-Policy that allows only the app itself
(``default-src 'self'``, no inline script, no frames), ``X-Content-Type-Options:
nosniff`` and ``Referrer-Policy: no-referrer``. The pages' URLs are relative, so the app
works mounted under a prefix.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..coordination.protocol import check_group, name_keys
from ..lowlevel import ConfigurationError, check_identifier, check_roles
from .hub import TooManyClients
from .refresher import Refresher
from .snapshot import Tables

__all__ = ["CSP", "LOOPBACK_HOSTS", "Dashboard", "create_app"]

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'none'"
)
"""The page's Content-Security-Policy: only the app's own files, nothing inline."""

_STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


def _asset(name: str) -> bytes:
    return importlib.resources.files(__package__).joinpath("static", name).read_bytes()


_Endpoint = Callable[[Request], Awaitable[Response]]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The names a page on loopback is reached by (``Dashboard(allowed_hosts=...)``)."""


class _SecurityHeaders:
    """Adds the security headers to every response of the wrapped app, and refuses a
    request whose ``Host`` is not one of ``allowed`` (``None``: any)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str] | None) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.allowed is not None and _host(scope) not in self.allowed:
            # A page of another site whose name was made to resolve to 127.0.0.1 (DNS
            # rebinding) sends its own name: it reads nothing here.
            refused = PlainTextResponse("this host name is not the dashboard's", 421)
            await refused(scope, receive, _with_headers(send))
            return
        await self.app(scope, receive, _with_headers(send))


def _with_headers(send: Send) -> Send:
    async def with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), *_HEADERS]
        await send(message)

    return with_headers


def _host(scope: Scope) -> str:
    """The request's ``Host``, without its port, lower case ("" when absent)."""
    for name, value in scope.get("headers", []):
        if name == b"host":
            host = str(value.decode("latin-1")).strip().lower()
            if host.startswith("["):  # [::1]:8800
                return host[1 : host.find("]")] if "]" in host else host
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return ""


class Dashboard:
    """The dashboard of one database: its `Refresher` and its ASGI ``app``.

    Run alone (``pgleaderlock dashboard``, or any ASGI server on `create_app`'s app),
    its lifespan starts and stops the refresher. Mounted in another app, whose lifespan
    is the one that runs, start it there:

    ```python
    dashboard = Dashboard(DSN, trusted_roles=("owner",))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with dashboard:  # one refresher, however many pages are open
            yield

    app = FastAPI(lifespan=lifespan)
    app.mount("/leaders", dashboard.app)  # the page at /leaders/
    ```

    Args:
        dsn: the database; never shown on the page or in its JSON.
        schema: the schema of the library's tables.
        trusted_roles: roles trusted besides the reading role and superusers.
        group_names: names of Coordinator groups to show by name, by group (a
            group's sessions show its names' keys only; its checkpoint table's rows
            give names too).
        period_s: the longest time between two refreshes (at most 1 s).
        timeout_s: the bound of a connect and of each statement.
        max_clients: the most pages open at once.
        allowed_hosts: the host names (``Host`` header, without the port) the app
            answers to; ``None``: any (a host app's concern when mounted). Served on
            loopback, give `LOOPBACK_HOSTS`: another site's page that made its name
            resolve to 127.0.0.1 (DNS rebinding) is then refused.

    Raises:
        ConfigurationError: a bad schema, role name or bound.
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "public",
        trusted_roles: Sequence[str] = (),
        group_names: Mapping[str, Sequence[str]] | None = None,
        period_s: float = 1.0,
        timeout_s: float = 5.0,
        max_clients: int = 100,
        allowed_hosts: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(max_clients, int) or not 1 <= max_clients <= 10_000:
            raise ConfigurationError(f"max_clients must be 1-10000, got {max_clients!r}")
        pairs = tuple(
            (check_group(g), n) for g, names in (group_names or {}).items() for n in names
        )
        for group, name in pairs:
            name_keys(group, name)  # a ConfigurationError for a bad name
        tables = Tables(schema=check_identifier("schema", schema),
                        trusted_roles=check_roles(trusted_roles), group_names=pairs)  # fmt: skip
        self.refresher = Refresher(
            dsn, tables, period_s=period_s, timeout_s=timeout_s, max_clients=max_clients
        )
        routes = [
            Route("/", self._index, methods=["GET"]),
            Route("/static/{name}", self._static, methods=["GET"]),
            Route("/api/snapshot", self._when_running(self._snapshot), methods=["GET"]),
            Route("/api/events", self._when_running(self._events), methods=["GET"]),
        ]
        allowed = None if allowed_hosts is None else frozenset(h.lower() for h in allowed_hosts)
        self.app: ASGIApp = _SecurityHeaders(
            Starlette(routes=routes, lifespan=self._lifespan), allowed
        )

    async def __aenter__(self) -> Dashboard:
        await self.refresher.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.refresher.stop()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        async with self:
            yield

    def _when_running(self, endpoint: _Endpoint) -> _Endpoint:
        """``endpoint``, answered only while the refresher runs (503 otherwise: a mounted
        dashboard that its host app's lifespan did not start has nothing to show)."""

        async def guarded(request: Request) -> Response:
            if not self.refresher.running:
                return PlainTextResponse(
                    "the dashboard is not running: start it in the app's lifespan"
                    " (async with dashboard)",
                    status_code=503,
                )
            return await endpoint(request)

        return guarded

    async def _index(self, request: Request) -> Response:
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-cache"})  # fmt: skip

    async def _static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _STATIC:
            return PlainTextResponse("not found", status_code=404)
        return Response(_asset(name), media_type=_STATIC[name],
                        headers={"cache-control": "no-cache"})  # fmt: skip

    async def _snapshot(self, request: Request) -> Response:
        hub = self.refresher.hub
        body = f'{{"snapshot": {hub.snapshot_json}, "tick": {json.dumps(hub.tick)}}}'
        return Response(body, media_type="application/json",
                        headers={"cache-control": "no-store"})  # fmt: skip

    async def _events(self, request: Request) -> Response:
        hub = self.refresher.hub
        if hub.clients >= hub.max_clients:
            return PlainTextResponse("too many pages follow the dashboard", status_code=503)
        stream = hub.stream()
        return StreamingResponse(
            _guarded(stream),
            media_type="text/event-stream",
            headers={"cache-control": "no-store", "x-accel-buffering": "no"},
        )


async def _guarded(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    with contextlib.suppress(TooManyClients):
        async for chunk in stream:
            yield chunk


def create_app(dsn: str, **options: Any) -> ASGIApp:
    """The dashboard's ASGI app, run alone (its lifespan runs the refresher): a
    `Dashboard`'s ``app``, with the same arguments."""
    return Dashboard(dsn, **options).app
