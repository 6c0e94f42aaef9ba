"""The seam of a continued stream: what every wire format's continuation shares.

Failover keeps a reference to every event a committed stream sent to the caller
(only while a later tier exists: a list append per chunk, nothing parsed). When
that stream breaks, stalls or is cut, the request's wire format parses those
events once (``WireFormat.seam``, in the format's own module of
:mod:`tierchain.formats`) and returns a :class:`Seam`, or a refused one
(:attr:`Seam.ok` False) when the answer cannot be continued (tool calls in
flight, several choices, a format or path without a continuation). The seam:

- says what the caller already has (:attr:`Seam.text`, its length is the
  ``after_chars`` of the ``continuing`` state line);
- builds the request for the next tier (:meth:`Seam.request`): the original
  messages, then the partial answer as an assistant message. With
  ``prefill`` (whether the backend takes one is :mod:`tierchain.prefill`'s to
  say) it is the last message, the model's own continuation point; without, a
  short user message after it asks the model to go on (:data:`INSTRUCTION`).
  Its token limits ask for what the caller's leave (:data:`LIMIT_KEYS`);
- rewrites the next tier's whole events into the first tier's envelope
  (:meth:`Seam.splice`; each format's module says how it keeps its envelope);
- ends the caller's stream as the backend would have at the caller's token
  limit (:meth:`Seam.ending`, the format's own last events, marked).

Here is the format-independent part: the text the next tier repeats from the
start of the partial answer (an echo of the prefill), or the whitespace a
prefill had to drop (Anthropic refuses an assistant message that ends in
whitespace), is cut from its first deltas, so that the caller's text has
nothing twice and nothing missing (the word rules are :mod:`tierchain.restart`).
Usage is the finishing tier's own, marked: the event that carries it gains
``"tierchain": {"continued_from": ..., "after_chars": N, "written_by": [...]}``.

Nothing here does I/O: Failover drives it (``failover/continuing.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .._json import loads
from ..learned import BYTES_PER_TOKEN
from ..restart import Restart
from ..sse import events as sse_events

__all__ = ["INSTRUCTION", "LIMIT_KEYS", "Seam", "dump", "load", "tokens"]

INSTRUCTION = (
    "Your previous answer was cut off. Continue it exactly where it stopped: do not "
    "repeat any of it, do not add a preamble."
)
"""The user message that follows the partial answer when the backend takes no prefill."""

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)

LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
"""The request keys that bound the answer's tokens (and Ollama's ``options.num_predict``):
a continuation asks for what the caller's limit leaves."""

_BYTES_PER_TOKEN = int(BYTES_PER_TOKEN)  # the package's one rule (tierchain.learned)
_ONE_TOKEN = 12  # characters: an event longer than this carries several tokens


def tokens(pieces: list[str]) -> int:
    """The tokens the caller has, from the text of each event that carried some: one an
    event (llama.cpp, vLLM and Ollama stream one token an event), or, for an event longer
    than a token ever is (``_ONE_TOKEN`` characters: a server that sends several tokens an
    event, as Anthropic's API does), its length at 4 characters a token."""
    return sum(
        1 if len(piece) <= _ONE_TOKEN else math.ceil(len(piece) / _BYTES_PER_TOKEN)
        for piece in pieces
        if piece
    )


def load(data: bytes) -> Any:
    try:
        return loads(data)
    except ValueError:  # (UnicodeDecodeError and TooDeep are ValueErrors)
        return None


