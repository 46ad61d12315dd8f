"""The README's summary keeps up with the package: its install line names every extra a
user installs, and its command-line summary every command."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Extras for the project's own work, not for users.
OWN = {"test", "docs", "bench", "pgserver"}


def install_block(readme: str) -> str:
    return readme.split("## Install", 1)[1].split("```", 2)[1]


def cli_summary(readme: str) -> str:
    return next(line for line in readme.splitlines() if line.startswith("- **CLI**"))


def test_the_install_line_names_every_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = set(re.findall(r"\[([a-z]+)\]", install_block((ROOT / "README.md").read_text())))
    assert set(extras["optional-dependencies"]) - OWN - named == set()


def test_the_cli_summary_names_every_command() -> None:
    from pgleaderlock.cli import cli

    summary = cli_summary((ROOT / "README.md").read_text())
    assert {name for name in cli.commands if f" {name}" not in summary} == set()


def test_the_checks_see_what_is_missing() -> None:
    old = "```bash\npip install 'pgleaderlock[asyncpg]'  # or [cli], [cron]\n```"
    assert set(re.findall(r"\[([a-z]+)\]", install_block("## Install\n\n" + old))) == {
        "asyncpg", "cli", "cron"
    }  # fmt: skip
    assert " doctor" not in cli_summary("- **CLI**: `pgleaderlock run | acquire | exec | status`")
