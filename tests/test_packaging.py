"""What the wheel ships: the package under ``src/`` and nothing else, with no test plumbing.

The wheel is built from ``src/pgleaderlock`` as it is (hatch, ``packages``), so checking
the source tree checks the wheel without building it. The test plumbing (TCP proxy,
network namespaces, the test-DSN chain) lives in ``tests/support`` instead.
"""

from __future__ import annotations

import pkgutil
import re
import tomllib
from pathlib import Path

import pgleaderlock
import pgleaderlock.testing

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "pgleaderlock"
PLUMBING = ("TcpProxy", "NetnsLink", "resolve_test_dsn", "dsn_to_url", "probe_server")


def test_the_wheel_is_the_package_under_src() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel = config["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["packages"] == ["src/pgleaderlock"]
    # No include/exclude/force-include: nothing needed is left out, nothing else goes in.
    assert set(wheel) == {"packages"}, wheel
    assert Path(pgleaderlock.__file__).resolve().parent == PACKAGE


def test_the_public_testing_package_holds_no_test_plumbing() -> None:
    package = Path(pgleaderlock.testing.__file__).parent
    modules = {m.name for m in pkgutil.iter_modules([str(package)])}
    # The four helpers and the modules they are made of (one idea to a file).
    assert modules == {
        "beliefs",
        "candidate", "candidate_child", "candidate_protocol",
        "fake", "fake_session",
        "postgres", "pg_bin", "pg_process",
    }  # fmt: skip
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        found = [name for name in PLUMBING if name in text]
        assert not found, f"{path.relative_to(ROOT)} mentions {found}"
        assert "import support" not in text, path
        assert "from support" not in text, path


def test_the_version_is_the_release_the_changelog_describes_first() -> None:
    """``__version__`` (which the wheel's metadata and ``--version`` read) is the
    CHANGELOG's newest section: every change since the last release is written under
    the version that ships it, not under an "Unreleased" heading above it."""
    from packaging.version import Version

    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\S+)", changelog, re.MULTILINE)
    assert releases, "no release section in CHANGELOG.md"
    assert releases[0] == Version(pgleaderlock.__version__).base_version, releases[:2]
    assert len(releases) == len(set(releases))
    assert "unreleased" not in releases[0].lower()