def _limit(value: Any) -> int | None:
    """A token limit as a request gives it (a positive int), else None (none, or Ollama's
    -1 and -2: no limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def dump(obj: Any) -> bytes:
    """One JSON value as the formats write it: compact, UTF-8, on one line."""
    return _ENCODER.encode(obj).encode()


class Seam:
    """Where one broken answer continues: see the module docstring.

    ``text`` is the answer text the caller has; ``origin`` the backend that broke.
    """

    wire = ""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.text = ""
        self.ok = True  # False: the answer cannot be continued (see ``why``)
        self.why = ""
        self._prefill = ""  # the prefill sent (the text, perhaps without trailing space)
        self._skip: list[str] = []  # what the next tier may repeat at its start
        self._tail = ""  # the whitespace the prefill left out
        self._held: list[tuple[str | None, Any]] = []
        self._held_text = ""
        self._checking = False
        self._exact: int | None = None  # the exact repeat found at the seam, once judged
        self._restart: Restart | None = None  # the word rules (tierchain.restart)
        self.sent_text = ""  # text the next tier added, as it reached the caller
        self.spliced = False  # something of the next tier's reached the caller
        self.units = 0  # the tokens of the caller's text (see tokens)
        self.left: int | None = None  # tokens the caller's limit leaves (None: no limit)
        self.writers: list[str] = [origin]  # the backends that wrote the answer, in order

    @property
    def used(self) -> int:
        """The tokens the caller has (:func:`tokens`)."""
        return self.units

    # -- the request --------------------------------------------------------------

    def request(
        self, body: bytes, *, prefill: bool, adds: Mapping[str, Any] | None = None
    ) -> bytes | None:
        """The next tier's request: ``body`` with the partial answer (None: not JSON);
        ``adds``: fields a prefilled request gains (vLLM's ``continue_final_message``)."""
        data = load(body)
        if not isinstance(data, dict):
            return None
        text = self.text
        if prefill:
            # A prefill may not end in whitespace (Anthropic answers 400): the next
            # tier writes it again, and the seam cuts it.
            self._prefill = text.rstrip()
            tail = text[len(self._prefill) :]
        else:
            self._prefill = text
            tail = ""
        self._skip = [s for s in (text, tail) if s]
        self._tail = tail
        self._checking = bool(self._skip)
        self._exact = None
        self._restart = Restart(text, fresh=not prefill) if text else None
        self._held, self._held_text = [], ""
        self.sent_text = ""
        self.spliced = False
        out = self._build(data, self._prefill, prefill)
        if out is None:
            return None
        if prefill and adds:
            out = {**out, **adds}
        return dump(self._limited(out))

    def _limited(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` asking for what the caller's token limits leave (:attr:`left`)."""
        used = self.used
        left: int | None = None
        changed: dict[str, Any] = {}
        for key in LIMIT_KEYS:
            limit = _limit(data.get(key))
            if limit is not None:
                changed[key] = limit - used
        options = data.get("options")
        if isinstance(options, dict):
            limit = _limit(options.get("num_predict"))
            if limit is not None:
                changed["options"] = {**options, "num_predict": limit - used}
        for key, value in changed.items():
            got = value["num_predict"] if key == "options" else value
            left = got if left is None else min(left, got)
        self.left = None if left is None else max(0, left)
        if not changed or self.left == 0:
            return data
        return {**data, **changed}

    def _build(self, data: dict[str, Any], partial: str, prefill: bool) -> dict[str, Any] | None:
        messages = data.get("messages")
        if not isinstance(messages, list):
            return None
        last = messages[-1] if messages else None
        if (
            prefill
            and isinstance(last, dict)
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):
            # The caller's own prefill: the partial answer goes on from it.
            joined = {**last, "content": last["content"] + partial}
            return {**data, "messages": [*messages[:-1], joined]}
        added: list[dict[str, Any]] = [{"role": "assistant", "content": partial}]
        if not prefill:
            added.append({"role": "user", "content": INSTRUCTION})
        return {**data, "messages": [*messages, *added]}

    # -- the splice ---------------------------------------------------------------

    def splice(self, events: bytes) -> bytes:
        """The next tier's whole events (``events``) as the caller's stream goes on."""
        out: list[bytes] = []
        for name, obj in self._parse(events):
            for name2, obj2 in self._map(name, obj):
                self._through_seam(name2, obj2, out)
        return b"".join(out)

    def finish(self) -> bytes:
        """Whatever is still held at the seam (the next tier ended while it was checked)."""
        out: list[bytes] = []
        if self._checking:
            self._decide(out, final=True)
        self._release(out)
        return b"".join(out)

    def ending(self) -> bytes:
        """The caller's stream ended as the backend would have ended it at the caller's
        token limit (a continuation that would ask for nothing): the format's own last
        events, marked."""
        return b"".join(self._write(name, obj) for name, obj in self._ending())

    def _ending(self) -> list[tuple[str | None, Any]]:
        return []

    def _parse(self, events: bytes) -> list[tuple[str | None, Any]]:
        parsed: list[tuple[str | None, Any]] = []
        for name, data in sse_events(events):
            parsed.append((name, data if data == b"[DONE]" else load(data)))
        return parsed

    def _through_seam(self, name: str | None, obj: Any, out: list[bytes]) -> None:
        if not self._checking:
            self._emit(name, obj, out)
            return
        piece = self._delta(name, obj)
        if piece is None:
            if self._neutral(name, obj):
                self._held.append((name, obj))  # a ping: it waits with the text
                return
            self._decide(out, final=True)  # no more text before this event
            self._emit(name, obj, out)
            return
        self._held.append((name, obj))
        self._held_text += piece
        self._decide(out, final=False)

    def _decide(self, out: list[bytes], *, final: bool) -> None:
        """Judge the text held at the seam; release it (what repeats the caller's cut) once
        it is decided. First an exact repeat (an echo of the prefill, the whitespace it
        left out), then the word rules (:class:`~tierchain.restart.Restart`)."""
        held = self._held_text
        fresh: bool | None = None
        if self._exact is None:
            for skip in self._skip:
                if held.startswith(skip):
                    # The repeat: cut. What follows it goes on from the caller's text.
                    self._exact = len(skip)
                    fresh = False
                    break
            else:
                if not final and any(skip.startswith(held) for skip in self._skip):
                    return  # still as the start of a repeat: keep holding
                self._exact = self._tail_repeat()
        exact = self._exact
        restart = self._restart
        if restart is None or fresh is False:
            self._release(out, exact)
            return
        judged = restart.judge(held[exact:], final=final)
        if judged is None:
            return  # it may still be a restart: keep holding
        cut, insert = judged
        self._release(out, exact + cut, insert)

    def _tail_repeat(self) -> int:
        """How much of the held text repeats the start of the whitespace the prefill left
        out (the caller has it already), when the held text went another way."""
        tail, held = self._tail, self._held_text
        n = 0
        while n < len(tail) and n < len(held) and tail[n] == held[n]:
            n += 1
        return n

    def _release(self, out: list[bytes], cut: int = 0, insert: str = "") -> None:
        """Send what was held at the seam, its first ``cut`` characters of text left out
        and ``insert`` put before the rest."""
        held, self._held, self._held_text, self._checking = self._held, [], "", False
        for name, obj in held:
            piece = self._delta(name, obj)
            if piece is not None and (cut or insert):
                if len(piece) <= cut:
                    cut -= len(piece)
                    continue  # all of it a repeat
                obj = self._with_delta(name, obj, insert + piece[cut:])
                cut, insert = 0, ""
            self._emit(name, obj, out)

    def _neutral(self, name: str | None, obj: Any) -> bool:
        """True for an event that carries nothing of the answer (a ping)."""
        return name == "ping"

    def _emit(self, name: str | None, obj: Any, out: list[bytes]) -> None:
        piece = self._delta(name, obj)
        if piece:
            self.sent_text += piece
        self.spliced = True
        out.append(self._write(name, self._finalise(name, obj)))

    # -- per format -----------------------------------------------------------------

    def _map(self, name: str | None, obj: Any) -> list[tuple[str | None, Any]]:
        """The caller's events for one of the next tier's (none: dropped)."""
        return [(name, obj)]

    def _delta(self, name: str | None, obj: Any) -> str | None:
        """The answer text an event adds (None: it adds none)."""
        return None

    def _with_delta(self, name: str | None, obj: Any, text: str) -> Any:
        return obj

    def _finalise(self, name: str | None, obj: Any) -> Any:
        """Last changes before the event goes out (the ``.done`` events' whole text)."""
        return obj

    def _write(self, name: str | None, obj: Any) -> bytes:
        data = obj if isinstance(obj, bytes) else dump(obj)
        if name is None:
            return b"data: " + data + b"\n\n"
        return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"

    def _mark(self) -> dict[str, Any]:
        return {
            "continued_from": self.origin,
            "after_chars": len(self.text),
            "written_by": list(self.writers),
        }

    def _refuse(self, why: str) -> None:
        self.ok = False
        self.why = why
