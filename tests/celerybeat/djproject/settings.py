"""Settings of the test project: the database ``DJANGO_DB_NAME`` on the server of
``PG_DSN`` (host, port, user and password are taken from the DSN)."""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_dsn = conninfo_to_dict(os.environ["PG_DSN"])

SECRET_KEY = "pgleaderlock-tests-only"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["DJANGO_DB_NAME"],
        "HOST": str(_dsn.get("host", "127.0.0.1")),
        "PORT": str(_dsn.get("port", "5432")),
        "USER": str(_dsn.get("user", "postgres")),
        "PASSWORD": str(_dsn.get("password", "")),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DJANGO_CELERY_BEAT_TZ_AWARE = True
