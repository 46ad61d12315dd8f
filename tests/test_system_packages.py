"""scripts/_system.sh, the Debian packages of some test tiers: installed only when
missing, only as root, only with apt-get, never upgrading anything, and never with
``PGLEADERLOCK_TEST_APT=0``; otherwise the tiers skip with the reason. Run against fake
``id`` and ``apt-get`` on PATH that log every call (nothing is installed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MISSING = "pgl-no-such-package:pgl-no-such-command"

# apt-get -s prints the plan; "Inst NAME [OLD] (NEW ...)" is an upgrade.
_PLAN = {
    "new": "Inst pgl-no-such-package (1.0 Debian:12/stable [amd64])",
    "upgrade": "Inst libc6 [2.36-9] (2.36-9+deb12u9 Debian:12/stable [amd64])\\n"
    "Inst pgl-no-such-package (1.0 Debian:12/stable [amd64])",
}


def system_packages(
    tmp_path: Path, *, uid: int, apt: str | None = None, plan: str = "new"
) -> tuple[int, str, str, list[str]]:
    """Runs ``system_packages`` for a missing package; returns its status, stdout,
    stderr and the apt-get calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    (bin_dir / "id").write_text(f'#!/bin/sh\n[ "$1" = -u ] && echo {uid} || /usr/bin/id "$@"\n')
    (bin_dir / "apt-get").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        f'case "$*" in *-s\\ install*) printf "{_PLAN[plan]}\\n";; esac\nexit 0\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if apt is not None:
        env["PGLEADERLOCK_TEST_APT"] = apt
    # (No case here gets as far as the install itself, which writes policy-rc.d.)
    script = f"source {ROOT / 'scripts' / '_system.sh'}\nsystem_packages 'a test tier' {MISSING}\n"
    result = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    logged = calls.read_text().splitlines() if calls.exists() else []
    return result.returncode, result.stdout, result.stderr, logged


def test_not_root_installs_nothing_and_says_why(tmp_path: Path) -> None:
    code, out, _, calls = system_packages(tmp_path, uid=1000)
    assert code == 1
    assert (
        out.strip() == "pgl-no-such-package missing, and not root, so apt-get cannot install them"
    )
    assert calls == []


@pytest.mark.parametrize("value", ["0", "no"])
def test_the_opt_out_installs_nothing_even_as_root(tmp_path: Path, value: str) -> None:
    code, out, _, calls = system_packages(tmp_path, uid=0, apt=value)
    assert code == 1
    assert f"PGLEADERLOCK_TEST_APT={value} forbids installing" in out
    assert calls == []


def test_as_root_a_plan_that_upgrades_anything_installs_nothing(tmp_path: Path) -> None:
    code, out, err, calls = system_packages(tmp_path, uid=0, plan="upgrade")
    assert code == 1
    assert "would upgrade installed packages (libc6); not installed" in out
    assert "installing Debian packages pgl-no-such-package" in err  # said first
    assert [c for c in calls if c.startswith(("install", "-y"))] == []
    assert not any(" install " in f" {c} " and "-s" not in c for c in calls), calls
