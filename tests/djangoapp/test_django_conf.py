"""The app's settings and the DSN it builds from DATABASES (each case runs the tests'
project in a subprocess with its own settings)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

Manage = Callable[..., subprocess.CompletedProcess[str]]

pytestmark = pytest.mark.timeout(120)

SECRET = "p@ss w'o\\rd=;:/?#%"
"""A password with every character a DSN could trip over."""


def conf(manage: Manage, settings: dict[str, Any]) -> dict[str, Any]:
    result = manage("pgltest_conf", settings=settings)
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def database(**entry: Any) -> dict[str, Any]:
    return {"default": {"ENGINE": "django.db.backends.postgresql", **entry}}


def test_dsn_from_databases_quotes_a_password_and_takes_a_unix_socket(manage: Manage) -> None:
    data = conf(
        manage,
        {
            "DATABASES": database(
                NAME="app db",
                USER="app",
                PASSWORD=SECRET,
                HOST="/var/run/postgresql",
                PORT=5433,
                OPTIONS={
                    "sslmode": "disable",
                    "options": "-c work_mem=64MB",
                    "isolation_level": 3,  # Django's own keys are left out
                    "server_side_binding": True,
                    "pool": {"min_size": 2},
                    "assume_role": "other",
                },
            )
        },
    )
    assert data["params"] == {
        "dbname": "app db",
        "user": "app",
        "password": SECRET,
        "host": "/var/run/postgresql",
        "port": "5433",
        "sslmode": "disable",
        "options": "-c work_mem=64MB",
    }
    assert SECRET not in data["lock"]


def test_dsn_of_another_alias_and_the_service_file(manage: Manage) -> None:
    data = conf(
        manage,
        {
            "DATABASES": {
                **database(NAME="main"),
                "locks": {"ENGINE": "django.db.backends.postgresql", "NAME": "",
                          "OPTIONS": {"service": "locks"}},
            },
            "PGLEADERLOCK": {"DATABASE": "locks", "OPTIONS": {"lease_s": 30}},
        },
    )  # fmt: skip
    assert data["database"] == "locks"
    assert data["params"] == {"service": "locks"}
    assert data["options"] == {"lease_s": 30}


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"PGLEADERLOCK": ["x"]}, "PGLEADERLOCK must be a dict"),
        ({"PGLEADERLOCK": {"LEASE": 3}}, "PGLEADERLOCK has unknown keys ['LEASE']"),
        ({"PGLEADERLOCK": {"DATABASE": "nope"}}, "'nope', which is not in DATABASES"),
        ({"PGLEADERLOCK": {"OPTIONS": {"lease": 3}}}, "not LeaderLock arguments: ['lease']"),
        ({"PGLEADERLOCK": {"OPTIONS": {"dsn": "x"}}}, "not LeaderLock arguments: ['dsn']"),
        ({"PGLEADERLOCK": {"OPTIONS": {"lease_s": -1}}}, "PGLEADERLOCK['OPTIONS']: lease_s"),
        ({"PGLEADERLOCK": {"LOCKS": "nightly"}}, "PGLEADERLOCK['LOCKS'] must be a list"),
        ({"PGLEADERLOCK": {"LEDGER": {"schema": "a b"}}}, "PGLEADERLOCK['LEDGER']"),
        ({"PGLEADERLOCK": {"LEDGER": {"table": "x"}}}, "LEDGER'] has unknown keys"),
        (
            {"DATABASES": {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}},
            "pgleaderlock needs a PostgreSQL database",
        ),
        ({"DATABASES": database(NAME="", PASSWORD=SECRET)}, "has no NAME"),
        ({"DATABASES": database(NAME="x", PASSWORD=SECRET, OPTIONS={"bogus": "1"})},
         "does not make a valid connection string"),
        ({"DATABASES": database(NAME="x", PASSWORD=SECRET, OPTIONS={"sslmode": ["a"]})},
         "'sslmode' must be a string or a number"),
    ],
)  # fmt: skip
def test_bad_settings_are_improperly_configured(
    manage: Manage, settings: dict[str, Any], message: str
) -> None:
    data = conf(manage, settings)
    assert message in data["error"], data["error"]
    assert SECRET not in data["error"]


def test_manage_py_check_reports_bad_settings(manage: Manage) -> None:
    result = manage("check", settings={"PGLEADERLOCK": {"OPTIONS": {"lease": 3}}})
    assert result.returncode == 1
    assert "pgleaderlock.E001" in result.stderr
    assert "not LeaderLock arguments: ['lease']" in result.stderr
    assert manage("check").returncode == 0


def test_import_without_django_names_the_extra() -> None:
    body = textwrap.dedent(
        """
        import sys
        sys.modules["django"] = None
        try:
            import pgleaderlock.integrations.django
        except ImportError as exc:
            print(exc)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", body], capture_output=True, text=True, timeout=60, check=True
    )
    assert "pgleaderlock.integrations.django needs Django" in result.stdout
    assert "pip install 'pgleaderlock[django]'" in result.stdout


def test_unix_socket_host_connects(manage: Manage, pg_dsn: str) -> None:
    params = conninfo_to_dict(pg_dsn)
    if params.get("host") not in ("127.0.0.1", "localhost") or not _socket_answers(pg_dsn):
        pytest.skip(
            "the test server is not on this machine, or answers on no unix socket in "
            "/var/run/postgresql (a server reached over TCP only): nothing to connect to"
        )
    settings = {
        "DATABASES": database(
            NAME=params.get("dbname", "postgres"),
            USER=params.get("user", ""),
            PASSWORD=params.get("password", ""),
            HOST="/var/run/postgresql",
            PORT=params.get("port", ""),
        )
    }
    result = manage("pgleaderlock_status", "--name", "django-socket-probe", settings=settings)
    assert result.returncode == 0, result.stderr
    assert "holder    none: the lock is free" in result.stdout


def _socket_answers(dsn: str) -> bool:
    import psycopg

    try:
        with psycopg.connect(dsn, host="/var/run/postgresql", connect_timeout=3):
            return True
    except psycopg.Error:
        return False
