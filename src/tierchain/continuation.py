"""Continuation: finish a broken answer on the next tier, in the caller's own stream.

Failover keeps a reference to every event a committed stream sent to the
caller (only while a later tier exists: a list append per chunk, nothing
parsed). When that stream breaks, stalls or is cut, :func:`seam` parses those
events once and returns a :class:`Seam` for the request's wire format, or None
when the answer cannot be continued (tool calls in flight, several choices, a
format or path without a continuation). The seam:

- says what the caller already has (:attr:`Seam.text`, its length is the
  ``after_chars`` of the ``continuing`` state line);
- builds the request for the next tier (:meth:`Seam.request`): the original
  messages, then the partial answer as an assistant message. With
  ``prefill`` (whether the backend takes one is :mod:`tierchain.prefill`'s to
  say) it is the last message, the model's own continuation point; without, a
  short user message after it asks the model to go on (:data:`INSTRUCTION`).
  Its token limits ask for what the caller's leave (:data:`LIMIT_KEYS`);
- rewrites the next tier's whole events into the first tier's envelope
  (:meth:`Seam.splice`), per format:

  - OpenAI chat: every chunk's ``id``, ``model``, ``created`` (and
    ``system_fingerprint``) become the first tier's; the repeated ``role`` is
    dropped; ``data: [DONE]`` passes once, at the end.
  - Anthropic Messages: ``message_start`` is not repeated; the first text block
    continues the open one (its ``content_block_start`` is dropped) or, if it
    was closed, becomes the next index; every later block's index follows on.
  - OpenAI Responses: ``response.created`` / ``in_progress`` are not repeated;
    every ``sequence_number`` follows on from the last one sent; the message
    item and content part open at the break are continued under their own
    ``item_id``, ``output_index`` and ``content_index``; the ``.done`` events and
    the one ``response.completed`` carry the whole text and the first tier's
    response ``id``, ``model`` and ``created_at``.
  - Ollama chat (NDJSON): every line's ``model`` and ``created_at`` become the first
    tier's.

  The seam: text the next tier repeats from the start of the partial answer
  (an echo of the prefill), or the whitespace a prefill had to drop (Anthropic
  refuses an assistant message that ends in whitespace), is cut from its first
  deltas, so that the caller's text has nothing twice and nothing missing.
  Usage is the finishing tier's own, marked: the event that carries it gains
  ``"tierchain": {"continued_from": ..., "after_chars": N}``.

Nothing here does I/O: Failover drives it (see its module docstring).
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from ._json import loads
from .restart import Restart
from .wire import ANTHROPIC, OLLAMA, OPENAI, RESPONSES

__all__ = ["INSTRUCTION", "LIMIT_KEYS", "Seam", "seam"]

INSTRUCTION = (
    "Your previous answer was cut off. Continue it exactly where it stopped: do not "
    "repeat any of it, do not add a preamble."
)
"""The user message that follows the partial answer when the backend takes no prefill."""

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_EOL = re.compile(rb"\r\n|\r|\n")


def _events(buf: bytes) -> list[tuple[str | None, bytes]]:
    """Every event of ``buf`` (whole SSE events) that carries data: (name, data)."""
    found: list[tuple[str | None, bytes]] = []
    name: str | None = None
    lines: list[bytes] | None = None
    for line in _EOL.split(buf):
        if not line:
            if lines is not None:
                found.append((name, b"\n".join(lines)))
            name, lines = None, None
        elif line.startswith(b"event:"):
            value = line[6:]
            name = (value[1:] if value.startswith(b" ") else value).decode("utf-8", "replace")
        elif line == b"data" or line.startswith(b"data:"):
            value = line[5:]
            if lines is None:
                lines = []
            lines.append(value[1:] if value.startswith(b" ") else value)
    if lines is not None:
        found.append((name, b"\n".join(lines)))
    return found


LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
"""The request keys that bound the answer's tokens (and Ollama's ``options.num_predict``):
a continuation asks for what the caller's limit leaves."""

_BYTES_PER_TOKEN = 4  # (the usage estimate's rule, tierchain.usage)
_ONE_TOKEN = 12  # characters: an event longer than this carries several tokens


