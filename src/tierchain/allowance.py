"""A continuous allowance for the wait before a first chunk, from the request's size.

::

    allowance = cold_start + base + per_1k_tokens * tokens / 1000, at most ceiling

The defaults reproduce the measured prefill table (10k tokens: 400 s; 50k: 560 s; 90.7k:
about 723 s; 131,072: about 884 s) and are never narrower than a cold model
load plus prefill: a cold load was measured at 138.5 s for a 4-token
prompt, and the smallest allowance (an empty prompt) is 360 s.

The prompt size is estimated from the JSON request body by
:func:`estimate_tokens`: the UTF-8 bytes of every piece of prompt text
(``messages[].content`` as a string or as ``text`` parts, ``prompt``,
``system``, ``input``, plus the JSON of ``tools`` and ``functions``) divided by
4, rounded up. Four bytes per token is the usual figure for English with
BPE tokenizers; counting bytes rather than characters keeps CJK text (three
UTF-8 bytes per character, roughly one token each) from being underestimated
as badly as ``chars/4`` would. A body that is not JSON counts as all prompt.
A ``tokenizer(text) -> int`` may replace the estimate; it is given all the
prompt text joined by newlines.

The allowance is monotone and continuous in the token count: no step ladder.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from . import _json
from ._checks import duration
from .learned import BYTES_PER_TOKEN

__all__ = ["Allowance", "estimate_tokens", "prompt_text"]

Tokenizer = Callable[[str], int]

_TEXT_KEYS = ("prompt", "system", "input", "instructions", "suffix")
_JSON_KEYS = ("tools", "functions", "response_format")


def _texts(value: Any) -> Iterator[str]:
    """Every string inside a content value (a string, a list of parts, a part)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, dict):
        for key in ("text", "content", "input_text"):
            if key in value:
                yield from _texts(value[key])


def prompt_text(body: bytes) -> list[str]:
    """The pieces of prompt text in an OpenAI-style JSON body (see the module docstring)."""
    try:
        data = _json.loads(body) if body else {}
    except (UnicodeDecodeError, ValueError):
        return [body.decode("utf-8", "replace")]
    if not isinstance(data, dict):
        return [body.decode("utf-8", "replace")]
    pieces: list[str] = []
    messages = data.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                pieces.extend(_texts(message.get("content")))
                calls = message.get("tool_calls")
                if calls:
                    pieces.append(json.dumps(calls, ensure_ascii=False))
    for key in _TEXT_KEYS:
        if key in data:
            pieces.extend(_texts(data[key]))
    for key in _JSON_KEYS:
        if data.get(key):
            pieces.append(json.dumps(data[key], ensure_ascii=False))
    return pieces


def estimate_tokens(body: bytes) -> int:
    """Estimated prompt tokens of a JSON request body: UTF-8 bytes of its text over
    :data:`~tierchain.learned.BYTES_PER_TOKEN`."""
    size = sum(len(piece.encode("utf-8", "replace")) for piece in prompt_text(body))
    return math.ceil(size / BYTES_PER_TOKEN)


@dataclass(frozen=True, slots=True)
class Allowance:
    """Seconds to allow before a first chunk: ``cold_start + base + per_1k_tokens * k``.

    Call it with the request body (``allowance(body) -> seconds``) or use
    :meth:`for_tokens`. Give it to ``SaturationWatchdog(slow_after=...)``.

    Options: [the continuous allowance](watchdog.md#the-continuous-allowance).
    """

    cold_start: float = 180.0
    """Loading the model from cold (measured at 138.5 s), with headroom."""
    base: float = 180.0
    """Everything that does not grow with the prompt: queueing, first decode, network."""
    per_1k_tokens: float = 4.0
    """Prefill seconds per thousand prompt tokens (uncached, as measured)."""
    ceiling: float = 1800.0
    """No allowance is longer than this."""
    tokenizer: Tokenizer | None = None
    """Counts tokens exactly instead of the bytes/4 estimate (``tokenizer(text) -> int``)."""

    def __post_init__(self) -> None:
        # Seconds, or a timedelta (kept as seconds).
        for name in ("cold_start", "base", "per_1k_tokens", "ceiling"):
            value = getattr(self, name)
            checked = duration(f"Allowance {name}", value, allow_zero=name != "ceiling")
            object.__setattr__(self, name, checked)
        if self.cold_start + self.base <= 0:
            raise ValueError("Allowance cold_start + base must be > 0 seconds")

    def for_tokens(self, tokens: float) -> float:
        """The allowance for a prompt of ``tokens`` tokens."""
        tokens = max(0.0, float(tokens)) if math.isfinite(tokens) else math.inf
        raw = self.cold_start + self.base + self.per_1k_tokens * tokens / 1000.0
        return min(raw, self.ceiling)

    def tokens(self, body: bytes) -> int:
        """The prompt size of ``body`` in tokens (the tokenizer's count, else the estimate)."""
        if self.tokenizer is not None:
            try:
                counted = int(self.tokenizer("\n".join(prompt_text(body))))
            except Exception:  # a broken tokenizer falls back to the estimate
                counted = -1
            if counted >= 0:
                return counted
        return estimate_tokens(body)

    def __call__(self, body: bytes) -> float:
        """The allowance for the request whose JSON body is ``body``."""
        return self.for_tokens(self.tokens(body))
