"""``pgltest_work --out FILE [--sleep S] [--exit N]``: append ``start <pid>`` to FILE,
sleep, append ``end <pid>`` (or ``interrupted <pid> <what>`` if something stopped it;
``--stubborn``: and sleep on), then exit with N (``SystemExit``)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from django.core.management.base import BaseCommand


def note(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as out:
        out.write(line + "\n")


class Command(BaseCommand):  # type: ignore[misc]
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", required=True)
        parser.add_argument("--sleep", type=float, default=0.0)
        parser.add_argument("--exit", type=int, default=0)
        parser.add_argument("--busy", action="store_true", help="Spin instead of sleeping.")
        parser.add_argument(
            "--stubborn", action="store_true", help="Note an interruption, then sleep on."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        out, pid = options["out"], os.getpid()
        note(out, f"start {pid}")
        try:
            deadline = time.monotonic() + options["sleep"]
            # Not ``while time.monotonic() < deadline:`` with this body: on CPython
            # 3.13.0 an exception that a signal handler raises in that loop escapes this
            # try (seen with _thread.interrupt_main; 3.11 and 3.12 catch it).
            while True:
                if time.monotonic() >= deadline:
                    break
                if not options["busy"]:
                    time.sleep(max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            note(out, f"interrupted {pid} {type(exc).__name__}")
            if not options["stubborn"]:
                raise
            time.sleep(max(0.0, deadline - time.monotonic()))
        note(out, f"end {pid}")
        self.stdout.write(f"worked {pid}")
        if options["exit"]:
            raise SystemExit(options["exit"])