def _tokens(pieces: list[str]) -> int:
    """The tokens the caller has, from the text of each event that carried some: one an
    event (llama.cpp, vLLM and Ollama stream one token an event), or, for an event longer
    than a token ever is (``_ONE_TOKEN`` characters: a server that sends several tokens an
    event, as Anthropic's API does), its length at 4 characters a token."""
    return sum(
        1 if len(piece) <= _ONE_TOKEN else math.ceil(len(piece) / _BYTES_PER_TOKEN)
        for piece in pieces
        if piece
    )


def _load(data: bytes) -> Any:
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


def _dump(obj: Any) -> bytes:
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
        self.ended = False  # its terminator passed
        self.units = 0  # the tokens of the caller's text (see _tokens)
        self.left: int | None = None  # tokens the caller's limit leaves (None: no limit)
        self.writers: list[str] = [origin]  # the backends that wrote the answer, in order

    @property
    def used(self) -> int:
        """The tokens the caller has (:func:`_tokens`)."""
        return self.units

    # -- the request --------------------------------------------------------------

    def request(
        self, body: bytes, *, prefill: bool, adds: Mapping[str, Any] | None = None
    ) -> bytes | None:
        """The next tier's request: ``body`` with the partial answer (None: not JSON);
        ``adds``: fields a prefilled request gains (vLLM's ``continue_final_message``)."""
        data = _load(body)
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
        self.spliced = self.ended = False
        out = self._build(data, self._prefill, prefill)
        if out is None:
            return None
        if prefill and adds:
            out = {**out, **adds}
        return _dump(self._limited(out))

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
        for name, data in _events(events):
            parsed.append((name, data if data == b"[DONE]" else _load(data)))
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
        data = obj if isinstance(obj, bytes) else _dump(obj)
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


# -- OpenAI chat ------------------------------------------------------------------------


class _Chat(Seam):
    wire = OPENAI

    def __init__(self, origin: str, events: bytes) -> None:
        super().__init__(origin)
        self.envelope: dict[str, Any] = {}
        text: list[str] = []
        for _, data in _events(events):
            if data == b"[DONE]":
                continue
            obj = _load(data)
            if not isinstance(obj, dict):
                continue
            if not self.envelope:
                self.envelope = {
                    k: obj[k] for k in ("id", "model", "created", "system_fingerprint") if k in obj
                }
            for choice in obj.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                if choice.get("index", 0) != 0:
                    self._refuse("choices")
                delta = choice.get("delta") or {}
                if delta.get("tool_calls") or delta.get("function_call"):
                    self._refuse("tool_calls")
                content = delta.get("content")
                if isinstance(content, str):
                    text.append(content)
        self.text = "".join(text)
        self.units = _tokens(text)

    def _ending(self) -> list[tuple[str | None, Any]]:
        # (In the order OpenAI writes a chunk's fields.)
        chunk = {"id": self.envelope.get("id", ""), "object": "chat.completion.chunk"}
        for key in ("created", "model", "system_fingerprint"):
            if key in self.envelope:
                chunk[key] = self.envelope[key]
        chunk |= {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "tierchain": self._mark(),
        }
        return [(None, chunk), (None, b"[DONE]")]

    def _map(self, name: str | None, obj: Any) -> list[tuple[str | None, Any]]:
        if not isinstance(obj, dict) or "error" in obj:
            return [(name, obj)]
        obj = {**obj, **self.envelope}
        choices = obj.get("choices")
        if choices is not None and not (
            isinstance(choices, list) and all(isinstance(c, dict) for c in choices)
        ):
            raise ValueError("a chunk whose choices are not a list of objects")
        if choices:
            kept = []
            for choice in choices:
                delta = choice.get("delta")
                if isinstance(delta, dict) and "role" in delta:
                    delta = {k: v for k, v in delta.items() if k != "role"}
                    choice = {**choice, "delta": delta}
                    empty = all(v in ("", None) for v in delta.values())
                    if empty and choice.get("finish_reason") is None:
                        continue  # only the role (and no text): the caller had it
                kept.append(choice)
            if not kept and not obj.get("usage"):
                return []
            obj["choices"] = kept
        if obj.get("usage") or any(c.get("finish_reason") is not None for c in choices or ()):
            # The answer's last chunk (its finish, and its usage when asked for) says who
            # wrote it: a field the SDKs keep as an extra, never an error.
            obj["tierchain"] = self._mark()
        return [(name, obj)]

    def _delta(self, name: str | None, obj: Any) -> str | None:
        if not isinstance(obj, dict):
            return None
        choices: list[Any] = obj.get("choices") or []
        if len(choices) != 1 or choices[0].get("finish_reason") is not None:
            return None
        content = (choices[0].get("delta") or {}).get("content")
        return content if isinstance(content, str) else None

    def _with_delta(self, name: str | None, obj: Any, text: str) -> Any:
        choice = obj["choices"][0]
        return {**obj, "choices": [{**choice, "delta": {**choice["delta"], "content": text}}]}


