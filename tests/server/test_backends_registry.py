"""The backend registry: discovery by entry points, choice by name or DSN, clear errors
for a missing driver, raw connections from ``connect_fn``, and a third-party backend
shipped by another distribution."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgleaderlock import (
    BackendUnavailableError,
    ConfigurationError,
    LeaderLock,
    LockOptions,
    Session,
    backends,
)
from pgleaderlock.backends.psycopg import PsycopgSession
from pgleaderlock.core import registry
from support.fixture_types import LockPids
from support.timings import lock_args, timings

pytestmark = pytest.mark.timeout(60)

FAST: dict[str, Any] = timings(retry_s=0.02, health_interval_s=0.1)
URL = "postgresql://app:pw@db.example:5432/app"


@pytest.fixture(autouse=True)
def fresh_registry() -> Iterator[None]:
    """Every test starts and ends with a registry that reads the entry points anew."""
    registry.refresh()
    yield
    registry.refresh()


def url(pg_dsn: str, scheme: str = "postgresql") -> str:
    info = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    host = info.get("host") or "127.0.0.1"
    if str(host).startswith("/"):
        pytest.skip("the test server is reachable only over a unix socket")
    user = info.get("user") or "postgres"
    password = f":{info['password']}" if info.get("password") else ""
    return (
        f"{scheme}://{user}{password}@{host}:{info.get('port') or 5432}/"
        f"{info.get('dbname') or 'postgres'}"
    )


# ---------------------------------------------------------------- discovery


def test_builtins_are_registered_and_available() -> None:
    assert {"psycopg", "asyncpg", "sqlalchemy"} <= set(registry.registered())
    assert {"psycopg", "asyncpg", "sqlalchemy"} <= set(registry.available())
    assert registry.get("asyncpg").name == "asyncpg"
    assert registry.DEFAULT == "psycopg"


def test_registry_is_in_the_core_and_imports_no_driver_until_asked() -> None:
    """The built-in backends are found through their entry points like any other: the
    registry imports no adapter and no driver until a backend is asked for."""
    code = textwrap.dedent("""
        import sys
        from pgleaderlock.core import registry

        def loaded():
            return sorted(
                m for m in sys.modules
                if m.split(".")[0] in ("psycopg", "asyncpg", "sqlalchemy")
                or m.startswith("pgleaderlock.backends")
            )

        assert {"psycopg", "asyncpg", "sqlalchemy"} <= set(registry.registered())
        assert loaded() == [], loaded()
        assert registry.get("asyncpg").name == "asyncpg"
        assert "asyncpg" in sys.modules and "pgleaderlock.backends.asyncpg" in sys.modules
        assert "psycopg" not in sys.modules and "sqlalchemy" not in sys.modules, loaded()
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_backends_package_offers_the_registry_functions() -> None:
    """``pgleaderlock.backends`` keeps the registry's public functions (docs/concepts.md,
    decision 10)."""
    assert backends.available is registry.available
    assert backends.registered is registry.registered
    assert backends.get is registry.get
    assert backends.refresh is registry.refresh


def test_unknown_backend_lists_the_registered_ones() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend 'nosuch'") as info:
        LeaderLock(URL, 1, 2, options=LockOptions(session=Session(backend="nosuch")))
    assert "asyncpg, psycopg, sqlalchemy" in str(info.value)
    assert isinstance(info.value, ImportError)


# ---------------------------------------------------------------- choice


