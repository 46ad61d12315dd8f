"""A minimal Django project for the app's tests.

The database is the test server: ``PGLEADERLOCK_TEST_DSN`` (a libpq DSN, parsed into
``DATABASES``). ``PGLEADERLOCK_TEST_SETTINGS`` (JSON) overrides any setting, so that
each test runs the project in a subprocess with the settings it needs.
"""

from __future__ import annotations

import json
import os
from typing import Any

from psycopg.conninfo import conninfo_to_dict

_params = conninfo_to_dict(os.environ.get("PGLEADERLOCK_TEST_DSN", ""))

SECRET_KEY = "pgleaderlock-tests"
USE_TZ = True
INSTALLED_APPS = ["pgleaderlock.integrations.django", "pgltest"]
DATABASES: dict[str, Any] = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _params.pop("dbname", "postgres"),
        "USER": _params.pop("user", ""),
        "PASSWORD": _params.pop("password", ""),
        "HOST": _params.pop("host", ""),
        "PORT": _params.pop("port", ""),
        "OPTIONS": _params,
    }
}
PGLEADERLOCK: dict[str, Any] = {}

globals().update(json.loads(os.environ.get("PGLEADERLOCK_TEST_SETTINGS", "{}")))
