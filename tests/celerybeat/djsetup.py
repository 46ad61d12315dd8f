"""Run by the tests in a child process (Django is set up there, never in pytest's own):

- ``djsetup.py migrate``: create django-celery-beat's tables.
- ``djsetup.py every NAME SECONDS``: create or update the periodic task ``NAME`` (task
  ``beatapp.record`` with the argument NAME) on an interval of SECONDS.
- ``djsetup.py clocked NAME``: a periodic task on a clocked (one-off) schedule, which
  the leader scheduler cannot express: it is logged and left out.
- ``djsetup.py later NAME``: a periodic task on a 1 s interval that starts in a day
  (its ``start_time``): not yet scheduled, and not an error.
- ``djsetup.py remove NAME``: delete it.

The environment is ``beatapp``'s (``PG_DSN``, ``DJANGO_DB_NAME``,
``DJANGO_SETTINGS_MODULE=djproject.settings``).
"""

from __future__ import annotations

import datetime
import json
import sys

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.utils import timezone  # noqa: E402
from django_celery_beat.models import ClockedSchedule, IntervalSchedule, PeriodicTask  # noqa: E402


def main(argv: list[str]) -> None:
    command = argv[0]
    if command == "migrate":
        call_command("migrate", verbosity=0)
    elif command == "every":
        name, seconds = argv[1], int(argv[2])
        interval, _ = IntervalSchedule.objects.get_or_create(
            every=seconds, period=IntervalSchedule.SECONDS
        )
        PeriodicTask.objects.update_or_create(
            name=name,
            defaults={"task": "beatapp.record", "interval": interval, "args": json.dumps([name])},
        )
    elif command == "clocked":
        clocked = ClockedSchedule.objects.create(clocked_time=timezone.now())
        PeriodicTask.objects.create(
            name=argv[1],
            task="beatapp.record",
            clocked=clocked,
            one_off=True,
            args=json.dumps([argv[1]]),
        )
    elif command == "later":
        interval, _ = IntervalSchedule.objects.get_or_create(
            every=1, period=IntervalSchedule.SECONDS
        )
        PeriodicTask.objects.create(
            name=argv[1],
            task="beatapp.record",
            interval=interval,
            start_time=timezone.now() + datetime.timedelta(days=1),
            args=json.dumps([argv[1]]),
        )
    elif command == "remove":
        PeriodicTask.objects.filter(name=argv[1]).delete()
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
