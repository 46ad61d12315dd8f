"""Structured ``key=value`` logging on the stdlib logger ``pgleaderlock``."""

from __future__ import annotations

import enum
import logging
import re
from typing import Any

__all__ = ["StructuredLogger", "get_logger", "mask_dsn"]

_BARE = re.compile(r"^[A-Za-z0-9_.:/@+\-]+$")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _escape(char: re.Match[str]) -> str:
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char[0], f"\\x{ord(char[0]):02x}")


def _format_value(value: Any) -> str:
    if hasattr(value, "value") and hasattr(value, "name") and not isinstance(value, str):
        value = value.value  # enums log as their value: state=leader
    text = str(value)
    if text and _BARE.fullmatch(text):
        return text
    # Quoted, and one line whatever the value holds: a control character (a newline in
    # a name, say) is escaped, so that no value can forge a line of its own.
    quoted = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + _CONTROL.sub(_escape, quoted) + '"'


def format_event(event: str, fields: dict[str, Any]) -> str:
    """``event k1=v1 k2="v 2"``; ``None`` values are left out."""
    parts = [event]
    parts.extend(f"{k}={_format_value(v)}" for k, v in fields.items() if v is not None)
    return " ".join(parts)


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}  # fmt: skip


class StructuredLogger:
    """A thin wrapper that renders ``event key=value ...`` messages.

    The fields are also attached to the record as ``record.pgleaderlock``, a dict with
    the ``event`` and every field, for handlers that want them structured (a JSON
    formatter). Its values are JSON-serialisable: enums become their values, other
    objects that are not str, int, float, bool or None become ``str()``.
    """

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    @property
    def logger(self) -> logging.Logger:
        return self._logger

    def enabled(self, level: str) -> bool:
        """Would a record at ``level`` (``"debug"``, ``"info"``, ...) be handled? Lets a
        caller skip building the fields of a record nobody will see."""
        return self._logger.isEnabledFor(_LEVELS[level])

    def _log(
        self, level: int, event: str, fields: dict[str, Any], exc: BaseException | bool | None, /
    ) -> None:
        if not self._logger.isEnabledFor(level):
            return
        structured = {k: _json_value(v) for k, v in fields.items() if v is not None}
        self._logger.log(
            level,
            format_event(event, fields),
            exc_info=exc or None,
            extra={"pgleaderlock": {"event": event, **structured}},
            stacklevel=3,
        )

    def debug(self, event: str, /, *, exc: BaseException | None = None, **fields: Any) -> None:
        self._log(logging.DEBUG, event, fields, exc)

    def info(self, event: str, /, *, exc: BaseException | None = None, **fields: Any) -> None:
        self._log(logging.INFO, event, fields, exc)

    def warning(self, event: str, /, *, exc: BaseException | None = None, **fields: Any) -> None:
        self._log(logging.WARNING, event, fields, exc)

    def error(
        self,
        event: str,
        /,
        *,
        exc: BaseException | None = None,
        exc_info: bool = False,
        **fields: Any,
    ) -> None:
        self._log(logging.ERROR, event, fields, exc or exc_info)


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


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
