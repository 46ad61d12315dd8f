"""What a lock may publish as ``metadata``, checked where it enters (the constructor)
and again where it is read back (another process's row is untrusted input).

A document is accepted when it is a JSON object that every reader can represent: keys
are strings, values are objects, arrays, strings, finite numbers, booleans or ``null``;
no string (or key) holds a NUL or a lone surrogate (PostgreSQL's ``jsonb`` refuses
both), it is nested at most ``METADATA_MAX_DEPTH`` deep, and it is at most
``METADATA_MAX_BYTES`` as JSON. The checks walk the document without recursion, so no
document makes them raise ``RecursionError``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .errors import ConfigurationError
from .participants import METADATA_MAX_BYTES

__all__ = ["METADATA_MAX_BYTES", "METADATA_MAX_DEPTH", "check_metadata", "read_metadata"]

METADATA_MAX_DEPTH = 32
"""How deeply a ``metadata`` document may nest objects and arrays."""


def _problem(document: object) -> str | None:
    """Why ``document`` is not JSON every reader can represent (``None``: it is)."""
    stack: list[tuple[object, int, str]] = [(document, 1, "metadata")]
    nodes = 0
    while stack:
        value, depth, where = stack.pop()
        nodes += 1
        if nodes > METADATA_MAX_BYTES:  # each value is at least one byte of JSON
            return f"it has more than {METADATA_MAX_BYTES} values"
        if isinstance(value, str):
            text = _text_problem(value)
            if text is not None:
                return f"{where} {text}"
        elif value is None or isinstance(value, bool | int):
            continue
        elif isinstance(value, float):
            if not math.isfinite(value):
                return f"{where} is {value!r}: JSON has no NaN or infinity"
        elif isinstance(value, Mapping | list | tuple):
            if depth > METADATA_MAX_DEPTH:
                return f"{where} nests deeper than {METADATA_MAX_DEPTH} levels"
            if isinstance(value, Mapping):
                for key, item in value.items():
                    if not isinstance(key, str):
                        return f"{where} has a key that is not a string: {key!r:.60}"
                    text = _text_problem(key)
                    if text is not None:
                        return f"a key of {where} {text}"
                    stack.append((item, depth + 1, f"{where}[{key[:40]!r}]"))
            else:
                stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))
        else:
            return f"{where} is a {type(value).__name__}, not a JSON value"
    return None


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "contains a NUL character"
    try:
        text.encode()
    except UnicodeEncodeError:
        return "contains a lone surrogate (not UTF-8)"
    return None


def check_metadata(metadata: Mapping[str, Any] | None) -> str | None:
    """``metadata`` as JSON text (``None`` stays ``None``).

    Raises:
        ConfigurationError: not a JSON object every reader can represent (see the
            module), or larger than ``METADATA_MAX_BYTES`` as JSON.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise ConfigurationError(f"metadata must be a mapping (a JSON object), got {metadata!r}")
    problem = _problem(metadata)
    if problem is not None:
        raise ConfigurationError(f"metadata must be plain JSON: {problem}")
    try:
        text = json.dumps(metadata, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:  # e.g. an int of more than 4,300 digits
        raise ConfigurationError(f"metadata must be JSON-serialisable: {exc}") from None
    size = len(text.encode())
    if size > METADATA_MAX_BYTES:
        raise ConfigurationError(f"metadata is {size} bytes as JSON; at most {METADATA_MAX_BYTES}")
    return text


def read_metadata(text: str) -> tuple[Mapping[str, Any] | None, str | None]:
    """A published ``metadata`` document (JSON text, as another process wrote it):
    ``(document, None)``, or ``(None, why)`` when it cannot be represented (too deep,
    a non-finite number, ...). A JSON value that is not an object comes back as
    ``{"value": value}``. Never raises."""
    if len(text.encode()) > METADATA_MAX_BYTES:
        return None, f"it is larger than {METADATA_MAX_BYTES} bytes"
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return None, f"it cannot be read: {type(exc).__name__}"
    problem = _problem(value)
    if problem is not None:
        return None, problem
    return (value if isinstance(value, dict) else {"value": value}), None
