"""``manage.py pgleaderlock_dashboard [--host ADDRESS] [--port PORT] [--group-name
GROUP:NAME ...]``: the read-only web page of who leads what
(`pgleaderlock.dashboard`, the guide "The dashboard") for the database of
``settings.PGLEADERLOCK`` (its alias in ``DATABASES``, its ``fencing_schema`` or ledger
schema and its ``trusted_roles``). It runs ``pgleaderlock dashboard`` with them: the
dashboard extra is needed (``pip install 'pgleaderlock[dashboard]'``)."""

from __future__ import annotations

import argparse
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from pgleaderlock._exitcodes import EXIT_OK, EXIT_USAGE
from pgleaderlock.integrations.django.conf import build_dsn, load


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints
    help = (
        "Serve a read-only web page of who leads what (locks, groups, semaphores, "
        "schedules), live, on 127.0.0.1:8800 unless --host/--port say otherwise."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--host``, ``--port``, ``--group-name`` (repeatable), ``--interval``,
        ``--timeout``."""
        parser.add_argument("--host", default="127.0.0.1", metavar="ADDRESS")
        parser.add_argument("--port", default="8800", metavar="PORT")
        parser.add_argument("--group-name", action="append", default=[], metavar="GROUP:NAME")
        parser.add_argument("--interval", default="1", metavar="SECONDS")
        parser.add_argument("--timeout", default="5", metavar="SECONDS")

    def handle(self, *args: Any, **options: Any) -> None:
        """Run ``pgleaderlock dashboard`` until SIGINT/SIGTERM."""
        try:
            settings = load()
            dsn = build_dsn(settings.database)
            runs, _ = settings.ledger_tables()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        from pgleaderlock.cli import run_cli

        argv = ["dashboard", "--dsn", dsn, "--schema", runs.schema,
                "--host", options["host"], "--port", str(options["port"]),
                "--interval", str(options["interval"]),
                "--timeout", str(options["timeout"])]  # fmt: skip
        for role in runs.trusted_roles:
            argv += ["--trusted-role", role]
        for given in options["group_name"]:
            argv += ["--group-name", given]
        code = run_cli(argv)  # its errors are on stderr already, one line, masked
        if code != EXIT_OK:
            raise SystemExit(code)
