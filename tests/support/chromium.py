"""Debian's Chromium, for the tests that look at a page in a browser (tests/docs,
tests/dashboard) and for the dashboard's benchmark.

Playwright (the Python package, from the ``test`` extra) drives it through
``executable_path``: Playwright's own browser download is never used. `launch_options`
starts it headless and unable to resolve any host name but 127.0.0.1, so even a request
that got past a test's own blocking could not leave the machine.

When no Chromium is installed the browser tests skip, with the reason (`require_chromium`;
``scripts/test.sh`` installs it with apt-get when it runs as root, and passes on why it
could not in ``PGLEADERLOCK_TEST_CHROMIUM_MISSING``). That is the only skip: a Chromium
that is installed but fails to start is an error.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Final

import pytest

__all__ = [
    "LOOPBACK_ONLY",
    "chromium_unavailable_reason",
    "find_chromium",
    "launch_options",
    "require_chromium",
]

_MISSING_ENV: Final = "PGLEADERLOCK_TEST_CHROMIUM_MISSING"

LOOPBACK_ONLY: Final = ["--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
"""Chromium's arguments: every host name resolves to "not found" but 127.0.0.1."""


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


def require_chromium() -> Path:
    """The installed Chromium; where there is none the test skips, with the reason."""
    reason = chromium_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    found = find_chromium()
    assert found is not None
    return found


def launch_options(executable: Path) -> dict[str, Any]:
    """Playwright's ``chromium.launch`` keywords (sync or async API): ``executable``,
    headless, loopback only, a minute to start."""
    return {
        "executable_path": executable,
        "headless": True,
        "args": LOOPBACK_ONLY,
        "timeout": 60_000,
    }
