"""The layout rules, checked on the source: the decision engine does no I/O, the core
imports no driver or outer layer, no module but the machine sets a state, and the rules
written once (retry delays, permanent errors, defaults) stay written once."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import pgleaderlock

PACKAGE = Path(pgleaderlock.__file__).resolve().parent
CORE = PACKAGE / "core"
MACHINE = CORE / "machine"

LOWLEVEL = PACKAGE / "lowlevel.py"
OUTSIDE = sorted(
    path.name
    for path in PACKAGE.iterdir()
    if path.name not in ("core", LOWLEVEL.name)
    and (path.suffix == ".py" or (path / "__init__.py").is_file())
)
"""Every package and module of ``pgleaderlock`` outside the core and its low-level layer
(read from the tree, so that a new one is checked too)."""
OUTER = (*(Path(name).stem for name in OUTSIDE if name != "__init__.py"), "lowlevel")
DRIVERS = ("psycopg", "asyncpg", "sqlalchemy", "psycopg2")
IO = ("asyncio", "socket", "selectors", "threading", "subprocess", *DRIVERS)


def modules(root: Path) -> Iterator[Path]:
    yield from sorted(root.rglob("*.py"))


def imported(path: Path, source: str | None = None) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative ones resolved); of
    ``source`` instead of the file's text, if given, read as if it were at ``path``."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    names: set[str] = set()
    text = path.read_text() if source is None else source
    for node in ast.walk(ast.parse(text, str(path))):
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
    assert "pgleaderlock.core.performer.CallPerformer" in imported(CORE / "runner.py")
    assert "pgleaderlock.core.calls.CallGuard" in imported(CORE / "performer.py")
    assert "pgleaderlock.core.machine.table.step" in imported(MACHINE / "engine.py")
    assert any("_state" in line for line in (MACHINE / "engine.py").read_text().splitlines())


def calls(path: Path, attribute: str) -> list[int]:
    """Lines of ``path`` that call a method or function named ``attribute``, outside a
    definition of a method of that name (a strategy that wraps another may ask it)."""
    tree = ast.parse(path.read_text(), str(path))
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == attribute:
            inside.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == attribute and node.lineno not in inside:
                found.append(node.lineno)
    return found


def test_one_retry_delay_rule_and_one_permanence_rule() -> None:
    """Strategies are asked through ``core.retry.ask`` only, and whether an error is
    permanent is decided by ``core.machine.is_permanent`` only: no copy outside the
    core drifts from the lock's own rule."""
    offenders = []
    for path in modules(PACKAGE):
        where = path.relative_to(PACKAGE)
        if path != CORE / "retry.py":
            offenders += [f"{where}:{line} asks a strategy" for line in calls(path, "next_delay_s")]
        if not path.is_relative_to(MACHINE) and "NON_RETRYABLE" in path.read_text():
            offenders.append(f"{where} decides permanence itself (NON_RETRYABLE)")
    assert offenders == []
    assert calls(CORE / "retry.py", "next_delay_s")  # the scan sees what it looks for


def test_the_lock_and_the_coordinator_default_as_lock_config_does() -> None:
    """Defaults are written once: the option groups' fields hold the rest, and the
    specification's flat arguments default alike in every entry point and in
    ``lock_config``; the Coordinator's locks default as a lock's."""
    from pgleaderlock import Coordinator, LeaderLock, LockOptions, Semaphore
    from pgleaderlock.core.config import lock_config

    config = inspect.signature(lock_config).parameters
    flat = ("health_interval_s", "reconnect_grace_s", "auto_reacquire")
    entries = (
        LeaderLock.__init__,
        LeaderLock.from_name,
        Semaphore.__init__,
        Semaphore.from_name,
        Coordinator.__init__,
    )
    for entry in entries:
        parameters = inspect.signature(entry).parameters
        shown = {n: parameters[n].default for n in flat if n in parameters}
        assert shown == {n: config[n].default for n in shown}, entry
        assert "health_timeout_s" not in parameters
    coordinator = Coordinator("postgresql://h/db", group="g")
    lock = LeaderLock("postgresql://h/db", 1, 2, options=LockOptions(load_plugins=False))
    assert coordinator._settings.config == lock._config
    assert lock._config.connect_budget_s is not None  # the DSN's, set by connection_target
    assert dataclasses.replace(lock._config, connect_budget_s=None) == lock_config()