@pytest.mark.parametrize(
    ("dsn", "name", "backend", "driver_dsn"),
    [
        (URL, None, "psycopg", URL),
        ("host=db dbname=app", None, "psycopg", "host=db dbname=app"),
        ("postgresql+asyncpg://app@db/app", None, "asyncpg", "postgresql://app@db/app"),
        ("postgres+asyncpg://app@db/app", None, "asyncpg", "postgres://app@db/app"),
        ("postgresql+psycopg://app@db/app", None, "psycopg", "postgresql://app@db/app"),
        ("POSTGRESQL+ASYNCPG://app@db/app", None, "asyncpg", "POSTGRESQL://app@db/app"),
        (URL, "asyncpg", "asyncpg", URL),
        ("postgresql+asyncpg://app@db/app", "asyncpg", "asyncpg", "postgresql://app@db/app"),
        # SQLAlchemy by name: its URL is kept whole (the +driver is SQLAlchemy's).
        (
            "postgresql+asyncpg://app@db/app",
            "sqlalchemy",
            "sqlalchemy",
            "postgresql+asyncpg://app@db/app",
        ),
        (
            "postgresql+psycopg://app@db/app",
            "sqlalchemy",
            "sqlalchemy",
            "postgresql+psycopg://app@db/app",
        ),
    ],
)
def test_resolve(dsn: str, name: str | None, backend: str, driver_dsn: str) -> None:
    chosen, given = registry.resolve(name, dsn)
    assert chosen.name == backend
    assert given == driver_dsn


def test_engine_selects_sqlalchemy() -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine("postgresql+asyncpg://app@db/app")
    chosen, given = registry.resolve(None, engine)
    assert chosen.name == "sqlalchemy"
    assert given is engine
    lock = LeaderLock(engine, 1, 2)
    assert lock.backend is not None
    assert lock.backend.name == "sqlalchemy"


def test_scheme_conflicting_with_the_name_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="asks for backend 'asyncpg'"):
        LeaderLock(
            "postgresql+asyncpg://app@db/app",
            1,
            2,
            options=LockOptions(session=Session(backend="psycopg")),
        )


def test_scheme_naming_an_unknown_driver() -> None:
    with pytest.raises(BackendUnavailableError, match="names backend 'psycopg2'"):
        LeaderLock("postgresql+psycopg2://app@db/app", 1, 2)


def test_object_no_backend_claims() -> None:
    with pytest.raises(ConfigurationError, match="connection string"):
        LeaderLock(object(), 1, 2)
    with pytest.raises(ConfigurationError, match="backend must be a name"):
        registry.resolve(42, URL)  # type: ignore[arg-type]


# ---------------------------------------------------------------- missing drivers


