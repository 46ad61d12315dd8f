"""The make targets work in a fresh clone: a target that runs a tool from ``.venv``
installs into ``.venv`` first (``scripts/install.sh``; ``test`` and ``demo`` install in
their own scripts), instead of failing with "No such file or directory"."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Scripts that make .venv and install into it themselves.
INSTALLING = ("./scripts/install.sh", "./scripts/test.sh", "./scripts/demo.sh")
# Scripts that run tools from .venv without installing.
USING = ("./scripts/docs_check.sh",)


def recipes(makefile: str) -> dict[str, list[str]]:
    """Each target's recipe lines, in order."""
    found: dict[str, list[str]] = {}
    target = None
    for line in makefile.splitlines():
        if line.startswith("\t") and target is not None:
            found[target].append(line.strip())
        elif match := re.match(r"^([A-Za-z][\w-]*):", line):
            target = match.group(1)
            found[target] = []
        else:
            target = None
    return found


def uninstalled_uses(makefile: str) -> list[str]:
    """Targets whose recipe uses ``.venv`` before anything has installed into it."""
    offenders = []
    for target, lines in recipes(makefile).items():
        for line in lines:
            if line.startswith(INSTALLING):
                break
            if ".venv/bin/" in line or line.startswith(USING):
                offenders.append(f"{target}: {line}")
                break
    return offenders


def test_every_target_installs_before_it_uses_the_venv() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert uninstalled_uses(makefile) == []
    assert {"test", "demo", "lint", "docs", "docs-check"} <= set(recipes(makefile))


def test_the_check_sees_a_target_that_would_fail_in_a_fresh_clone() -> None:
    broken = "lint:  ## ruff\n\t.venv/bin/ruff check src\ndocs-check:\n\t./scripts/docs_check.sh\n"
    assert uninstalled_uses(broken) == [
        "lint: .venv/bin/ruff check src",
        "docs-check: ./scripts/docs_check.sh",
    ]