COORDINATION = PACKAGE / "coordination"
BACKENDS = PACKAGE / "backends"


def crossings(path: Path, source: str | None = None) -> list[str]:
    """The imports of ``path`` (or of ``source`` read as if it were ``path``) that reach
    into the core other than through ``pgleaderlock.lowlevel``'s exported names."""
    import pgleaderlock.lowlevel as lowlevel

    found = []
    for name in sorted(imported(path, source)):
        parts = name.split(".")
        into_core = parts[:2] == ["pgleaderlock", "core"]
        unexported = parts[:2] == ["pgleaderlock", "lowlevel"] and (
            len(parts) > 3 or (len(parts) == 3 and parts[2] not in lowlevel.__all__)
        )
        if into_core or unexported:
            found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


@pytest.mark.parametrize("outside", OUTSIDE)
def test_outside_the_core_every_core_name_comes_from_the_lowlevel_layer(outside: str) -> None:
    """Every package and module outside the core (the backends too: a third-party
    backend must be writable from the documented layer, so the built-in ones are) takes
    the core's names from ``pgleaderlock.lowlevel``, and only names it exports: never
    ``pgleaderlock.core`` or one of its modules, never a private name. Only
    ``lowlevel.py`` imports the core (its ``__all__`` is the one list). The core may
    change behind that layer, and a name an outer layer needs is exported and
    documented there, not reached for."""
    root = PACKAGE / outside
    paths = list(modules(root)) if root.is_dir() else [root]
    assert paths
    assert [found for path in paths for found in crossings(path)] == []
    if outside == "__init__.py":  # its lazy names are strings, not imports
        import pgleaderlock

        assert not [m for m in pgleaderlock._LAZY.values() if m.startswith(".core")]


def test_the_layer_check_sees_what_it_looks_for() -> None:
    """The check covers the outer layers, sees their imports, and fails on a broken one."""
    assert {"integrations", "cli", "plugins", "health.py", "threaded.py", "schedule"} <= set(
        OUTSIDE
    )
    assert {"backends", "coordination", "status", "testing", "__init__.py"} <= set(OUTSIDE)
    assert "pgleaderlock.lowlevel.SessionSlot" in imported(COORDINATION / "membership.py")
    assert "pgleaderlock.lowlevel.run_on_session" in imported(PACKAGE / "schedule" / "scheduler.py")
    module = PACKAGE / "integrations" / "fastapi" / "leader.py"
    broken = {
        "from ...core.errors import ConfigurationError": "pgleaderlock.core.errors",
        "from ...core import ConfigurationError": "pgleaderlock.core",
        "import pgleaderlock.core.lock": "pgleaderlock.core.lock",
        "from ...lowlevel import _private": "pgleaderlock.lowlevel._private",
    }
    for source, name in broken.items():
        found = crossings(module, module.read_text() + source + "\n")
        assert f"integrations/fastapi/leader.py imports {name}" in found, source
    assert "lowlevel.py imports pgleaderlock.core" in crossings(LOWLEVEL)


@pytest.mark.parametrize(
    ("layer", "also"), [("coordination", ()), ("schedule", ("pgleaderlock.tasks",))]
)
def test_the_coordinator_and_the_scheduler_build_on_the_layer_alone(
    layer: str, also: tuple[str, ...]
) -> None:
    """The Coordinator and the Scheduler build on ``pgleaderlock.lowlevel`` (the
    Scheduler also on ``LeaderTasks``), never on another outer layer: neither can grow a
    copy of what another hides."""
    offenders = []
    for path in modules(PACKAGE / layer):
        for name in imported(path):
            parts = name.split(".")
            if parts[0] != "pgleaderlock" or len(parts) < 2 or parts[1] in (layer, "lowlevel"):
                continue
            if not any(name == a or name.startswith(a + ".") for a in also):
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert offenders == []
    assert "pgleaderlock.tasks.LeaderTasks" in imported(PACKAGE / "schedule" / "scheduler.py")


