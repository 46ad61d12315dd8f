"""The public names: every package's ``__all__`` resolves, and ``import pgleaderlock``
loads only the package itself (its names are loaded on first use, see its ``__init__``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest

import pgleaderlock

HEAVY = (
    "asyncio",
    "importlib.metadata",
    "pluggy",
    "psycopg",
    "asyncpg",
    "sqlalchemy",
    "click",
    "pgleaderlock.core",
    "pgleaderlock.core.lock",
    "pgleaderlock.core.machine",
    "pgleaderlock.core.runner",
    "pgleaderlock.backends",
    "pgleaderlock.coordination",
    "pgleaderlock.schedule",
    "pgleaderlock.tasks",
    "pgleaderlock.threaded",
)
"""What a bare ``import pgleaderlock`` must not import: the library's machinery, the
drivers and the slow parts of the standard library it uses."""


def public_packages() -> list[str]:
    found = ["pgleaderlock"]
    for info in pkgutil.walk_packages(pgleaderlock.__path__, "pgleaderlock."):
        if info.ispkg and not any(part.startswith("_") for part in info.name.split(".")):
            found.append(info.name)
    return found


PACKAGES = public_packages()


def test_the_walk_finds_the_packages() -> None:
    assert {"pgleaderlock.core", "pgleaderlock.schedule", "pgleaderlock.testing"} <= set(PACKAGES)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_in_all_resolves(name: str) -> None:
    package = importlib.import_module(name)
    names = getattr(package, "__all__", [])
    assert len(names) == len(set(names)), f"{name}.__all__ lists a name twice"
    missing = [n for n in names if not hasattr(package, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    assert set(names) <= set(namespace)


def type_checking_imports(package: ModuleType) -> dict[str, str]:
    """What the package's ``if TYPE_CHECKING:`` block imports: {name: relative module}."""
    tree = ast.parse(inspect.getsource(package))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: "." * node.level + (node.module or "")
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_the_top_level_names_are_listed_once_for_each_reader() -> None:
    """``__all__`` (star imports, documentation), ``_LAZY`` (run time) and the
    ``TYPE_CHECKING`` imports (type checkers, IDEs) name the same things."""
    lazy = pgleaderlock._LAZY
    assert set(pgleaderlock.__all__) == {*lazy, "__version__"}
    assert type_checking_imports(pgleaderlock) == lazy
    for name, module in lazy.items():
        value = getattr(importlib.import_module(module, "pgleaderlock"), name)
        assert getattr(pgleaderlock, name) is value, name
    assert set(pgleaderlock.__all__) <= set(dir(pgleaderlock))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'LeaderLok'"):
        pgleaderlock.LeaderLok  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(pgleaderlock, "_LAZY_NOT_A_NAME")


def fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter (this one's environment); its stdout."""
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def test_a_bare_import_loads_nothing_heavy() -> None:
    """Nothing but the package itself: not even ``typing``."""
    out = fresh(
        "import sys\n"
        "before = set(sys.modules)\n"
        "import pgleaderlock\n"
        f"print(*[m for m in {HEAVY!r} if m in sys.modules])\n"
        "print(*sorted(set(sys.modules) - before))\n"
    )
    heavy, new = out.splitlines()
    assert heavy == "", f"import pgleaderlock imported {heavy}"
    assert new == "pgleaderlock"


def test_the_check_sees_what_it_looks_for() -> None:
    """The same probe after a name's first use finds the machinery it loaded."""
    out = fresh(
        "import sys\n"
        "import pgleaderlock\n"
        "pgleaderlock.LeaderLock\n"
        f"print(*[m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    assert {"asyncio", "pluggy", "pgleaderlock.core.lock"} <= set(out.split())


OUTSIDE_THE_TREE = {
    # A BaseException on purpose: ``except Exception`` in the command must not swallow
    # the loss of leadership.
    "pgleaderlock.integrations.django.singleton.Interrupted",
    # A bug in the library (the machine has no row for what happened), not a condition
    # to handle: a caller's ``except PgLeaderLockError`` must not retry past it.
    "pgleaderlock.core.machine.table.IllegalTransitionError",
}


def test_every_exported_error_is_in_the_error_tree() -> None:
    from pgleaderlock.core.errors import PgLeaderLockError

    seen: dict[str, type[BaseException]] = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        for attr in getattr(package, "__all__", []):
            value = getattr(package, attr)
            if isinstance(value, type) and issubclass(value, BaseException):
                seen[f"{value.__module__}.{value.__qualname__}"] = value
    assert {"pgleaderlock.schedule.scheduler.RunFailed", "pgleaderlock.PgLeaderLockError"} <= set(
        seen
    )
    outside = {n for n, cls in seen.items() if not issubclass(cls, PgLeaderLockError)}
    assert outside <= OUTSIDE_THE_TREE


def test_the_old_name_of_call_interrupted_is_an_alias() -> None:
    from pgleaderlock import core
    from pgleaderlock.core import calls

    assert core.Interrupted is calls.Interrupted is calls.CallInterrupted