@pytest.fixture
def without_asyncpg(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make ``import asyncpg`` fail, as on a machine without the extra."""
    for name in list(sys.modules):
        if name == "asyncpg" or name.startswith("asyncpg.") or name.endswith(".backends.asyncpg"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # None: the import fails
    from pgleaderlock.backends import sqlalchemy as sa_backend

    sa_backend._engine.cache_clear()
    registry.refresh()
    yield
    monkeypatch.undo()
    sa_backend._engine.cache_clear()
    registry.refresh()


@pytest.mark.usefixtures("without_asyncpg")
def test_missing_asyncpg_names_the_extra() -> None:
    with pytest.raises(BackendUnavailableError) as info:
        LeaderLock(URL, 1, 2, options=LockOptions(session=Session(backend="asyncpg")))
    assert "pip install 'pgleaderlock[asyncpg]'" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(BackendUnavailableError, match=r"pgleaderlock\[asyncpg\]"):
        LeaderLock("postgresql+asyncpg://app@db/app", 1, 2)
    assert "asyncpg" in registry.registered()
    assert "asyncpg" not in registry.available()
    assert {"psycopg", "sqlalchemy"} <= set(registry.available())
    # SQLAlchemy itself is there; its asyncpg driver is not.
    with pytest.raises(BackendUnavailableError, match=r"pgleaderlock\[sqlalchemy\]"):
        LeaderLock(
            "postgresql+asyncpg://app@db/app",
            1,
            2,
            options=LockOptions(session=Session(backend="sqlalchemy")),
        )
    LeaderLock(
        "postgresql+psycopg://app@db/app",
        1,
        2,
        options=LockOptions(session=Session(backend="sqlalchemy")),
    )  # still fine


def test_missing_sqlalchemy_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if (
            name == "sqlalchemy"
            or name.startswith("sqlalchemy.")
            or name.endswith(".backends.sqlalchemy")
        ):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    registry.refresh()
    with pytest.raises(BackendUnavailableError, match=r"pip install 'pgleaderlock\[sqlalchemy\]'"):
        LeaderLock(
            "postgresql+asyncpg://app@db/app",
            1,
            2,
            options=LockOptions(session=Session(backend="sqlalchemy")),
        )
    assert "sqlalchemy" not in registry.available()
    chosen = LeaderLock(URL, 1, 2)._backend
    assert chosen is not None
    assert chosen.name == "psycopg"
    monkeypatch.undo()
    registry.refresh()


# ---------------------------------------------------------------- connect_fn


async def test_wrap_connection_picks_the_matching_adapter(pg_dsn: str) -> None:
    import asyncpg
    from sqlalchemy.ext.asyncio import create_async_engine

    from pgleaderlock.backends.asyncpg import AsyncpgSession
    from pgleaderlock.backends.sqlalchemy import SQLAlchemySession

    pconn = await psycopg.AsyncConnection.connect(pg_dsn)
    aconn = await asyncpg.connect(url(pg_dsn))
    engine = create_async_engine(url(pg_dsn, "postgresql+asyncpg"))
    sconn = await engine.connect()
    sessions = []
    try:
        sessions.append(registry.wrap_connection(pconn))
        assert isinstance(sessions[-1], PsycopgSession)
        sessions.append(registry.wrap_connection(aconn))
        assert isinstance(sessions[-1], AsyncpgSession)
        sessions.append(registry.wrap_connection(sconn))
        assert isinstance(sessions[-1], SQLAlchemySession)
        assert registry.wrap_connection(sessions[0]) is sessions[0]  # already a LockSession
        for session in sessions:
            assert await session.try_lock(11, 22) in (True, False)
        with pytest.raises(ConfigurationError, match="neither a LockSession"):
            registry.wrap_connection(object())
    finally:
        for session in sessions:
            await session.close()
        await pconn.close()
        aconn.terminate()
        await sconn.close()
        await engine.dispose()


# ---------------------------------------------------------------- third-party backends

TINY_BACKEND = '''
"""A third-party pgleaderlock backend: a LockSession of its own over psycopg."""
import psycopg

from pgleaderlock import Backend, ConnectionError
from pgleaderlock.backends import psycopg as base

CALLS = []


class TinyConnection:
    """This driver's own connection type (what a connect_fn would return)."""

    def __init__(self, conn):
        self.conn = conn


class TinySession:
    """Implements only the LockSession protocol: no wait_lock, no watch."""

    def __init__(self, conn):
        self.conn = conn
        self.backend_pid = None

    async def _one(self, query, *args):
        CALLS.append(query.split("(")[0])
        try:
            cur = await self.conn.execute(query, args)
            value, self.backend_pid = await cur.fetchone()
        except psycopg.Error as exc:
            raise ConnectionError(str(exc)) from exc
        return value

    async def try_lock(self, key1, key2):
        return await self._one("SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", key1, key2)

    async def unlock(self, key1, key2):
        return await self._one("SELECT pg_advisory_unlock(%s, %s), pg_backend_pid()", key1, key2)

    async def holds(self, key1, key2):
        return await self._one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND pid = pg_backend_pid() AND objsubid = 2 AND classid = (%s::int8 & 4294967295)::oid"
            " AND objid = (%s::int8 & 4294967295)::oid), pg_backend_pid()", key1, key2)

    async def close(self):
        CALLS.append("close")
        await self.conn.close()


async def connect(dsn, options):
    CALLS.append("connect")
    conn = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=options.application_name
    )
    return TinySession(conn)


def wrap(obj):
    return TinySession(obj.conn) if isinstance(obj, TinyConnection) else None