# -- Anthropic Messages -------------------------------------------------------------------


class _Anthropic(Seam):
    wire = ANTHROPIC

    def __init__(self, origin: str, events: bytes) -> None:
        super().__init__(origin)
        self.last_index = -1
        self.open = False  # the last block is still open (no content_block_stop)
        text: list[str] = []
        for name, data in _events(events):
            obj = _load(data)
            if not isinstance(obj, dict):
                continue
            kind = obj.get("type", name)
            if kind == "content_block_start":
                block = obj.get("content_block") or {}
                if block.get("type") != "text":
                    self._refuse(str(block.get("type")))  # tool_use, thinking: not text
                self.last_index = int(obj.get("index", self.last_index + 1))
                self.open = True
                if isinstance(block.get("text"), str):
                    text.append(block["text"])
            elif kind == "content_block_delta":
                delta = obj.get("delta") or {}
                if delta.get("type") != "text_delta":
                    self._refuse(str(delta.get("type")))
                elif isinstance(delta.get("text"), str):
                    text.append(delta["text"])
            elif kind == "content_block_stop":
                self.open = False
        self.text = "".join(text)
        self.units = _tokens(text)
        self._offset = 0
        self._first_block = True

    def _ending(self) -> list[tuple[str | None, Any]]:
        events: list[tuple[str | None, Any]] = []
        if self.open:
            stop = {"type": "content_block_stop", "index": self.last_index}
            events.append(("content_block_stop", stop))
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
            "usage": {"output_tokens": self.used},
            "tierchain": self._mark(),
        }
        events.append(("message_delta", delta))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _map(self, name: str | None, obj: Any) -> list[tuple[str | None, Any]]:
        if not isinstance(obj, dict):
            return [(name, obj)]
        kind = obj.get("type", name)
        if kind == "message_start":
            return []
        if kind == "content_block_start":
            index = int(obj.get("index", 0))
            block = obj.get("content_block") or {}
            if self._first_block:
                self._first_block = False
                if self.open and block.get("type") == "text":
                    self._offset = self.last_index - index  # into the open block
                    if block.get("text"):
                        delta = {"type": "text_delta", "text": block["text"]}
                        return [
                            (
                                "content_block_delta",
                                {"type": "content_block_delta", "index": index, "delta": delta},
                            )
                        ]
                    return []
                if self.open:
                    # Not text: the open block ends first.
                    stop = {"type": "content_block_stop", "index": self.last_index}
                    self.open = False
                    self._offset = self.last_index + 1 - index
                    return [
                        ("content_block_stop", stop),
                        (name, {**obj, "index": index + self._offset}),
                    ]
                self._offset = self.last_index + 1 - index
            return [(name, {**obj, "index": index + self._offset})]
        if kind in ("content_block_delta", "content_block_stop") and "index" in obj:
            return [(name, {**obj, "index": int(obj["index"]) + self._offset})]
        if kind == "message_delta":
            return [(name, {**obj, "tierchain": self._mark()})]
        return [(name, obj)]

    def _delta(self, name: str | None, obj: Any) -> str | None:
        if not isinstance(obj, dict) or obj.get("type") != "content_block_delta":
            return None
        delta = obj.get("delta") or {}
        text = delta.get("text")
        return text if delta.get("type") == "text_delta" and isinstance(text, str) else None

    def _with_delta(self, name: str | None, obj: Any, text: str) -> Any:
        return {**obj, "delta": {**obj["delta"], "text": text}}


