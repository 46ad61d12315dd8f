"""Fixtures of the docs tests: the strict docs check on the repository's tree
(``docs_build``, ``scripts/docs_check.sh`` as ``scripts/test.sh`` runs it), the site it
built (``site_dir``) and a headless Chromium (``chromium``) for the tests that look at it
in a browser.

The browser is Debian's ``chromium`` driven by Playwright (the Python package, from the
``test`` extra) through ``executable_path``: Playwright's own browser download is never
used. When no Chromium is installed the browser tests skip, with the reason
(``scripts/test.sh`` installs it with apt-get when it runs as root, and passes on why it
could not in ``PGLEADERLOCK_TEST_CHROMIUM_MISSING``). That is the only skip: a Chromium
that is installed but fails to start is an error.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import pytest
from playwright.sync_api import Browser, sync_playwright

from support.docs_check import DocsBuild, run_docs_check

REPO: Final = Path(__file__).resolve().parents[2]
_MISSING_ENV: Final = "PGLEADERLOCK_TEST_CHROMIUM_MISSING"


def find_chromium() -> Path | None:
    """Debian's Chromium: ``CHROMIUM_BIN``, then ``chromium`` on ``PATH``, then /usr/bin."""
    env_bin = os.environ.get("CHROMIUM_BIN")
    if env_bin:
        return Path(env_bin) if os.access(env_bin, os.X_OK) else None
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return Path(found)
    candidate = Path("/usr/bin/chromium")
    return candidate if os.access(candidate, os.X_OK) else None


def chromium_unavailable_reason() -> str | None:
    """Why the browser tests cannot run here, or None when a Chromium is installed."""
    if find_chromium() is not None:
        return None
    why = os.environ.get(_MISSING_ENV, "").strip()
    return (
        "Chromium is not installed (no chromium on PATH or in /usr/bin)"
        + (f": {why}" if why else "")
        + "; scripts/test.sh installs it with apt-get when run as root"
    )


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
    """Headless Debian Chromium that cannot resolve any host name.

    ``--host-resolver-rules`` maps every name to "not found" except 127.0.0.1, so even a
    request that got past a test's own blocking could not leave the machine.
    """
    reason = chromium_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    executable = find_chromium()
    assert executable is not None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable,
            headless=True,
            args=["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"],
            timeout=60_000,
        )
        try:
            yield browser
        finally:
            browser.close()
