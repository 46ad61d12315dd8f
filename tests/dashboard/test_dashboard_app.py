"""The dashboard's app and snapshot: what the JSON says about locks, semaphores and
leadership changes; safe by default (GET only, a Content-Security-Policy of 'self', no
DSN or password anywhere, read-only transactions); mountable in a FastAPI app."""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import psycopg
import pytest
from asgi_lifespan import LifespanManager
from fastapi import FastAPI
from psycopg.conninfo import make_conninfo

from pgleaderlock import LeaderLock, LockOptions, Participation, Semaphore
from pgleaderlock.dashboard import CSP, Dashboard, History, fingerprint
from pgleaderlock.dashboard.app import LOOPBACK_HOSTS
from pgleaderlock.dashboard.snapshot import safe_error
from pgleaderlock.status import bounded
from support.poll import eventually

pytestmark = [pytest.mark.timeout(90)]

SECRET = "hunter2-not-on-the-page"


def test_fingerprint_ignores_the_clock() -> None:
    a = {"checked_at": 1, "locks": [{"pid": 7, "wait_start_age_s": 0.5, "state": "idle"}]}
    b = {"checked_at": 2, "locks": [{"pid": 7, "wait_start_age_s": 9.0, "state": "active"}]}
    c = {"checked_at": 2, "locks": [{"pid": 8, "wait_start_age_s": 9.0, "state": "active"}]}
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(c)


def test_history_records_changes_only_newest_first() -> None:
    history = History()
    a = {"pid": 1, "identity": "a", "role": "app", "term": 4, "state": "idle"}
    b = {"pid": 2, "identity": "b", "role": "app", "term": 5}
    assert len(history.note("x", a, 1)) == 1  # type: ignore[arg-type]
    assert len(history.note("x", {**a, "state": "active"}, 2)) == 1  # type: ignore[arg-type]
    seen = history.note("x", b, 3)  # type: ignore[arg-type]
    assert [c["leader"]["identity"] for c in seen] == ["b", "a"]
    assert [c["first_seen"] for c in seen] == [False, True]
    seen = history.note("x", None, 4)  # type: ignore[arg-type]
    assert seen[0]["leader"] is None
    for i in range(100):
        seen = history.note("x", {"pid": i}, 5 + i)  # type: ignore[arg-type]
    assert len(seen) == 20


def test_an_error_for_the_page_has_no_dsn() -> None:
    message = f"cannot connect: refused; DSN: postgresql://u:{SECRET}@h/db"
    assert safe_error(Exception(message)) == "cannot connect: refused"


def test_bad_arguments_are_refused_before_any_io() -> None:
    from pgleaderlock import ConfigurationError

    for bad in (
        {"schema": "no such"},
        {"trusted_roles": [""]},
        {"period_s": 2.0},
        {"period_s": 0},
        {"timeout_s": -1},
        {"max_clients": 0},
        {"group_names": {"bad group!": ["x"]}},
    ):
        with pytest.raises(ConfigurationError):
            Dashboard("postgresql://nowhere.invalid/db", **bad)


@pytest.mark.integration
async def test_the_snapshot_names_locks_leaders_semaphores_and_changes(fresh_db: str) -> None:
    options = LockOptions(load_plugins=False, participation=Participation(identity="a"))
    board = Dashboard(fresh_db, period_s=0.2)
    async with (
        LeaderLock.from_name("billing", fresh_db, options=options) as lock,
        Semaphore(fresh_db, "pool", slots=2, options=LockOptions(load_plugins=False)) as sem,
        board,
    ):
        assert await lock.wait_for_leadership(10)
        assert await sem.wait_for_leadership(10)
        hub = board.refresher.hub

        def snapshot() -> dict[str, Any]:
            return dict(json.loads(hub.snapshot_json))

        await eventually(lambda: len(snapshot()["locks"]) == 1 and snapshot()["semaphores"], 10)
        view = snapshot()
        (billing,) = view["locks"]
        assert billing["lock"]["name"] == "billing"
        assert billing["leader"]["pid"] == lock.statistics().backend_pid
        assert billing["leader"]["usename"] == "postgres"
        assert billing["history"][0]["leader"]["pid"] == billing["leader"]["pid"]
        (pool,) = view["semaphores"]
        assert pool["name"] == "pool"
        assert pool["held"] == 1
        assert view["history_since"] is not None
        first = billing["leader"]["pid"]
        await lock.step_down()
        await lock.shutdown()  # nobody leads now: the change is seen
        await eventually(lambda: not snapshot()["locks"], 10)
    assert first


