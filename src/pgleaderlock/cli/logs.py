"""Logging for the command line: one loguru sink on stderr for every line.

The library logs on the stdlib logger ``pgleaderlock``; `InterceptHandler` routes that
logger into loguru, so the library's lines and the CLI's own lines (logger name
``pgleaderlock.cli``) share one format and one destination. Everything goes to stderr:
stdout belongs to ``status`` output and to the command that ``exec`` runs.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import TYPE_CHECKING

from loguru import logger

from ..lowlevel import format_event

if TYPE_CHECKING:
    from loguru import Record

__all__ = ["CLI_LOGGER", "InterceptHandler", "configure_logging", "log", "setup_logging"]

CLI_LOGGER = "pgleaderlock.cli"
"""The logger name on the CLI's own lines (``extra["logger"]``)."""

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> | <level>{level: <7}</level> | "
    "<cyan>{extra[logger]}</cyan> | {message}"
)


class InterceptHandler(logging.Handler):
    """Routes stdlib log records (the library's ``pgleaderlock`` logger) into loguru."""

    def emit(self, record: logging.LogRecord) -> None:
        """Re-emit ``record`` through loguru, keeping its level and caller."""
        level: str | int
        try:
            level = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        frame: types.FrameType | None = logging.currentframe()
        depth = 2
        while frame is not None and frame.f_code.co_filename == logging.__file__:
            frame = frame.f_back
            depth += 1
        # The library's structured fields ride along for --log-json consumers.
        fields = getattr(record, "pgleaderlock", None)
        logger.bind(logger=record.name, pgleaderlock=fields).opt(
            depth=depth, exception=record.exc_info
        ).log(level, record.getMessage())


def configure_logging(
    level: str, *, library_level: str | None = None, json_lines: bool = False
) -> None:
    """Send the ``pgleaderlock`` stdlib logger and the CLI's own lines to stderr via loguru.

    Args:
        level: threshold of the CLI's own lines: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``.
        library_level: threshold of the library's lines (the stdlib logger); default
            ``level``.
        json_lines: one JSON object per line (loguru's ``serialize``) instead of text.
    """
    library_level = library_level or level
    stdlib = logging.getLogger("pgleaderlock")
    stdlib.handlers = [InterceptHandler()]
    stdlib.propagate = False
    stdlib.setLevel(library_level)  # the library's lines are filtered here
    cli_threshold = logger.level(level).no

    def keep(record: Record) -> bool:
        return bool(
            record["extra"].get("logger") != CLI_LOGGER or record["level"].no >= cli_threshold
        )

    logger.remove()
    logger.configure(extra={"logger": CLI_LOGGER})
    # diagnose=False: tracebacks must not print local variables (a DSN with a password).
    logger.add(
        sys.stderr,
        level=min(cli_threshold, logger.level(library_level).no),
        format=_FORMAT,
        filter=keep,
        serialize=json_lines,
        backtrace=False,
        diagnose=False,
    )


def setup_logging(cli: str, library: str, verbose: int, quiet: int, json_lines: bool) -> None:
    """Configure logging from a command's default thresholds and its ``-v``/``-q`` counts.

    Each ``-v`` lowers both thresholds one step (WARNING -> INFO -> DEBUG); ``-q`` raises
    them.
    """
    configure_logging(
        _level(cli, verbose, quiet),
        library_level=_level(library, verbose, quiet),
        json_lines=json_lines,
    )


def _level(base: str, verbose: int, quiet: int) -> str:
    index = _LEVELS.index(base) - verbose + quiet
    return _LEVELS[min(max(index, 0), len(_LEVELS) - 1)]


def log(level: str, event: str, /, **fields: object) -> None:
    """Log ``event key=value ...`` in the library's style: the fields are also in
    ``extra["pgleaderlock"]``, with the ``event`` and without ``None`` values, as on the
    library's records."""
    structured = {key: value for key, value in fields.items() if value is not None}
    logger.bind(pgleaderlock={"event": event, **structured}).opt(depth=1).log(
        level, format_event(event, fields)
    )
