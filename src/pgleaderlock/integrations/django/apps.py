"""The app's configuration: ``manage.py check`` reports bad ``PGLEADERLOCK`` settings."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from .conf import load

__all__ = ["PgLeaderLockConfig", "check_settings"]


class PgLeaderLockConfig(AppConfig):  # type: ignore[misc]  # Django has no type hints
    """``pgleaderlock.integrations.django``: the label is ``pgleaderlock``."""

    name = "pgleaderlock.integrations.django"
    label = "pgleaderlock"
    verbose_name = "pgleaderlock"
    default = True

    def ready(self) -> None:
        """Register the settings check (it runs with ``manage.py check`` and before the
        commands that check the project)."""
        checks.register(check_settings)


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """``settings.PGLEADERLOCK`` and its database, as a system check: one error
    (``pgleaderlock.E001``) with the ``ImproperlyConfigured`` message, or none."""
    try:
        load()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="pgleaderlock.E001")]
    return []
