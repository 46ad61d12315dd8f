"""Help, bad input and error reporting of the console script."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.clitools import CLI, clean_env, python_m

pytestmark = pytest.mark.timeout(60)

UNREACHABLE = "postgresql://app:s3cr3t-pw@127.0.0.1:1/app?connect_timeout=2"


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(**(env or {})),
        check=False,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert ": error: " in lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_main_help_lists_commands_examples_and_exit_codes() -> None:
    result = run("--help")
    assert result.returncode == 0
    for text in (
        "run",
        "acquire",
        "exec",
        "status",
        "Examples:",
        "Exit codes:",
        "75",
        "76",
        "$PG_DSN",
    ):
        assert text in result.stdout, text
    assert run().stdout == result.stdout  # no arguments: the same help, exit 0


@pytest.mark.parametrize(
    ("command", "must_mention"),
    [
        ("run", ["--key1", "--key2", "--health-interval", "--retry-base", "--retry-max",
                 "--reconnect-grace", "--no-auto-reacquire", "--name", "--backend",
                 "--follower-mode", "PGLEADERLOCK_DSN", "PG_DSN]", "SIGTERM", "Examples:"]),
        ("acquire", ["--wait", "--hold", "exit 0 if acquired, 1", "Examples:"]),
        ("exec", ["COMMAND", "--wait", "--kill-after", "--held-exit-code", "75", "76",
                  "Examples:", "flock"]),
        ("status", ["--all", "--json", "--timeout", "pg_locks", "Examples:"]),
    ],
)  # fmt: skip
def test_command_help(command: str, must_mention: list[str]) -> None:
    result = run(command, "--help")
    assert result.returncode == 0, result.stderr
    for text in must_mention:
        assert text in result.stdout, f"{command} --help lacks {text!r}"


def test_python_dash_m_works() -> None:
    result = python_m("pgleaderlock.cli", "--version", timeout_s=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pgleaderlock, version ")


@pytest.mark.parametrize("command", ["run", "acquire", "status"])
def test_no_dsn(command: str) -> None:
    assert_one_line_error(run(command, "--name", "x"), "no DSN", "PGLEADERLOCK_DSN or PG_DSN")


def test_the_dsn_variables_in_their_order() -> None:
    """``PGLEADERLOCK_DSN`` (as Celery beat reads it), before ``PG_DSN``."""
    result = run("status", "--name", "x", env={"PGLEADERLOCK_DSN": UNREACHABLE})
    assert_one_line_error(result, "cannot connect", "127.0.0.1:1")
    both = {"PGLEADERLOCK_DSN": UNREACHABLE, "PG_DSN": "postgresql://nobody@127.0.0.1:2/x"}
    assert_one_line_error(run("status", "--name", "x", env=both), "127.0.0.1:1")


def test_exec_without_dsn_does_not_run_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = run("exec", "--name", "x", "--", "touch", str(marker))
    assert_one_line_error(result, "no DSN")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--key1", "1", "--key2", "2147483648"],
            "--key2=2147483648 is outside the signed 32-bit range",
        ),
        (["--key1", "-2147483649", "--key2", "0"], "--key1=-2147483649 is outside"),
        (["--key1", "1"], "--key1 and --key2 go together"),
        ([], "which lock?"),
        (["--name", "x", "--key1", "1", "--key2", "2"], "either --name or --key1/--key2"),
        (["--name", ""], "lock name must be a non-empty string"),
        (["--key1", "one", "--key2", "2"], "'one' is not a valid integer"),
        (["--name", "x", "--health-interval", "0"], "health_interval_s must be a positive"),
        (["--name", "x", "--retry-base", "5", "--retry-max", "1"], "max_s (1.0) must be >= base_s"),
        (["--name", "x", "--backend", "nosuchdriver"], "unknown backend 'nosuchdriver'"),
        (["--name", "x", "--follower-mode", "sometimes"], "'sometimes' is not one of"),
    ],
)
def test_bad_input_for_run(args: list[str], fragment: str) -> None:
    assert_one_line_error(run("run", "--dsn", UNREACHABLE, *args), fragment)


def test_status_all_refuses_a_lock_identity() -> None:
    assert_one_line_error(run("status", "--dsn", UNREACHABLE, "--all", "--name", "x"), "--all")


def test_exec_needs_a_command() -> None:
    assert_one_line_error(run("exec", "--dsn", UNREACHABLE, "--name", "x"), "COMMAND")


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:s3cr3t-pw@db/app?nosuchoption=1",
        "postgresql://app:s3cr3t-pw@[::1/db",
        "host=db password=s3cr3t-pw port=5432 = x",
    ],
)
@pytest.mark.parametrize("command", ["run", "acquire", "status"])
def test_malformed_dsn_is_reported_without_the_password(command: str, dsn: str) -> None:
    result = run(command, "--dsn", dsn, "--name", "x")
    assert_one_line_error(result, "malformed DSN")
    assert "s3cr3t-pw" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["run", "--name", "x"],
        ["acquire", "--name", "x"],
        ["exec", "--name", "x", "--", "true"],
        ["status", "--name", "x"],
        ["status", "--all", "--json"],
    ],
)
def test_unreachable_server_is_a_one_line_error_without_the_password(args: list[str]) -> None:
    result = run(*args, env={"PG_DSN": UNREACHABLE})
    assert_one_line_error(
        result,
        "error: cannot connect to the database: ",
        "DSN: postgresql://app:***@127.0.0.1:1/app?connect_timeout=2",
    )
    assert "s3cr3t-pw" not in result.stderr


def test_missing_cli_extra_names_it() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["click"] = None  # as if pgleaderlock[cli] were not installed
        import pgleaderlock.cli
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 1
    assert "pip install 'pgleaderlock[cli]'" in result.stderr.splitlines()[-1]


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a black-holed server)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"postgresql://app:s3cr3t-pw@127.0.0.1:{listener.getsockname()[1]}/app"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--name", "x", "--connect-timeout", "1"], "no answer within 1 s"),
        (["acquire", "--name", "x", "--connect-timeout", "1"], "no answer within 1 s"),
        (["exec", "--name", "x", "--connect-timeout", "1", "--", "true"], "no answer within 1 s"),
        (["status", "--name", "x", "--timeout", "1"], "timeout"),
    ],
)
def test_a_silent_server_is_bounded_by_the_timeout(
    silent_server: str, args: list[str], message: str
) -> None:
    started = time.monotonic()
    result = run(*args, env={"PG_DSN": silent_server})
    elapsed = time.monotonic() - started
    assert_one_line_error(result, "cannot connect to the database: ", message)
    assert 0.9 < elapsed < 10
    assert "s3cr3t-pw" not in result.stderr
