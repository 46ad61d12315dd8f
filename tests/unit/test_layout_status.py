"""The status read model is the CLI's and Django's peer, below both: importing it (or
Django's ``pgleaderlock_status`` command, which renders it) loads no command-line or
terminal library. Each check runs in a fresh interpreter and looks at ``sys.modules``
after the imports, so an import made on the way (a package's ``__init__``) counts too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pgleaderlock

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(pgleaderlock.__file__).resolve().parent
CLI_ONLY = ("click", "rich", "loguru")
"""The command line's and the terminal's libraries (the cli and tui extras)."""

DJANGO_STATUS = (
    "pgleaderlock.integrations.django",
    "pgleaderlock.integrations.django.report",
    "pgleaderlock.integrations.django.management.commands.pgleaderlock_status",
)
"""Django's status path: the app, the report it renders, the command."""


def read_model_modules() -> list[str]:
    root = PACKAGE / "status"
    return sorted(
        ".".join(("pgleaderlock", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for path in root.rglob("*.py")
    )


def loaded_after_importing(names: list[str]) -> dict[str, list[str]]:
    """The CLI-only libraries in ``sys.modules`` of a fresh interpreter after it imported
    each of ``names``, in turn (by the first name that brought them in)."""
    body = f"""
        import importlib, json, sys
        found = {{}}
        for name in {names!r}:
            importlib.import_module(name)
            loaded = sorted(n for n in sys.modules if n.split(".")[0] in {CLI_ONLY!r})
            if loaded:
                found[name] = loaded
                break
        print(json.dumps(found))
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        check=True,
        capture_output=True,
        text=True,
        timeout=50,
    ).stdout
    found: dict[str, list[str]] = json.loads(out.splitlines()[-1])
    return found


def test_the_read_model_is_a_package_of_several_modules() -> None:
    # The checks below look at these: an empty list would pass them all.
    assert "pgleaderlock.status" in read_model_modules()
    assert len(read_model_modules()) > 3


def test_the_read_model_imports_no_cli_library() -> None:
    assert loaded_after_importing(read_model_modules()) == {}


def test_djangos_status_path_imports_no_cli_library() -> None:
    pytest.importorskip("django")
    assert loaded_after_importing(list(DJANGO_STATUS)) == {}


def test_the_check_sees_a_cli_library() -> None:
    # The command line itself loads them: the check is able to fail, and names the
    # module that brought them in.
    found = loaded_after_importing(["pgleaderlock.status", "pgleaderlock.cli"])
    assert list(found) == ["pgleaderlock.cli"]
    assert set(found["pgleaderlock.cli"]) >= {"click", "loguru"}
