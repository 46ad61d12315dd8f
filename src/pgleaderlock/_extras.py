"""The error raised when an optional dependency (an extra) is not installed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["missing_extra", "needs_extra"]


def missing_extra(what: str, needs: str, extra: str, error: ImportError) -> ImportError:
    """The error for ``what``, which needs ``needs`` from ``pgleaderlock[extra]``: one line,
    with the import error and the install command. Raise it ``from error``."""
    return ImportError(
        f"{what} needs {needs} ({error}); install it with: pip install 'pgleaderlock[{extra}]'"
    )


@contextlib.contextmanager
def needs_extra(what: str, needs: str, extra: str) -> Iterator[None]:
    """``with needs_extra(what, needs, extra):`` around the imports of an extra, first in
    the module that needs it: an ``ImportError`` in the block is raised again as
    ``missing_extra``'s one line (from the import error)."""
    try:
        yield
    except ImportError as exc:
        raise missing_extra(what, needs, extra, exc) from exc
