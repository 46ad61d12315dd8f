"""Fixtures for the Django app's tests: the tests' project (``proj/``), run for real in
subprocesses (``python manage.py ...``), each with the settings it needs; the database
is the shared test server (``pg_dsn``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import django  # noqa: F401 - the test extra installs it: a missing Django fails here
import pytest

PROJECT = Path(__file__).parent / "proj"
ROOT = Path(__file__).parents[2]

Manage = Callable[..., subprocess.CompletedProcess[str]]
Spawn = Callable[..., subprocess.Popen[str]]


def project_env(dsn: str, settings: dict[str, Any] | None = None) -> dict[str, str]:
    """The environment of a ``manage.py`` run: the test DSN and settings overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["PGLEADERLOCK_TEST_DSN"] = dsn
    env["PGLEADERLOCK_TEST_SETTINGS"] = json.dumps(settings or {})
    env["DJANGO_SETTINGS_MODULE"] = "settings"
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT), str(ROOT / "src")])
    return env


@pytest.fixture
def python_in_project(pg_dsn: str) -> Manage:
    """``python_in_project(*args, settings=None)``: run ``python args`` in the project's
    folder and environment (Django not set up: the script calls ``django.setup()``)."""

    def run(*args: str, settings: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            env=project_env(pg_dsn, settings),
            cwd=PROJECT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run


@pytest.fixture
def manage(pg_dsn: str) -> Manage:
    """``manage(*args, settings=None, timeout=60)``: run ``manage.py args`` to its end."""

    def run(
        *args: str, settings: dict[str, Any] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(PROJECT / "manage.py"), *args],
            env=project_env(pg_dsn, settings),
            cwd=PROJECT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def spawn(pg_dsn: str) -> Iterator[Spawn]:
    """``spawn(*args, settings=None)``: start ``manage.py args`` (stdout and stderr
    piped); every process still running at the end is killed and reaped."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, settings: dict[str, Any] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, str(PROJECT / "manage.py"), *args],
            env=project_env(pg_dsn, settings),
            cwd=PROJECT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
