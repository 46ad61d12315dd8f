"""``manage.py pgleaderlock_singleton --name NAME [--no-wait] -- COMMAND [ARGS...]``."""

from __future__ import annotations

import argparse
import math
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from pgleaderlock.cli.exits import EXIT_HELD, EXIT_USAGE
from pgleaderlock.integrations.django.singleton import Singleton
from pgleaderlock.lowlevel import ConfigurationError, positive


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type hints
    help = (
        "Run a management command only on the replica that holds the lock NAME: the others "
        "wait (or exit 75 at once with --no-wait). Exit codes as `pgleaderlock exec`: the "
        "command's own; 75 held elsewhere; 76 leadership lost while it ran (it was "
        "interrupted); 2 bad input or settings, unreachable server; 127 unknown command; "
        "128+N stopped by signal N. On Linux, processes the command starts are ended "
        "before the lock is released (SIGKILL of this process included). Put -- before "
        "the command."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """``--name``, ``--wait``/``--no-wait``, ``--held-exit-code``, ``--kill-after``,
        ``--health-interval``, and the command after ``--``."""
        parser.add_argument("--name", required=True, help="The lock's name.")
        wait = parser.add_mutually_exclusive_group()
        wait.add_argument(
            "--wait",
            type=float,
            default=math.inf,
            metavar="SECONDS",
            help="Wait up to SECONDS for the lock if it is held elsewhere (default: forever).",
        )
        wait.add_argument(
            "--no-wait",
            action="store_true",
            help="One attempt: exit at once (75) if another replica holds the lock.",
        )
        parser.add_argument(
            "--held-exit-code",
            type=int,
            default=EXIT_HELD,
            metavar="CODE",
            help=f"Exit code when the lock is held elsewhere (default {EXIT_HELD}).",
        )
        parser.add_argument(
            "--kill-after",
            type=float,
            default=10.0,
            metavar="SECONDS",
            help="When leadership is lost, the command is interrupted; if it still runs "
            "after SECONDS, the process exits 76 (default 10). Also how long processes "
            "the command left running have between SIGTERM and SIGKILL.",
        )
        parser.add_argument(
            "--health-interval",
            type=float,
            default=5.0,
            metavar="SECONDS",
            help="Seconds between the lock's health probes while the command runs.",
        )
        parser.add_argument(
            "command",
            nargs=argparse.REMAINDER,
            help="The management command and its arguments, after --.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the singleton (see `pgleaderlock.integrations.django.singleton`)."""
        argv = list(options["command"])
        if argv[:1] == ["--"]:
            argv = argv[1:]
        wait_s = 0.0 if options["no_wait"] else float(options["wait"])
        if math.isnan(wait_s) or wait_s < 0:
            raise CommandError(f"--wait must be >= 0, got {wait_s:g}", returncode=EXIT_USAGE)
        for option in ("kill_after", "health_interval"):
            try:
                positive("--" + option.replace("_", "-"), float(options[option]))
            except ConfigurationError as exc:
                raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        if not 0 <= options["held_exit_code"] <= 255:
            raise CommandError("--held-exit-code must be 0..255", returncode=EXIT_USAGE)
        try:
            singleton = Singleton(
                name=options["name"],
                argv=argv,
                wait_s=wait_s,
                held_exit_code=options["held_exit_code"],
                kill_after_s=float(options["kill_after"]),
                health_interval_s=float(options["health_interval"]),
                stdout=getattr(self.stdout, "_out", None),
                stderr=getattr(self.stderr, "_out", None),
                verbosity=int(options["verbosity"]),
            )
        except ConfigurationError as exc:
            raise CommandError(str(exc), returncode=EXIT_USAGE) from None
        singleton.run()
