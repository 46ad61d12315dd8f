"""The docs check (``scripts/docs_check.sh``), run from the tests exactly as
``scripts/test.sh`` and ``make docs-check`` run it: ``mkdocs build --strict`` with its
warnings shown and counted, never ``--quiet``."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

REPO: Final = Path(__file__).resolve().parents[2]
DOCS_CHECK: Final = REPO / "scripts" / "docs_check.sh"
BUILD_TIMEOUT_S: Final = 300.0


@dataclass(frozen=True)
class DocsBuild:
    """One run of the docs check: its exit status, its output (stdout and stderr
    together, INFO lines left out by the script), and the site it built."""

    returncode: int
    output: str
    site: Path


def run_docs_check(config: Path, site: Path) -> DocsBuild:
    """Run the docs check on ``config`` (a mkdocs.yml; its docs and source paths are
    relative to its directory) with this interpreter's mkdocs, building into ``site``."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    assert mkdocs.is_file(), f"no mkdocs next to {sys.executable} (install the docs extra)"
    done = subprocess.run(
        ["bash", str(DOCS_CHECK), str(config), str(site)],
        env={**os.environ, "MKDOCS": str(mkdocs)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    return DocsBuild(done.returncode, done.stdout, site)
