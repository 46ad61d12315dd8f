"""Griffe extension: render the reST bits of the source's docstrings as Markdown.

The source's docstrings are Google style but cross-reference with Sphinx roles
(``:class:`~pgleaderlock.LockSession```), which Markdown would show verbatim. This turns
``:role:`~a.b.Name``` into ```Name``` and ``:role:`a.b.Name``` into ```a.b.Name```
(the leading ``~`` keeps only the last component, as in Sphinx), and a reST literal-block
marker (a line ending in ``::``) into a single colon: the indented block that follows is
already a code block in Markdown. Docs-only: the source is not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_LITERAL = re.compile(r"(?<=\S)::$", re.MULTILINE)
_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|data|attr|mod|exc|obj):`(~?)([^`]+)`")


def _replace(match: re.Match[str]) -> str:
    short, target = match.groups()
    if short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class RstRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        text = _ROLE.sub(_replace, obj.docstring.value)
        obj.docstring.value = _LITERAL.sub(":", text)
