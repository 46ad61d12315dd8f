"""Text that reaches a terminal, a log or ``application_name``: which characters a name
may not hold, and how a string another role wrote is shown.

Two rules, one per direction:

- **In**: a name the library is given (a lock's, a semaphore's, a worker's, a job's, an
  identity, an ``application_name``, a role) holds no character of the Unicode
  categories in `UNSAFE_CATEGORIES`: controls (``Cc``: NUL, ESC, CR, newline, the C1
  controls such as CSI U+009B and NEL U+0085), format characters (``Cf``: the bidi
  overrides such as U+202E, zero-width characters), surrogates (``Cs``), and line and
  paragraph separators (``Zl``, ``Zp``). Such a name could clear an operator's screen,
  forge a log line, or show one name while being another.
  [`check_name`][pgleaderlock.core.keys.check_name] applies it.
- **Out**: a string read from the database (written by whoever may write there) is
  shown by `printable`, which escapes every character that Python's
  ``str.isprintable`` refuses (the rule ``repr`` uses) as ``repr`` escapes it
  (``\\x1b``, ``\\u202e``), so nothing a row holds is interpreted by the terminal.
  `printable_tree` does so for a whole report, once, before any text renderer lays it
  out; JSON output needs none of it (JSON escapes control characters by itself).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Collection
from typing import Any

__all__ = ["UNSAFE_CATEGORIES", "first_line", "printable", "printable_tree", "unsafe_characters"]

UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""The Unicode general categories no name may hold: controls, format characters (bidi
overrides), surrogates, line and paragraph separators."""


def unsafe_characters(text: str) -> list[str]:
    """The characters of ``text`` in `UNSAFE_CATEGORIES`, in order (each once)."""
    if text.isprintable():  # every character of those categories is not printable
        return []
    found = (ch for ch in text if unicodedata.category(ch) in UNSAFE_CATEGORIES)
    return list(dict.fromkeys(found))


def printable(text: str) -> str:
    """``text`` with every character ``str.isprintable`` refuses escaped as ``repr``
    escapes it (``"\\x1b[2J"`` becomes ``"\\\\x1b[2J"``): safe to write to a terminal,
    and it still says what the string holds."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (`printable`: a server's message may quote
    another role's names), or its type name when it has none."""
    text = str(exc).strip()
    return printable(text.splitlines()[0]) if text else type(exc).__name__


def printable_tree(value: Any, documents: Collection[str] = ("metadata",)) -> Any:
    """``value`` (a report: dicts, lists, strings, numbers, datetimes) with every string
    (keys too) made `printable`; the values of the keys in ``documents`` (JSON documents
    another role wrote) become their JSON text, which escapes every control character."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {
            printable(str(k)): (
                json.dumps(v, sort_keys=True, default=str)
                if k in documents and v is not None and not isinstance(v, str)
                else printable_tree(v, documents)
            )
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [printable_tree(v, documents) for v in value]
    return value
