"""``manage.py pgleaderlock_status`` shows the strings another role wrote (a schedule's
spec and job, a run's holder, outcome and detail) escaped, and
its ``--json`` keeps them exactly: the database is a throwaway cluster with the rows of
`support.hostile`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support.hostile import HOSTILE, LOCK, ROLES, SHOWN, WRITER, planted, unsafe
from support.server import prepared_cluster

pytestmark = [pytest.mark.integration, pytest.mark.throwaway, pytest.mark.timeout(120)]

Manage = Callable[..., Any]


@pytest.fixture(scope="module")
def pg_dsn() -> Iterator[str]:
    """This module's database (the project's fixtures take it): a throwaway cluster
    with the hostile rows."""
    with prepared_cluster(*ROLES) as pg, planted(pg.dsn):
        yield pg.dsn


def test_the_status_command_escapes_what_another_role_wrote(manage: Manage) -> None:
    settings = {"PGLEADERLOCK": {"OPTIONS": {"trusted_roles": [WRITER]}, "LOCKS": [LOCK]}}
    text = manage("pgleaderlock_status", settings=settings)
    assert text.returncode == 0, text.stderr
    assert unsafe(text.stdout) == []
    assert text.stdout.count(SHOWN) >= 5  # spec, job, holder, outcome, detail
    report = json.loads(manage("pgleaderlock_status", "--json", settings=settings).stdout)
    (item,) = report["ledger"]["items"]
    assert [item["spec"], *item["last_runs"][0].values()].count(HOSTILE) == 4