backend = Backend(name="{name}", connect=connect, wrap=wrap, check_dsn=base.check_dsn)
'''


def install_distribution(
    root: Path, dist: str, module: str, source: str, entry_points: dict[str, str]
) -> None:
    """What ``pip install`` leaves behind, minus pip: the module and a ``*.dist-info``
    with the entry points, in a directory that goes on ``sys.path``."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[pgleaderlock.backends]\n{lines}")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path for distributions made by the test; gone afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield root
    monkeypatch.undo()
    for name in set(sys.modules) - before:
        if name.startswith("tiny_"):
            del sys.modules[name]
    registry.refresh()


async def test_third_party_backend_is_selected_by_name(
    site: Path,
    pg_dsn: str,
    keys: tuple[int, int],
    holders: LockPids,
) -> None:
    name = f"tiny{uuid.uuid4().hex[:6]}"
    module = f"tiny_{name}"
    install_distribution(
        site, "tiny-pgleaderlock-backend", module, TINY_BACKEND.replace("{name}", name),
        {name: f"{module}:backend"},
    )  # fmt: skip
    registry.refresh()
    assert name in registry.registered()
    assert name in registry.available()

    lock = LeaderLock(
        pg_dsn, *keys, **lock_args(FAST, options=LockOptions(session=Session(backend=name)))
    )
    assert lock.follower_mode == "wait"  # asked for; this backend cannot wait: it polls
    async with lock:
        assert await lock.wait_for_leadership(10)
        assert await holders(*keys) == [lock.backend_pid]
    assert await holders(*keys) == []
    calls = sys.modules[module].CALLS
    assert calls[0] == "connect"
    assert "SELECT pg_try_advisory_lock" in calls
    assert "SELECT pg_advisory_unlock" in calls
    assert calls[-1] == "close"

    # Its raw connection type comes back from connect_fn and is wrapped by its wrap().
    tiny = sys.modules[module]
    conns: list[psycopg.AsyncConnection[Any]] = []

    async def connect_fn() -> object:
        conns.append(await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True))
        return tiny.TinyConnection(conns[-1])

    lock = LeaderLock(None, *keys, **lock_args(FAST, connect_fn=connect_fn))
    async with lock:
        assert await lock.wait_for_leadership(10)
        assert type(lock._slot.session).__name__ == "TinySession"
    for conn in conns:
        await conn.close()


def test_third_party_backend_with_a_missing_driver_names_its_distribution(site: Path) -> None:
    install_distribution(
        site, "tiny-broken-backend", "tiny_broken_backend",
        "import no_such_driver_for_pgleaderlock  # noqa\n", {"tinybroken": "tiny_broken_backend:backend"},
    )  # fmt: skip
    registry.refresh()
    assert "tinybroken" in registry.registered()
    assert "tinybroken" not in registry.available()
    with pytest.raises(BackendUnavailableError, match="pip install 'tiny-broken-backend'"):
        LeaderLock(URL, 1, 2, options=LockOptions(session=Session(backend="tinybroken")))


def test_broken_third_party_backends_do_not_break_the_others(site: Path) -> None:
    install_distribution(
        site, "tiny-bad-backends", "tiny_bad_backends",
        textwrap.dedent("""
            from pgleaderlock.backends.psycopg import backend as psycopg_backend
            not_a_backend = object()
            misnamed = psycopg_backend
            def __getattr__(name):
                raise RuntimeError("boom")
        """),
        {"tinynot": "tiny_bad_backends:not_a_backend", "tinymisnamed": "tiny_bad_backends:misnamed",
         "tinyboom": "tiny_bad_backends:explodes"},
    )  # fmt: skip
    registry.refresh()
    assert {"tinynot", "tinymisnamed", "tinyboom"} <= set(registry.registered())
    assert {"psycopg", "asyncpg", "sqlalchemy"} <= set(registry.available())
    assert not {"tinynot", "tinymisnamed", "tinyboom"} & set(registry.available())
    with pytest.raises(BackendUnavailableError, match="not a Backend"):
        registry.get("tinynot")
    with pytest.raises(BackendUnavailableError, match="names must match"):
        registry.get("tinymisnamed")
    with pytest.raises(BackendUnavailableError, match="failed to load: RuntimeError: boom"):
        registry.get("tinyboom")