def documented(module: ModuleType) -> list[str]:
    """The names the docstring of ``pgleaderlock.lowlevel`` lists, by theme."""
    themes = (module.__doc__ or "").split("Names, by theme:", 1)[-1]
    return re.findall(r"(?<!`)`([A-Za-z_][A-Za-z0-9_]*)`(?!`)", themes)


def test_the_lowlevel_layer_is_the_cores_list_resolved_documented_and_used() -> None:
    """``pgleaderlock.lowlevel`` exports ``pgleaderlock.core.__all__`` (the one list),
    every name resolves to the core's object, its docstring lists each name once under
    a theme and lists nothing else, and no name is dead surface: each is imported by at
    least one module outside the core (a name kept for third-party code only would need
    a reason here)."""
    import pgleaderlock.core as core
    import pgleaderlock.lowlevel as lowlevel

    names = lowlevel.__all__
    assert names is core.__all__
    assert len(names) == len(set(names))
    assert [n for n in names if getattr(lowlevel, n) is not getattr(core, n)] == []
    namespace: dict[str, object] = {}
    exec("from pgleaderlock.lowlevel import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(names)
    listed = documented(lowlevel)
    assert sorted(listed) == sorted(names), set(listed) ^ set(names)
    used = {
        name.split(".")[2]
        for path in modules(PACKAGE)
        if not path.is_relative_to(CORE) and path != LOWLEVEL
        for name in imported(path)
        if name.startswith("pgleaderlock.lowlevel.")
    }
    assert sorted(set(names) - used) == []
    assert {"first_line", "get"} <= used  # the scan sees what it looks for


def test_no_backend_module_decides_a_policy() -> None:
    """Adapters speak SQL; what to run when is the core's: no backend remembers which
    tables it checked (a cache), and none chooses between ``pg_locks`` and the cheap
    probe (``holds()`` always asks ``pg_locks``; ``start_probe()`` is always cheap)."""
    offenders = []
    for path in modules(BACKENDS):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(PACKAGE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("_prepared", "_verified"):
                offenders.append(f"{where}:{node.lineno} keeps {node.attr}")
            if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and node.name == "holds":
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                attrs = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if "ALIVE" in names or "_alive" in attrs or "start_probe" in attrs:
                    offenders.append(f"{where}:{node.lineno} holds() chooses a cheaper probe")
    assert offenders == []


def timer_and_abort(path: Path) -> list[str]:
    """Classes and functions of ``path`` that arm a timer and drop a session: a call
    bound."""
    found = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef | ast.ClassDef):
            called = {
                n.func.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            }
            if called & {"call_later", "call_at"} and called & {"abort", "_abort"}:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    return found


def test_calls_are_bounded_by_the_core_only() -> None:
    """A database call is bounded by the core's ``CallGuard`` (through ``core.bounded``
    outside a lock's task): no other module arms a timer that drops a session."""
    offenders = [f for path in modules(PACKAGE) if not path.is_relative_to(CORE)
                 for f in timer_and_abort(path)]  # fmt: skip
    assert offenders == []
    assert timer_and_abort(CORE / "calls.py")  # the scan sees the one it allows


MEMBER_PARTS = ("settings", "session", "membership", "mailbox", "balancer", "watch")
ABOVE_THE_PARTS = ("member", "dedicated", "shared", "coordinator")


def test_the_members_parts_never_reach_back_into_the_engine() -> None:
    """A member's ``Engine`` (``coordination/member.py``) is composed of parts, each a
    class of its own module; a part knows the parts below it, never the engine, a
    session mode or the Coordinator (no part grows into a second engine)."""
    offenders = []
    for part in MEMBER_PARTS:
        for name in imported(COORDINATION / f"{part}.py"):
            parts = name.split(".")
            if parts[:2] == ["pgleaderlock", "coordination"] and parts[2:3] in [
                [above] for above in ABOVE_THE_PARTS
            ]:
                offenders.append(f"coordination/{part}.py imports {name}")
    assert offenders == []
    engine = imported(COORDINATION / "member.py")
    assert {f"pgleaderlock.coordination.{part}" for part in MEMBER_PARTS} <= engine


# What ``pgleaderlock.backends.base`` offered before it was split in layers (its
# ``__all__`` and the names it imported): third-party backends import them from there.
BASE_NAMES = (
    "ALIVE",
    "BaseSession",
    "CANCEL_TIMEOUT_S",
    "CLAIM",
    "CONNECTION_SQLSTATE_CLASSES",
    "ConnectOptions",
    "ConnectionError",
    "DUPLICATE_TABLE",
    "ErrorClass",
    "FLUSH_STATS",
    "FORGET",
    "FencedSessions",
    "GROUP_SNAPSHOT",
    "HOLDS",
    "IDENTIFY",
    "LOCK_NOT_AVAILABLE",
    "LibraryTable",
    "MissingPrivilegeError",
    "NOTIFY",
    "PgLeaderLockError",
    "REFUSED_SQLSTATES",
    "STATEMENTS",
    "SessionInfo",
    "SessionNotDedicatedError",
    "StandbyError",
    "Statement",
    "TABLE_CHECK",
    "TRY_LOCK",
    "TRY_LOCK_MANY",
    "TableCheck",
    "TermTable",
    "UNLOCK",
    "UNLOCK_MANY",
    "UnclaimedGrantError",
    "WAIT_LOCK",
    "bump_term_statement",
    "bump_terms_statement",
    "by_sqlstate",
    "check_pid",
    "check_target_session_attrs",
    "configure_statement",
    "create_terms_statement",
    "key_to_oid",
    "lock_timeout_ms",
    "misconfigured_by_message",
    "refused_by_message",
    "set_keepalive",
    "setup_statement",
    "sqlstate",
    "tcp_acknowledged",
    "translate",
)
BASE_LAYERS = ("base", "checked", "locking", "sockets", "sql", "errors")


def test_the_backend_base_keeps_its_names_and_imports_no_driver() -> None:
    """``BaseSession`` is built in layers (``checked``, ``locking``, ``base``), one idea
    to a module; every name ``backends.base`` offered stays importable from there, and
    none of the layers a third-party backend builds on imports a driver."""
    import pgleaderlock.backends.base as base

    assert [name for name in BASE_NAMES if not hasattr(base, name)] == []
    assert set(base.__all__) >= {"BaseSession", "tcp_acknowledged", "translate", "Statement"}
    assert base.BaseSession.__module__ == "pgleaderlock.backends.base"
    drivers = {
        f"{layer}.py imports {name}"
        for layer in BASE_LAYERS
        for name in imported(BACKENDS / f"{layer}.py")
        if name.split(".")[0] in DRIVERS
    }
    assert drivers == set()
    assert "pgleaderlock.backends.locking.LockingSession" in imported(BACKENDS / "base.py")


TESTING_NAMES = {
    "postgres": ("ThrowawayPostgres", "find_pg_bin"),
    "candidate": ("DSN_ENV", "MODULE", "CandidateEvent", "CandidateOptions",
                  "CandidateProcess", "candidate_command", "main", "parse_event",
                  "write_event"),
    "fake": ("FakeServer", "FakeSession", "FencedTransaction", "PROBES", "TERMS"),
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(TESTING_NAMES))
def test_the_public_testing_helpers_keep_their_import_paths(module: str) -> None:
    """The testing helpers are split one idea to a module (``pg_bin``, ``pg_process``,
    ``candidate_child``, ``candidate_protocol``, ``fake_session``), and users' tests
    import them from where they always did; none of those modules imports a driver."""
    import importlib

    found = importlib.import_module(f"pgleaderlock.testing.{module}")
    assert [name for name in TESTING_NAMES[module] if not hasattr(found, name)] == []
    testing = PACKAGE / "testing"
    drivers = [
        f"{path.name} imports {name}"
        for path in modules(testing)
        for name in imported(path)
        if name.split(".")[0] in DRIVERS
    ]
    assert drivers == []
