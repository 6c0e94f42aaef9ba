"""Token usage as the answering backend reported it, per wire format.

Read once, at the end of a response, from the few events that can carry it (never
by parsing every chunk on the way). Where each wire format reports it is the
format's own (``WireFormat.usage``, one module of :mod:`tierchain.formats` each:
OpenAI's ``usage``, which a stream carries only when the request asked with
``stream_options: {"include_usage": true}``; Responses' ``response.usage``;
Anthropic's ``message_start`` and ``message_delta``; Ollama's final line). A side
the backend did not report is estimated (see :func:`estimate`), never asked for
behind the caller's back (the gateway does not rewrite the request body).

:func:`read_usage` takes the candidate JSON values (data values of the first and
last events, NDJSON lines, or a whole body) and returns what it found;
:func:`estimate` stands in, marked as estimated, for a side the backend did not report.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from . import _json, formats
from .formats.seam import LIMIT_KEYS
from .learned import BYTES_PER_TOKEN, prompt_tokens
from .store import USAGE_BOUND
from .telemetry import log_event

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "Usage",
    "asked_output",
    "body_units",
    "bounded",
    "estimate",
    "read_usage",
    "reservation",
]

DEFAULT_MAX_TOKENS = 4096
"""The output tokens a request that names no ``max_tokens`` reserves (KeyLimits' default)."""

_MARKERS = (b"usage", b"eval_count")
_BYTES_PER_TOKEN = int(BYTES_PER_TOKEN)  # the package's one rule (tierchain.learned), whole


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one answer: ``input`` and ``output``, and which of them are estimated."""

    input: int
    output: int
    input_estimated: bool = False
    output_estimated: bool = False


def read_usage(wire: str | None, values: Iterable[bytes]) -> tuple[int | None, int | None]:
    """(input, output) from ``values``, in order (a later value wins); None where none said.

    Only a value that mentions usage at all is parsed.
    """
    found = formats.of(wire).usage
    got_in: int | None = None
    got_out: int | None = None
    for value in values:
        if not any(marker in value for marker in _MARKERS):
            continue
        try:
            obj = _json.loads(value)  # the one bounded loader: a 100,000-deep answer is no crash
        except ValueError:  # (UnicodeDecodeError and _json.TooDeep are ValueErrors)
            log_event("usage.unreadable", logging.INFO, wire=wire, size=len(value))
            continue
        if not isinstance(obj, dict):
            continue
        found_in, found_out = found(obj)
        if found_in is not None:
            got_in = found_in
        if found_out is not None:
            got_out = found_out
    return got_in, got_out


def estimate(found: tuple[int | None, int | None], request_bytes: int, output_units: int) -> Usage:
    """The usage, with each side the backend did not report estimated: the input from the
    request body's size (``BYTES_PER_TOKEN`` bytes a token), the output as ``output_units``
    (the data events of a stream: about a token each; for a whole body, its size in tokens
    by the same rule)."""
    got_in, got_out = found
    return Usage(
        got_in if got_in is not None else max(1, request_bytes // _BYTES_PER_TOKEN),
        got_out if got_out is not None else max(0, output_units),
        got_in is None,
        got_out is None,
    )


def body_units(size: int) -> int:
    """A whole body's size as an output estimate in tokens."""
    return size // _BYTES_PER_TOKEN


def bounded(value: int, what: str, source: str) -> int:
    """``value`` (a number from outside: an upstream's usage, a caller's ``max_tokens``)
    within ``[0, USAGE_BOUND]``; past the bound it is the bound, logged once per
    (``what``, ``source``) in this process (``usage.clamped``)."""
    if 0 <= value <= USAGE_BOUND:
        return value
    if value < 0:
        return 0
    if (what, source) not in _CLAMPED and len(_CLAMPED) < 1024:
        _CLAMPED.add((what, source))
        log_event(
            "usage.clamped",
            logging.WARNING,
            what=what,
            source=source,
            reported=value if value.bit_length() <= 128 else "over 2^128",
            bound=USAGE_BOUND,
        )
    return USAGE_BOUND


_CLAMPED: set[tuple[str, str]] = set()
_ASKED_MARKS = (b'"max_', b'"num_predict"')
_ASKED_NAMES = frozenset({*LIMIT_KEYS, "options"})
_READ_WHOLE = 2**20  # a longer body has only its top-level members above read


async def asked_output(body: bytes) -> int | None:
    """The most output tokens a request asks for: ``max_completion_tokens``,
    ``max_tokens`` (OpenAI chat and completions, Anthropic), ``max_output_tokens``
    (Responses) or ``options.num_predict`` (Ollama; its -1 and -2 mean no limit);
    None when it names none. A body that names none is not parsed; a long one is
    bounded by its shape first (:func:`tierchain._json.check_shape`, the event loop free
    between slices), and one too complex to parse is None (Failover refuses it)."""
    if not any(mark in body for mark in _ASKED_MARKS):
        return None
    try:
        containers = await _json.check_shape(body)
        data: Any = (
            await _json.members(body, _ASKED_NAMES)  # (a long body's messages left unparsed)
            if len(body) > _READ_WHOLE
            else _json.loads(body, containers=containers)
        )
    except ValueError:  # (TooComplex, TooDeep and UnicodeDecodeError are ValueErrors)
        return None
    if not isinstance(data, dict):
        return None
    options = data.get("options")
    found = [data.get(name) for name in LIMIT_KEYS]
    if isinstance(options, dict):
        found.append(options.get("num_predict"))
    for value in found:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


async def reservation(body: bytes, default: int) -> tuple[int, int]:
    """(the prompt's estimated tokens, the tokens a request reserves): the prompt estimate
    the watchdog uses (:func:`tierchain.learned.prompt_tokens`) plus the output it asks
    for at most (``default`` when it names none), each bounded."""
    prompt = bounded(math.ceil(prompt_tokens(body)), "prompt_estimate", "request")
    asked = await asked_output(body)
    output = default if asked is None else bounded(asked, "max_tokens", "request")
    return prompt, min(USAGE_BOUND, prompt + output)
