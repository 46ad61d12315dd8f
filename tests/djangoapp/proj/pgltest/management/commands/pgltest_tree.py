"""``pgltest_tree --probe PATH --dir DIR --tag TAG``: run ``tree_probe.py`` (the tests'
``support/tree_probe.py``) in this process: check that the trees earlier probes recorded
are gone, start a child, a ``setsid`` child and a double-forked orphan, record them (and
this process), and sleep (``--leave``: return, leaving them running)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):  # type: ignore[misc]
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--probe", required=True)
        parser.add_argument("--dir", required=True)
        parser.add_argument("--tag", required=True)
        parser.add_argument("--sleep", type=float, default=30.0)
        parser.add_argument("--leave", action="store_true", help="Return at once.")

    def handle(self, *args: Any, **options: Any) -> None:
        spec = importlib.util.spec_from_file_location("tree_probe", options["probe"])
        assert spec is not None
        assert spec.loader is not None
        probe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(probe)
        probe.main(Path(options["dir"]), options["tag"], options["sleep"], not options["leave"])
