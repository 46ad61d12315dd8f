"""The backend registry: driver adapters found through the entry-point group
``pgleaderlock.backends``.

A backend is a [`Backend`][pgleaderlock.Backend] object. This module imports no driver and
no adapter: the built-in backends (``psycopg``, ``asyncpg``, ``sqlalchemy``) are declared in
pgleaderlock's own ``pyproject.toml`` and found through their entry points exactly like a
third-party one, which registers the same way:

```toml
[project.entry-points."pgleaderlock.backends"]
mydriver = "mypackage.pgleaderlock_backend:backend"
```

Backends are imported lazily, when first asked for, so a missing optional driver only
matters to the lock that wants it.

How ``LeaderLock(dsn, ..., backend=None)`` picks one (`resolve`):

1. ``backend="name"`` wins. A DSN string is passed to it unchanged, except that a
   ``+name`` in its scheme is removed (``postgresql+asyncpg://`` -> ``postgresql://``
   for the asyncpg backend). A backend whose ``claims`` accepts the string (the
   sqlalchemy backend with ``postgresql+asyncpg://``) gets it as it is.
2. Else a ``postgresql+DRIVER://`` scheme names the backend (``+asyncpg`` -> asyncpg,
   ``+psycopg`` -> psycopg).
3. Else an object that is not a string goes to the backend that claims it (a
   SQLAlchemy ``AsyncEngine`` -> sqlalchemy).
4. Else psycopg.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from functools import cache
from typing import TYPE_CHECKING

from .errors import BackendUnavailableError, ConfigurationError
from .session import Backend, LockSession, Row

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

__all__ = [
    "DEFAULT",
    "GROUP",
    "available",
    "connect_error",
    "driver_dsn",
    "fetch_row",
    "fetch_row_sync",
    "get",
    "refresh",
    "registered",
    "resolve",
    "transaction",
    "without_driver",
    "wrap_connection",
]

GROUP = "pgleaderlock.backends"
"""The entry-point group backends are registered in."""
DEFAULT = "psycopg"
"""The backend used when neither a name nor the DSN chooses one."""

# pip extras of the built-in backends, for the "install ..." hint.
_EXTRAS = {"psycopg": "pgleaderlock", "asyncpg": "pgleaderlock[asyncpg]",
           "sqlalchemy": "pgleaderlock[sqlalchemy]"}  # fmt: skip

_SCHEME = re.compile(r"^(?P<base>postgres(?:ql)?)\+(?P<driver>[A-Za-z0-9_]+)://", re.I)


@cache
def _entry_points() -> dict[str, EntryPoint]:
    from importlib.metadata import entry_points  # slow to import: on first use

    return {ep.name: ep for ep in entry_points(group=GROUP)}


def refresh() -> None:
    """Forget what was discovered and loaded, so that the next call reads the entry
    points again (after installing a backend into a running interpreter, or in tests)."""
    _load.cache_clear()
    _entry_points.cache_clear()


def registered() -> list[str]:
    """Names of every registered backend, importable here or not.

    Returns:
        The entry-point names of group ``pgleaderlock.backends``, sorted.
    """
    return sorted(_entry_points())


def _install_hint(name: str, ep: EntryPoint) -> str:
    hint = _EXTRAS.get(name)
    if hint is None and ep.dist is not None:
        hint = ep.dist.name
    return hint or f"the package providing {name!r}"


@cache
def _load(name: str) -> Backend:
    eps = _entry_points()
    if name not in eps:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; registered backends: {', '.join(registered()) or 'none'}"
            f" (installed and importable: {', '.join(available()) or 'none'})"
        )
    ep = eps[name]
    try:
        backend = ep.load()
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {name!r} needs a driver that is not installed ({exc}); "
            f"install it with: pip install '{_install_hint(name, ep)}'"
        ) from exc
    except Exception as exc:  # a broken third-party backend must not break the others
        raise BackendUnavailableError(
            f"backend {name!r} ({ep.value}) failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(backend, Backend):
        raise BackendUnavailableError(
            f"entry point {name!r} of group {GROUP!r} gave {backend!r}, not a Backend"
        )
    if backend.name != name:
        raise BackendUnavailableError(
            f"entry point {name!r} of group {GROUP!r} gave a Backend named "
            f"{backend.name!r}; the names must match"
        )
    return backend


def get(name: str) -> Backend:
    """The backend called ``name``, imported on first use.

    Args:
        name: a registered backend name (``"psycopg"``, ``"asyncpg"``, ...).

    Returns:
        The [`Backend`][pgleaderlock.Backend] its entry point names.

    Raises:
        BackendUnavailableError: unknown name, or its driver is not installed (the
            message names the pip extra to install).
    """
    return _load(name)


def available() -> list[str]:
    """Names of the backends whose driver is importable here (each is imported to find
    out).

    Returns:
        The registered backends that load, sorted.
    """
    names = []
    for name in registered():
        try:
            _load(name)
        except BackendUnavailableError:
            continue
        names.append(name)
    return names


def resolve(name: str | None, dsn: object) -> tuple[Backend, object]:
    """Pick the backend for ``dsn`` and return it with the DSN its driver understands.

    An explicit ``name`` wins; else a ``postgresql+DRIVER://`` scheme names the backend
    (the ``+DRIVER`` part is removed); else a backend that claims a non-string ``dsn``
    (a SQLAlchemy ``AsyncEngine``); else the default, psycopg. See the module docstring
    for the details.

    Args:
        name: the ``backend=`` the user gave, or ``None``.
        dsn: the ``dsn`` the user gave: a string, or an object a backend claims.

    Returns:
        The backend, and the DSN to hand to its ``check_dsn`` and ``connect``.

    Raises:
        ConfigurationError: no usable DSN, or a DSN scheme that names another backend
            than ``name``.
        BackendUnavailableError: unknown backend or missing driver.
    """
    if name is not None and not isinstance(name, str):
        raise ConfigurationError(f"backend must be a name (str), got {name!r}")
    if dsn is None:
        raise ConfigurationError("a DSN is required when connect_fn is not given")
    if not isinstance(dsn, str):
        for candidate in [name] if name is not None else available():
            backend = get(candidate)
            if backend.claims is not None and backend.claims(dsn):
                return backend, dsn
        raise ConfigurationError(
            f"dsn must be a connection string (or an object a backend accepts, such as a "
            f"SQLAlchemy AsyncEngine), got {type(dsn).__name__}; pass connect_fn= to "
            "open sessions yourself"
        )
    if not dsn.strip():
        raise ConfigurationError("a DSN is required when connect_fn is not given")
    match = _SCHEME.match(dsn)
    if name is not None:
        backend = get(name)
        if match is not None and not _claims(backend, dsn):  # sqlalchemy takes it whole
            driver = match.group("driver").lower()
            if driver != name.lower():
                raise ConfigurationError(
                    f"the DSN scheme {match.group('base')}+{driver}:// asks for backend "
                    f"{driver!r}, but backend={name!r} was given; drop one of the two"
                )
        return backend, driver_dsn(backend, dsn, named=True)
    if match is None:
        return get(DEFAULT), dsn
    driver = match.group("driver").lower()
    if driver not in _entry_points():
        raise BackendUnavailableError(
            f"the DSN scheme {match.group('base')}+{driver}:// names backend {driver!r}, "
            f"which is not registered; registered backends: {', '.join(registered())}"
        )
    backend = get(driver)
    return backend, driver_dsn(backend, dsn, named=False)


def _claims(backend: Backend, dsn: object) -> bool:
    return backend.claims is not None and backend.claims(dsn)


def driver_dsn(backend: Backend, dsn: object, *, named: bool) -> object:
    """The DSN that [`resolve`][pgleaderlock.core.registry.resolve] hands to `backend`.

    The `+DRIVER` part of a `postgresql+DRIVER://` scheme chose the backend and is
    removed, unless the backend was asked for by name and takes the string as it is (the
    sqlalchemy backend with `postgresql+asyncpg://`). Anything but a string is unchanged.

    Args:
        backend: the backend chosen for `dsn`.
        dsn: the DSN the user gave.
        named: the backend was asked for by name (`backend=`), not by the DSN.

    Returns:
        What to hand to the backend's `check_dsn` and `connect`.
    """
    if not isinstance(dsn, str) or (named and _claims(backend, dsn)):
        return dsn
    return without_driver(dsn)


def without_driver(dsn: str) -> str:
    """`dsn` without the `+DRIVER` part of a `postgresql+DRIVER://` scheme, if any."""
    match = _SCHEME.match(dsn)
    return dsn if match is None else f"{match.group('base')}://{dsn[match.end() :]}"


def wrap_connection(obj: object) -> LockSession:
    """Adapt what a ``connect_fn`` returned.

    Args:
        obj: a LockSession, or a raw driver connection (psycopg ``AsyncConnection``,
            asyncpg ``Connection``, SQLAlchemy ``AsyncConnection``, or whatever a
            third-party backend's ``wrap`` accepts).

    Returns:
        ``obj`` itself if it is a LockSession, else the first available backend's
        session over it.

    Raises:
        ConfigurationError: no available backend takes ``obj``, or the one that does
            refuses it (a pooled connection).
    """
    if isinstance(obj, LockSession):
        return obj
    for name in available():
        session = _load(name).wrap(obj)
        if session is not None:
            return session
    raise ConfigurationError(
        f"connect_fn returned {type(obj).__module__}.{type(obj).__qualname__}, which is "
        f"neither a LockSession nor a connection of an installed backend ({', '.join(available())})"
    )


async def fetch_row(conn: object, template: str, values: tuple[object, ...]) -> Row | None:
    """Run one statement on a connection of the caller's, inside the caller's transaction
    (the first available backend that knows the connection's type does it).

    Args:
        conn: the caller's connection.
        template: the statement, its parameters numbered ``{0}``, ``{1}``, ...
        values: the parameters.

    Returns:
        The first row, or ``None``.

    Raises:
        ConfigurationError: no installed backend knows ``conn``, or it is not in a
            transaction.
    """
    for name in _knowing(conn):
        fetch = _load(name).fetch_row
        pending = None if fetch is None else fetch(conn, template, values)
        if pending is not None:
            return await pending
    raise _unknown_connection(conn)


def transaction(conn: object) -> AbstractAsyncContextManager[object]:
    """A transaction on a connection of the caller's, for ``async with`` (a savepoint
    when the connection is in a transaction already): ``conn.transaction()`` of psycopg
    and asyncpg, ``begin()`` (or ``begin_nested()``) of SQLAlchemy.

    Raises:
        ConfigurationError: no installed backend knows ``conn``.
    """
    for name in _knowing(conn):
        begin = _load(name).transaction
        found = None if begin is None else begin(conn)
        if found is not None:
            return found
    raise _unknown_connection(conn)


def fetch_row_sync(conn: object, template: str, values: tuple[object, ...]) -> Row | None:
    """[`fetch_row`][pgleaderlock.core.registry.fetch_row] for a synchronous connection."""
    for name in _knowing(conn):
        fetch = _load(name).fetch_row_sync
        found = None if fetch is None else fetch(conn, template, values)
        if found is not None:
            return found[0]
    raise _unknown_connection(conn)


def _knowing(conn: object) -> Iterator[str]:
    """The backends to ask about a caller's connection, lazily: first the one named like
    the connection's package (``psycopg``, ``asyncpg``, ``sqlalchemy``), if registered
    and importable, so that a fence does not import every installed driver (SQLAlchemy
    takes a second or more) on the event loop; then the other available ones."""
    package = type(conn).__module__.partition(".")[0]
    first = None
    if package in _entry_points():
        try:
            _load(package)
        except BackendUnavailableError:
            pass
        else:
            first = package
            yield package
    yield from (name for name in available() if name != first)


def _unknown_connection(conn: object) -> ConfigurationError:
    return ConfigurationError(
        f"got a {type(conn).__module__}.{type(conn).__qualname__} connection; fencing takes a "
        "psycopg AsyncConnection (or Connection with the threaded lock), an asyncpg "
        "Connection, or a SQLAlchemy AsyncConnection or AsyncSession"
    )


def connect_error(exc: BaseException) -> Exception | None:
    """The library error for a driver error raised inside a ``connect_fn`` (the first
    available backend that knows it), or ``None``."""
    for name in available():
        classify = _load(name).connect_error
        found = None if classify is None else classify(exc)
        if found is not None:
            return found
    return None
