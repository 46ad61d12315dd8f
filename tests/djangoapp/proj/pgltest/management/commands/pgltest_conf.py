"""``pgltest_conf``: print, as JSON, the DSN the app builds (as libpq parses it) and its
settings; or the ``ImproperlyConfigured`` message."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand
from psycopg.conninfo import conninfo_to_dict

from pgleaderlock.integrations.django import dsn, get_settings, lock


class Command(BaseCommand):  # type: ignore[misc]
    requires_system_checks: ClassVar[list[str]] = []

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            settings = get_settings()
            conninfo = dsn()
            made = lock("pgltest-conf", lease_s=20.0)
        except ImproperlyConfigured as exc:
            self.stdout.write(json.dumps({"error": str(exc)}))
            return
        self.stdout.write(
            json.dumps(
                {
                    "dsn": conninfo,
                    "params": conninfo_to_dict(conninfo),
                    "database": settings.database,
                    "options": dict(settings.options),
                    "lock": repr(made),
                }
            )
        )