# -- OpenAI Responses ----------------------------------------------------------------------


class _Responses(Seam):
    wire = RESPONSES

    def __init__(self, origin: str, events: bytes) -> None:
        super().__init__(origin)
        self.seq = -1
        self.response: dict[str, Any] = {}
        self.items: dict[int, dict[str, Any]] = {}  # output_index -> item (as it stands)
        self.open_item: dict[str, Any] | None = None  # the message item open at the break
        self.part_index: int | None = None  # its content part open at the break
        self.part_text = ""  # that part's text so far
        self._open_index = -1
        text: list[str] = []
        for name, data in _events(events):
            obj = _load(data)
            if not isinstance(obj, dict):
                continue
            kind = str(obj.get("type", name))
            if isinstance(obj.get("sequence_number"), int):
                self.seq = obj["sequence_number"]
            if kind in ("response.created", "response.in_progress") and isinstance(
                obj.get("response"), dict
            ):
                self.response = obj["response"]
            elif kind == "response.output_item.added":
                item = obj.get("item") or {}
                if item.get("type") != "message":
                    self._refuse(str(item.get("type")))
                index = int(obj.get("output_index", len(self.items)))
                self.open_item = copy.deepcopy(item)
                self.open_item.setdefault("content", [])
                self.items[index] = self.open_item
                self._open_index = index
            elif kind == "response.output_item.done":
                index = int(obj.get("output_index", 0))
                self.items[index] = obj.get("item") or {}
                self.open_item = None
            elif kind == "response.content_part.added":
                self.part_index = int(obj.get("content_index", 0))
                self.part_text = ""
            elif kind == "response.content_part.done":
                self.part_index = None
                if self.open_item is not None and isinstance(obj.get("part"), dict):
                    self.open_item["content"].append(obj["part"])
            elif kind == "response.output_text.delta":
                delta = obj.get("delta")
                if isinstance(delta, str):
                    text.append(delta)
                    self.part_text += delta
            elif kind.startswith("response.function_call") or kind.startswith("response.reasoning"):
                self._refuse(kind)
        self.text = "".join(text)
        self.units = _tokens(text)
        self._item_map: dict[str, str] = {}
        self._index_map: dict[int, int] = {}
        self._part_map: dict[int, int] = {}
        self._texts: dict[tuple[int, int], str] = {}  # (output_index, content_index) -> text

    def _build(self, data: dict[str, Any], partial: str, prefill: bool) -> dict[str, Any] | None:
        given = data.get("input")
        if isinstance(given, str):
            given = [{"role": "user", "content": given}]
        if not isinstance(given, list):
            return None
        added: list[dict[str, Any]] = [{"role": "assistant", "content": partial}]
        if not prefill:
            added.append({"role": "user", "content": INSTRUCTION})
        return {**data, "input": [*given, *added]}

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _ending(self) -> list[tuple[str | None, Any]]:
        # As a Responses stream ends at max_output_tokens: the open part and item done,
        # the item and the response ``incomplete``.
        events: list[tuple[str | None, Any]] = []
        item = self.open_item
        if item is not None:
            content = [dict(part) for part in item.get("content") or ()]
            if self.part_index is not None:
                at = {
                    "item_id": item.get("id"),
                    "output_index": self._open_index,
                    "content_index": self.part_index,
                }
                text = self.part_text
                part = {"type": "output_text", "text": text, "annotations": []}
                kind = "response.output_text.done"
                done: dict[str, Any] = {"type": kind, **at, "text": text, "logprobs": []}
                events.append((kind, {**done, "sequence_number": self._next_seq()}))
                kind = "response.content_part.done"
                done = {"type": kind, **at, "part": part}
                events.append((kind, {**done, "sequence_number": self._next_seq()}))
                content.insert(self.part_index, part)
            item = {**item, "status": "incomplete", "content": content}
            self.items[self._open_index] = item
            kind = "response.output_item.done"
            done = {"type": kind, "output_index": self._open_index, "item": item}
            events.append((kind, {**done, "sequence_number": self._next_seq()}))
        response = {
            **self.response,
            "status": "incomplete",
            "incomplete_details": {"reason": "max_output_tokens"},
            "output": [self.items[i] for i in sorted(self.items)],
        }
        kind = "response.incomplete"
        last = {"type": kind, "response": response, "sequence_number": self._next_seq()}
        events.append((kind, {**last, "tierchain": self._mark()}))
        return events

    def _map(self, name: str | None, obj: Any) -> list[tuple[str | None, Any]]:
        if not isinstance(obj, dict):
            return [(name, obj)]
        kind = obj.get("type", name)
        if kind in ("response.created", "response.in_progress", "response.queued"):
            return []
        obj = dict(obj)
        if "output_index" in obj:
            theirs = int(obj["output_index"])
            if theirs not in self._index_map:
                self._index_map[theirs] = self._new_index(obj)
            obj["output_index"] = self._index_map[theirs]
        item_id = obj.get("item_id")
        if isinstance(item_id, str) and item_id in self._item_map:
            obj["item_id"] = self._item_map[item_id]
        merged = self.open_item is not None and obj.get("output_index") == self._open_index
        if kind == "response.output_item.added":
            item = obj.get("item") or {}
            if merged and item.get("type") == "message":
                if isinstance(item.get("id"), str):
                    self._item_map[item["id"]] = self.open_item["id"]  # type: ignore[index]
                return []
            new_id = item.get("id")
            taken = {i.get("id") for i in self.items.values()}
            if isinstance(new_id, str) and new_id in taken:
                # A new item under an id the caller has already seen: made its own.
                self._item_map[new_id] = f"{new_id}_{obj['output_index']}"
                item = {**item, "id": self._item_map[new_id]}
                obj["item"] = item
            self.items[obj["output_index"]] = item
        if "content_index" in obj and merged:
            theirs = int(obj["content_index"])
            if theirs not in self._part_map:
                open_part = self.part_index
                self._part_map[theirs] = (
                    open_part if open_part is not None else len(self.open_item["content"])  # type: ignore[index]
                )
            obj["content_index"] = self._part_map[theirs]
            if kind == "response.content_part.added" and self.part_index is not None:
                return []
        return [(name, obj)]

    def _new_index(self, obj: Any) -> int:
        item = obj.get("item") or {}
        if (
            self.open_item is not None
            and item.get("type", "message") == "message"
            and not any(v == self._open_index for v in self._index_map.values())
        ):
            return self._open_index
        return max(self.items, default=-1) + 1

    def _delta(self, name: str | None, obj: Any) -> str | None:
        if not isinstance(obj, dict) or obj.get("type") != "response.output_text.delta":
            return None
        delta = obj.get("delta")
        return delta if isinstance(delta, str) else None

    def _with_delta(self, name: str | None, obj: Any, text: str) -> Any:
        return {**obj, "delta": text}

    def _whole(self, output_index: int, content_index: int, theirs: str) -> str:
        """A part's whole text: the first tier's and the next tier's, across the seam."""
        if (
            self.open_item is not None
            and output_index == self._open_index
            and content_index == (self.part_index if self.part_index is not None else -1)
        ):
            return self.part_text + self.sent_text
        return theirs

    def _finalise(self, name: str | None, obj: Any) -> Any:
        if not isinstance(obj, dict):
            return obj
        kind = obj.get("type", name)
        if "sequence_number" in obj:
            obj = {**obj, "sequence_number": self._next_seq()}
        if kind == "response.output_text.done":
            obj["text"] = self._whole(
                obj.get("output_index", -1), obj.get("content_index", -1), obj.get("text", "")
            )
        elif kind == "response.content_part.done" and isinstance(obj.get("part"), dict):
            part = obj["part"]
            if isinstance(part.get("text"), str):
                text = self._whole(
                    obj.get("output_index", -1), obj.get("content_index", -1), part["text"]
                )
                obj["part"] = {**part, "text": text}
        elif kind == "response.output_item.done" and isinstance(obj.get("item"), dict):
            item = obj["item"]
            if item.get("id") in self._item_map:
                item = {**item, "id": self._item_map[item["id"]]}
            item = self._item(obj["output_index"], item)
            obj["item"] = item
            self.items[obj["output_index"]] = item
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            response = obj.get("response")
            if isinstance(response, dict):
                fixed = {**response}
                for key in ("id", "created_at", "model"):
                    if key in self.response:
                        fixed[key] = self.response[key]
                fixed["output"] = [self.items[i] for i in sorted(self.items)]
                obj["tierchain"] = self._mark()
                obj["response"] = fixed
        return obj

    def _item(self, output_index: int, item: dict[str, Any]) -> dict[str, Any]:
        """An item as the caller sees it: the open one keeps its id and gets the whole text."""
        if self.open_item is None or output_index != self._open_index:
            return item
        content = [dict(part) for part in self.open_item.get("content") or ()]
        theirs = [dict(part) for part in item.get("content") or ()]
        at = self.part_index if self.part_index is not None else len(content)
        for offset, part in enumerate(theirs):
            index = at + offset
            if offset == 0 and self.part_index is not None and isinstance(part.get("text"), str):
                part["text"] = self.part_text + self.sent_text
            if index < len(content):
                content[index] = part
            else:
                content.append(part)
        return {**item, "id": self.open_item.get("id", item.get("id")), "content": content}


