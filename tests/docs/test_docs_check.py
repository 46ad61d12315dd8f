"""The docs check can fail (issue 31).

``scripts/test.sh`` used to run ``mkdocs build --strict --quiet``: ``--quiet`` drops the
warnings before strict mode counts them, so a broken cross-reference (shown on the page
as raw ``[...][...]`` text) passed. The check is now ``scripts/docs_check.sh``, run by
``scripts/test.sh``, ``make docs-check`` and the ``site_dir`` fixture alike. Here it runs
on the repository's tree, which must pass with no warning, and on a copy of the tree
with one broken reference planted, which must fail and name it. No browser.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Final

from support.docs_check import REPO, DocsBuild, run_docs_check

PLANTED: Final = "pgleaderlock.NoSuchThing"


def test_the_docs_check_passes_on_the_tree_with_no_warning(docs_build: DocsBuild) -> None:
    assert docs_build.returncode == 0, docs_build.output
    assert "WARNING" not in docs_build.output, docs_build.output
    assert "built strictly, no warning" in docs_build.output
    assert (docs_build.site / "index.html").is_file()


def test_a_broken_cross_reference_fails_the_docs_check(tmp_path: Path) -> None:
    # The docs tree and mkdocs.yml, copied; the source (mkdocstrings reads it, through
    # the config's `paths: [src]`) linked, read-only.
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    shutil.copy2(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "src").symlink_to(REPO / "src", target_is_directory=True)
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + f"\nSee [x][{PLANTED}].\n")

    build = run_docs_check(tmp_path / "mkdocs.yml", tmp_path / "site")

    assert build.returncode != 0, build.output
    warnings = [line for line in build.output.splitlines() if line.startswith("WARNING")]
    # The planted reference, and only it: the copy is otherwise the passing tree.
    assert len(warnings) == 1, build.output
    assert f"index.md: Could not find cross-reference target '{PLANTED}'" in warnings[0]
    assert "Aborted with 1 warnings in strict mode" in build.output
    assert "the strict build FAILED" in build.output


def test_the_suite_and_the_makefile_run_the_docs_check_without_quiet() -> None:
    for runner in (REPO / "scripts" / "test.sh", REPO / "Makefile"):
        assert "scripts/docs_check.sh" in runner.read_text(), runner
    # No mkdocs build in a script with --quiet/-q: it would hide the warnings again.
    for path in (REPO / "Makefile", *(REPO / "scripts").glob("*.sh")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"mkdocs\S*\s.*\bbuild\b", code):
                assert not re.search(r"\s(--quiet|-q)\b", code), f"{path}:{number}: {line}"
