"""The error raised when an optional dependency (an extra) is not installed."""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(what: str, needs: str, extra: str, error: ImportError) -> ImportError:
    """The error for ``what``, which needs ``needs`` from ``pgleaderlock[extra]``: one line,
    with the import error and the install command. Raise it ``from error``."""
    return ImportError(
        f"{what} needs {needs} ({error}); install it with: pip install 'pgleaderlock[{extra}]'"
    )
