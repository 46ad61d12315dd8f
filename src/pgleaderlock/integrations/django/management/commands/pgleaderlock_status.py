"""``manage.py pgleaderlock_status [--name NAME ...] [--schedule PREFIX ...]
[--all-schedules] [--json]``."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import psycopg
from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from pgleaderlock._exitcodes import EXIT_USAGE
from pgleaderlock.integrations.django.conf import load
from pgleaderlock.integrations.django.report import build_report, render_report
from pgleaderlock.lowlevel import ConfigurationError, ConnectionError, first_line
from pgleaderlock.status.render import json_default


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints
    help = (
        "Show who holds the configured locks (PGLEADERLOCK['LOCKS'] and --name) and who "
        "waits for them, and the schedules in the ledger: spec, next slot, recent runs "
        "and their outcomes."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--name`` (repeatable), ``--runs``, ``--schedule``, ``--all-schedules``,
        ``--json``, ``--timeout``."""
        parser.add_argument(
            "--name",
            action="append",
            default=[],
            metavar="NAME",
            help="A lock to show besides PGLEADERLOCK['LOCKS'] (repeatable).",
        )
        parser.add_argument(
            "--runs", type=int, default=5, metavar="N", help="Runs shown per schedule."
        )
        parser.add_argument(
            "--schedule",
            action="append",
            default=[],
            metavar="PREFIX",
            help="Show only the schedules whose names (LOCK:JOB) start with PREFIX "
            "(repeatable; default: the schedules of the locks shown).",
        )
        parser.add_argument(
            "--all-schedules",
            action="store_true",
            help="Show every schedule in the ledger (other applications' too).",
        )
        parser.add_argument("--json", action="store_true", help="Print JSON (for scripts).")
        parser.add_argument(
            "--timeout",
            type=float,
            default=5.0,
            metavar="SECONDS",
            help="Connect timeout and statement timeout.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Print the report (see `pgleaderlock.integrations.django.report`)."""
        timeout = float(options["timeout"])
        if not (timeout > 0 and math.isfinite(timeout)):
            raise CommandError(f"--timeout must be > 0, got {timeout:g}", returncode=EXIT_USAGE)
        if options["runs"] < 0:
            raise CommandError("--runs must be >= 0", returncode=EXIT_USAGE)
        try:
            settings = load()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        names = list(dict.fromkeys([*settings.locks, *options["name"]]))
        try:
            report = build_report(
                settings,
                names,
                runs=options["runs"],
                timeout_s=timeout,
                schedules=options["schedule"],
                all_schedules=options["all_schedules"],
            )
        except (ConfigurationError, ConnectionError) as exc:  # one line, password masked
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        except psycopg.errors.QueryCanceled:
            raise CommandError(
                f"the status query took longer than {timeout:g} s", returncode=EXIT_USAGE
            ) from None
        except psycopg.Error as exc:
            raise CommandError(
                f"status query failed: {first_line(exc)}", returncode=EXIT_USAGE
            ) from None
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2, default=json_default))
        else:
            self.stdout.write(render_report(report))
