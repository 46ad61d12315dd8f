"""Structured ``key=value`` logging on the stdlib logger ``pgleaderlock`` (spec §7)."""

from __future__ import annotations

import logging
import re
from typing import Any

__all__ = ["StructuredLogger", "get_logger", "mask_dsn"]

_BARE = re.compile(r"^[A-Za-z0-9_.:/@+\-]+$")


def _format_value(value: Any) -> str:
    if hasattr(value, "value") and hasattr(value, "name") and not isinstance(value, str):
        value = value.value  # enums log as their value: state=leader
    text = str(value)
    if text and _BARE.match(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def format_event(event: str, fields: dict[str, Any]) -> str:
    """``event k1=v1 k2="v 2"``; ``None`` values are left out."""
    parts = [event]
    parts.extend(f"{k}={_format_value(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)


class StructuredLogger:
    """A thin wrapper that renders ``event key=value ...`` messages.

    The rendered fields are also attached to the record as ``record.pgleaderlock``
    (a dict) for handlers that want them structured.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    @property
    def logger(self) -> logging.Logger:
        return self._logger

    def _log(self, level: int, event: str, fields: dict[str, Any], exc: bool, /) -> None:
        if not self._logger.isEnabledFor(level):
            return
        self._logger.log(
            level,
            format_event(event, fields),
            exc_info=exc,
            extra={"pgleaderlock": {"name": event, **fields}},
            stacklevel=3,
        )

    def debug(self, event: str, /, **fields: Any) -> None:
        self._log(logging.DEBUG, event, fields, False)

    def info(self, event: str, /, **fields: Any) -> None:
        self._log(logging.INFO, event, fields, False)

    def warning(self, event: str, /, **fields: Any) -> None:
        self._log(logging.WARNING, event, fields, False)

    def error(self, event: str, /, *, exc_info: bool = False, **fields: Any) -> None:
        self._log(logging.ERROR, event, fields, exc_info)


def get_logger(name: str = "pgleaderlock") -> StructuredLogger:
    """Return the structured wrapper around the stdlib logger ``name``."""
    return StructuredLogger(logging.getLogger(name))


_URL_PASSWORD = re.compile(
    r"(?P<head>[a-z][a-z0-9+.\-]*://[^:/?#@\s]*:)(?P<pw>[^@/?#\s]*)(?=@)", re.I
)
_KV_PASSWORD = re.compile(
    r"(?P<head>(?<![?&\w])password\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|\S+)", re.I
)
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)(?P<pw>[^&#\s]*)", re.I)


def mask_dsn(text: str) -> str:
    """Replace every password in ``text`` (URL, query-string or key=value form) by ``***``."""
    text = _URL_PASSWORD.sub(lambda m: m.group("head") + "***", text)
    text = _QUERY_PASSWORD.sub(lambda m: m.group("head") + "***", text)
    return _KV_PASSWORD.sub(lambda m: m.group("head") + "***", text)