@pytest.mark.integration
async def test_safe_by_default_headers_methods_and_no_dsn(
    fresh_db: str, serve: Callable[..., Any], event_clients: Callable[..., Any]
) -> None:
    dsn = make_conninfo(fresh_db, password=SECRET)  # trust: the password is ignored
    with serve(dsn) as app:
        async with httpx.AsyncClient(base_url=app.url, timeout=10) as client:
            bodies = []
            for path in ("", "static/dashboard.js", "static/dashboard.css", "api/snapshot"):
                response = await client.get(path)
                assert response.status_code == 200, path
                assert response.headers["content-security-policy"] == CSP
                assert response.headers["x-content-type-options"] == "nosniff"
                bodies.append(response.text)
            assert "default-src 'self'" in CSP
            assert "'unsafe-inline'" not in CSP
            for method in ("POST", "PUT", "DELETE", "PATCH"):
                response = await client.request(method, "api/snapshot")
                assert response.status_code == 405, method
            assert (await client.get("static/../app.py")).status_code == 404
            assert (await client.get("static/nothing.js")).status_code == 404
        async with event_clients(app.url, 1) as (page,):
            await eventually(lambda: bool(page.snapshots and page.ticks), 10)
        seen = "\n".join([*bodies, json.dumps(page.snapshots), json.dumps(page.ticks)])
        for secret in (SECRET, dsn, fresh_db, "password"):
            assert secret not in seen
    # An unreachable server: the error on the page names no DSN either.
    with serve(make_conninfo(dsn, port=1)) as app:
        async with event_clients(app.url, 1) as (page,):
            await eventually(lambda: bool(page.ticks) and page.ticks[-1]["error"], 10)
        error = page.ticks[-1]["error"]
        assert "port 1" in error or "refused" in error.lower()
        assert SECRET not in error
        assert "DSN" not in error


async def test_on_loopback_another_host_name_is_refused() -> None:
    """DNS rebinding: another site's page, its name made to resolve to 127.0.0.1, sends
    its own name in ``Host``; the dashboard answers none of it (421), page or JSON."""
    board = Dashboard("postgresql://nowhere.invalid/db", allowed_hosts=LOOPBACK_HOSTS)
    transport = httpx.ASGITransport(app=board.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8800") as c:
        assert (await c.get("/")).status_code == 200
        assert (await c.get("/", headers={"host": "localhost:8800"})).status_code == 200
        assert (await c.get("/", headers={"host": "[::1]:8800"})).status_code == 200
        for path in ("/", "/api/snapshot", "/api/events", "/static/dashboard.js"):
            refused = await c.get(path, headers={"host": "rebound.example:8800"})
            assert refused.status_code == 421, path
            assert refused.headers["content-security-policy"] == CSP
    anyone = Dashboard("postgresql://nowhere.invalid/db")  # mounted: the host app's concern
    transport = httpx.ASGITransport(app=anyone.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://any.example") as c:
        assert (await c.get("/")).status_code == 200


@pytest.mark.integration
async def test_every_refresh_reads_in_a_read_only_transaction(fresh_db: str) -> None:
    board = Dashboard(fresh_db)
    conn = board.refresher._open()  # the refresher's own session, as it opens it
    try:
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction), bounded(conn, 5.0):
            conn.execute("CREATE TABLE public.dashboard_wrote_here ()")
    finally:
        conn.close()


@contextlib.asynccontextmanager
async def mounted(dsn: str, *, started: bool) -> AsyncIterator[httpx.AsyncClient]:
    board = Dashboard(dsn)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if started:
            async with board:
                yield
        else:
            yield

    app = FastAPI(lifespan=lifespan)
    app.mount("/leaders", board.app)
    async with (
        LifespanManager(app) as manager,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=manager.app), base_url="http://test"
        ) as client,
    ):
        yield client
    assert not board.refresher.running


@pytest.mark.integration
async def test_mounted_in_a_fastapi_app(fresh_db: str) -> None:
    async with mounted(fresh_db, started=True) as client:
        page = await client.get("/leaders/")
        assert page.status_code == 200
        assert 'src="static/dashboard.js"' in page.text  # relative: works under the prefix
        assert (await client.get("/leaders/static/dashboard.js")).status_code == 200
        body = (await client.get("/leaders/api/snapshot")).json()
        assert (
            body["snapshot"]["database"] == make_conninfo(fresh_db).split("dbname=")[1].split()[0]
        )
    async with mounted(fresh_db, started=False) as client:
        for path in ("/leaders/api/snapshot", "/leaders/api/events"):
            refused = await client.get(path)
            assert refused.status_code == 503, path
            assert "lifespan" in refused.text


def test_missing_starlette_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Starlette, importing the dashboard says which extra brings it."""
    monkeypatch.setitem(sys.modules, "starlette", None)
    for name in [m for m in sys.modules if m.startswith("pgleaderlock.dashboard")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"pip install 'pgleaderlock\[dashboard\]'"):
        importlib.import_module("pgleaderlock.dashboard")
