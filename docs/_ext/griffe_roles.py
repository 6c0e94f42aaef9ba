"""A griffe extension for the API page: the docstrings' reST roles as Markdown.

tierchain's docstrings are written for ``help()`` and Sphinx-style readers:
``:class:`~tierchain.Failover``` and friends. mkdocstrings renders docstrings as
Markdown, where such a role would show up as literal text. This turns each one
into inline code, linked to its entry on the API page when it names a public
name (one in ``tierchain.__all__``), plain otherwise (a private module's class
has no entry to link to, and a dangling link fails the strict build).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

import tierchain

_ROLE = re.compile(
    r":(?:class|func|meth|mod|data|attr|exc|obj):`(?P<tilde>~?)(?P<text>[^`<]+?)"
    r"(?:\s*<(?P<target>[^>]+)>)?`"
)
_PUBLIC = frozenset(name for name in tierchain.__all__ if not name.startswith("_"))


def _markdown(match: re.Match[str]) -> str:
    text = match["text"].strip()
    target = (match["target"] or text).strip()
    shown = text.rsplit(".", 1)[-1] if match["tilde"] else text
    parts = target.split(".")
    public = next((p for p in parts[1:] if p in _PUBLIC), None) if parts[0] == "tierchain" else None
    if public is None:
        return f"`{shown}`"
    return f"[`{shown}`][tierchain.{public}]"


def rest_roles_to_markdown(text: str) -> str:
    """``text`` with every reST role written as Markdown inline code (and a link)."""
    return _ROLE.sub(_markdown, text)


class ReSTRoles(griffe.Extension):
    """Rewrite the roles in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rest_roles_to_markdown(obj.docstring.value)
