"""The backend registry: driver adapters found through the entry-point group
``pgleaderlock.backends``.

A backend is a :class:`~pgleaderlock.core.session.Backend` object. The built-in ones
are declared in pgleaderlock's own ``pyproject.toml``; a third-party distribution
registers its own the same way::

    [project.entry-points."pgleaderlock.backends"]
    mydriver = "mypackage.pgleaderlock_backend:backend"

Backends are imported lazily, when first asked for, so a missing optional driver only
matters to the lock that wants it.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.metadata import EntryPoint, entry_points

from ..core.errors import BackendUnavailableError, ConfigurationError
from ..core.session import Backend, LockSession

__all__ = ["DEFAULT", "available", "get", "registered", "resolve", "wrap_connection"]

GROUP = "pgleaderlock.backends"
DEFAULT = "psycopg"

# pip extras of the built-in backends, for the "install ..." hint.
_EXTRAS = {"psycopg": "pgleaderlock", "asyncpg": "pgleaderlock[asyncpg]",
           "sqlalchemy": "pgleaderlock[sqlalchemy]"}  # fmt: skip

_SCHEME = re.compile(r"^(?P<base>postgres(?:ql)?)\+(?P<driver>[A-Za-z0-9_]+)://", re.I)


@cache
def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def registered() -> list[str]:
    """Names of every registered backend, importable here or not."""
    return sorted(_entry_points())


@cache
def _load(name: str) -> Backend:
    eps = _entry_points()
    if name not in eps:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; registered backends: {', '.join(registered()) or 'none'}"
        )
    try:
        backend = eps[name].load()
    except ImportError as exc:
        hint = _EXTRAS.get(name)
        dist = eps[name].dist
        install = hint or (dist.name if dist is not None else f"the package providing {name!r}")
        raise BackendUnavailableError(
            f"backend {name!r} needs a driver that is not installed ({exc}); "
            f"install it with: pip install '{install}'"
        ) from exc
    if not isinstance(backend, Backend):
        raise BackendUnavailableError(
            f"entry point {name!r} of group {GROUP!r} gave {backend!r}, not a Backend"
        )
    return backend


def get(name: str) -> Backend:
    """The backend called ``name``.

    Raises:
        BackendUnavailableError: unknown name, or its driver is not installed (the
            message names the pip extra to install).
    """
    return _load(name)


def available() -> list[str]:
    """Names of the backends whose driver is importable here."""
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
    (a SQLAlchemy ``AsyncEngine``); else the default, psycopg.

    Raises:
        ConfigurationError: no usable DSN.
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
    driver_dsn = dsn
    if match:
        driver_dsn = f"{match.group('base')}://{dsn[match.end() :]}"
        if name is None:
            name = match.group("driver").lower()
    return get(name or DEFAULT), driver_dsn


def wrap_connection(obj: object) -> LockSession:
    """Adapt what a ``connect_fn`` returned: a LockSession, or a raw driver connection."""
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
