"""Fixtures of the docs tests: the strict docs check on the repository's tree
(``docs_build``, ``scripts/docs_check.sh`` as ``scripts/test.sh`` runs it), the site it
built (``site_dir``) and a headless Chromium (``chromium``) for the tests that look at it
in a browser: Debian's ``chromium`` driven by Playwright, loopback only
(`support.chromium`; the tests skip, with the reason, where none is installed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from playwright.sync_api import Browser, sync_playwright

from support.chromium import launch_options, require_chromium
from support.docs_check import DocsBuild, run_docs_check

REPO: Final = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def docs_build(tmp_path_factory: pytest.TempPathFactory) -> DocsBuild:
    """The docs check on the repository's own tree, run once per test session."""
    return run_docs_check(REPO / "mkdocs.yml", tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="session")
def site_dir(docs_build: DocsBuild) -> Path:
    """The docs site, built once per run by the strict docs check into a temp dir."""
    assert docs_build.returncode == 0, f"the docs check failed:\n{docs_build.output}"
    return docs_build.site


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """Headless Debian Chromium that cannot resolve any host name but 127.0.0.1."""
    executable = require_chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(**launch_options(executable))
        try:
            yield browser
        finally:
            browser.close()