# -- Ollama chat (NDJSON) ---------------------------------------------------------------------


class _Ollama(Seam):
    wire = OLLAMA

    def __init__(self, origin: str, lines: bytes) -> None:
        super().__init__(origin)
        self.envelope: dict[str, Any] = {}
        self.created_at = ""
        text: list[str] = []
        for line in lines.splitlines():
            obj = _load(line) if line.strip() else None
            if not isinstance(obj, dict):
                continue
            if not self.envelope and "model" in obj:
                self.envelope = {"model": obj["model"]}
            message = obj.get("message")
            if not isinstance(message, dict):
                self._refuse("not_chat")  # /api/generate: no messages to continue
                continue
            if message.get("tool_calls"):
                self._refuse("tool_calls")
            if isinstance(message.get("content"), str):
                text.append(message["content"])
            if isinstance(obj.get("created_at"), str):
                self.created_at = obj["created_at"]
        self.text = "".join(text)
        self.units = _tokens(text)

    def _ending(self) -> list[tuple[str | None, Any]]:
        last = {
            **self.envelope,
            "created_at": self.created_at,
            "message": {"role": "assistant", "content": ""},
            "done_reason": "length",
            "done": True,
            "tierchain": self._mark(),
        }
        return [(None, last)]

    def _parse(self, events: bytes) -> list[tuple[str | None, Any]]:
        return [(None, _load(line)) for line in events.splitlines() if line.strip()]

    def _map(self, name: str | None, obj: Any) -> list[tuple[str | None, Any]]:
        if not isinstance(obj, dict) or "error" in obj:
            return [(name, obj)]
        obj = {**obj, **self.envelope}
        if obj.get("done") is True:
            obj["tierchain"] = self._mark()
        return [(name, obj)]

    def _delta(self, name: str | None, obj: Any) -> str | None:
        if not isinstance(obj, dict) or obj.get("done"):
            return None
        content = (obj.get("message") or {}).get("content")
        return content if isinstance(content, str) else None

    def _with_delta(self, name: str | None, obj: Any, text: str) -> Any:
        return {**obj, "message": {**obj["message"], "content": text}}

    def _write(self, name: str | None, obj: Any) -> bytes:
        return _dump(obj) + b"\n"


def seam(wire: str | None, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
    """The seam of an answer in ``wire`` whose events ``sent`` reached the caller from
    ``origin``; check :attr:`Seam.ok` before continuing it."""
    if ndjson:
        if wire == OLLAMA:
            return _Ollama(origin, sent)
        refused = Seam(origin)
        refused._refuse("format")
        return refused
    if wire == ANTHROPIC:
        return _Anthropic(origin, sent)
    if wire == RESPONSES:
        return _Responses(origin, sent)
    if wire in (OPENAI, None):
        return _Chat(origin, sent)
    refused = Seam(origin)
    refused._refuse("format")
    return refused
