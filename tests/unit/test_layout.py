"""The layout rules of DESIGN.md, checked on the source: the decision engine does no I/O,
the core imports no driver or outer layer, and no module but the machine sets a state."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pgleaderlock

PACKAGE = Path(pgleaderlock.__file__).resolve().parent
CORE = PACKAGE / "core"
MACHINE = CORE / "machine"

OUTER = ("backends", "integrations", "plugins", "cli", "coordination", "testing")
DRIVERS = ("psycopg", "asyncpg", "sqlalchemy", "psycopg2")
IO = ("asyncio", "socket", "selectors", "threading", "subprocess", *DRIVERS)


def modules(root: Path) -> Iterator[Path]:
    yield from sorted(root.rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative ones resolved)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_machine_imports_nothing_that_does_io() -> None:
    for path in modules(MACHINE):
        found = {name for name in imported(path) if name.split(".")[0] in IO}
        assert not found, f"{path.relative_to(PACKAGE)} imports {sorted(found)}"


def test_the_core_imports_no_driver_and_no_outer_layer() -> None:
    for path in modules(CORE):
        found = {
            name
            for name in imported(path)
            if name.split(".")[0] in DRIVERS
            or (name.startswith("pgleaderlock.") and name.split(".")[1] in OUTER)
        }
        assert not found, f"{path.relative_to(PACKAGE)} imports {sorted(found)}"


def test_only_the_machine_assigns_a_lock_state() -> None:
    """``LockState`` members are assigned (``x._state = S.LEADER`` and the like) in the
    machine module only; elsewhere they are compared or reported."""
    offenders = []
    for path in modules(PACKAGE):
        if path.is_relative_to(MACHINE):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr == "_state":
                        offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_the_checks_see_what_they_look_for() -> None:
    """The scans above must not pass because they read nothing."""
    assert "asyncio" in imported(CORE / "runner.py")
    assert "pgleaderlock.core.machine.table.step" in imported(MACHINE / "engine.py")
    assert any("_state" in line for line in (MACHINE / "engine.py").read_text().splitlines())
