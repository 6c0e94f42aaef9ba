"""The wire formats: one module each, one table of them.

A request speaks one wire format, and that format decides what the layers need
of it: what counts as progress, what a complete stream is, how an error is
written once the response has started, where its usage is, whether heartbeat
lines may go in, and how a broken answer is continued on the next tier. Each
format is the whole truth of its protocol in one module:

| module | format (``wire_format=``) |
|---|---|
| :mod:`.openai_chat` | ``openai``: OpenAI chat, completions, embeddings (the default) |
| :mod:`.anthropic` | ``anthropic``: Anthropic Messages |
| :mod:`.responses` | ``responses``: OpenAI Responses |
| :mod:`.ollama` | ``ollama``: Ollama's native NDJSON |
| :mod:`.plain` | ``plain``: any event stream, no terminator of its own |

The interface they implement is :class:`~.base.WireFormat` (its contract in
:mod:`.base`); the seam every continuation shares is :mod:`.seam`. The layers
pick a request's format object once (:func:`of`, from ``req.wire``) and ask it;
none branches on a format's name.

Adding a format is one module with a :class:`~.base.WireFormat` subclass and one
entry in :data:`TABLE` below.
"""

from __future__ import annotations

from .anthropic import Messages
from .base import NDJSON, SSE, WireFormat
from .ollama import Ollama
from .openai_chat import OpenAIChat
from .plain import Plain
from .responses import Responses

__all__ = ["NDJSON", "SSE", "TABLE", "WireFormat", "error_owner", "of", "recognise"]

TABLE: dict[str, WireFormat] = {
    fmt.name: fmt
    for fmt in (
        OpenAIChat(),  # the format of any path no other claims
        Responses(),
        Messages(),
        Ollama(),
        Plain(),
    )
}
"""Every wire format by its name (the order ``wire_format=``'s refusal lists them in)."""

DEFAULT = TABLE["openai"]
"""The format of a request no other claims (and of ``wire=None``)."""

_BY_PATH = [fmt for fmt in TABLE.values() if fmt.paths]
_BY_PREFIX = [fmt for fmt in TABLE.values() if fmt.error_prefix]


def of(wire: str | None) -> WireFormat:
    """The format object of a wire format name (None, or a name not in the table:
    :data:`DEFAULT`)."""
    if wire is None:
        return DEFAULT
    return TABLE.get(wire, DEFAULT)


def recognise(path: bytes) -> WireFormat:
    """The format a request path speaks (a trailing ``/`` aside): the one whose path
    ending matches longest (``/api/embeddings`` is Ollama's, not ``/embeddings``), else
    :data:`DEFAULT`."""
    path = path.rstrip(b"/")
    found, longest = DEFAULT, 0
    for fmt in _BY_PATH:
        for ending in fmt.paths:
            if len(ending) > longest and path.endswith(ending):
                found, longest = fmt, len(ending)
    return found


def error_owner(path: bytes) -> WireFormat | None:
    """The format whose ``error_prefix`` ``path`` starts with (Ollama's ``/api/``): the
    gateway's own errors on it take that format's shape whatever the path speaks."""
    for fmt in _BY_PREFIX:
        if fmt.error_prefix is not None and path.startswith(fmt.error_prefix):
            return fmt
    return None
