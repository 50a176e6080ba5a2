"""A griffe extension for the API reference (mkdocs.yml loads it by path).

The docstrings are written for people reading the source and ``help()``:
Sphinx-style roles (``:class:`~aion_trio.Store```) and ``::`` before a code
block.  mkdocstrings renders docstrings as Markdown, where a role would show
up verbatim, so this turns each role into inline code (the last component
for a ``~`` target, as Sphinx shows it) and ``text::`` into ``text:``.
An attribute documented Sphinx-style, by ``#:`` comment lines right above
it, gets those lines as its docstring (griffe reads only string literals).
A class attribute whose value is a call (``attrs.field(validator=...)``) is
shown without it: the call is machinery, not a value a reader can use.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|exc|data|mod|obj):`(~?)([^`]+)`")
LITERAL_BLOCK_INTRO = re.compile(r"(\S)::$", re.M)


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def markdown_docstring(text: str) -> str:
    """``text`` with its Sphinx roles and ``::`` literal-block intros made Markdown."""
    return LITERAL_BLOCK_INTRO.sub(r"\1:", ROLE.sub(_role, text))


def comment_docstring(lines: list[str], lineno: int) -> str | None:
    """The ``#:`` comment lines right above line ``lineno`` (1-based), joined; ``None`` if none."""
    found: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return "\n".join(found) or None


class SphinxRolesToMarkdown(griffe.Extension):
    """Rewrites every docstring griffe loads (see the module docstring)."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute and obj.lineno is not None:
            try:
                lines = obj.lines_collection[obj.filepath]  # type: ignore[index]
            except (KeyError, TypeError):
                lines = []
            text = comment_docstring(lines, obj.lineno)
            if text is not None:
                obj.docstring = griffe.Docstring(text, lineno=obj.lineno, parent=obj)
        parent = obj.parent
        if (
            obj.is_attribute
            and parent is not None
            and parent.is_class
            and isinstance(obj.value, griffe.ExprCall)
        ):
            obj.value = None
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
