"""OpenAI Responses (``responses``).

- Recognised by a path ending in ``/responses``.
- Opening events, not progress: ``response.created``, ``response.queued``,
  ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added`` before the first text.
- Complete at ``event: response.completed``; ``response.failed`` and
  ``response.incomplete`` are the upstream's own whole answers, not truncations (a
  ``data: [DONE]`` after them, as some servers add, is passed over).
- An error after the response began: ``event: error`` carrying the Responses error
  event's fields (``type``, ``code``, ``message``, ``param``) and an ``error`` object:
  the ``openai`` SDK raises ``APIError`` for a data object with ``error``
  (openai/_streaming.py), and the Agents SDK for an ``error`` event. A whole error
  answer is OpenAI's ``{"error": {...}}``.
- Usage: the body's ``usage`` (``input_tokens``, ``output_tokens``); in a stream,
  the ``response.completed`` event's ``response.usage`` (``response.incomplete`` and
  ``response.failed`` carry one too).
- Heartbeat lines (SSE comments) may go in.
- Continuation (:class:`ResponsesSeam`): ``response.created`` / ``in_progress`` are
  not repeated; every ``sequence_number`` follows on from the last one sent; the
  message item and content part open at the break are continued under their own
  ``item_id``, ``output_index`` and ``content_index``; the ``.done`` events and the one
  ``response.completed`` carry the whole text and the first tier's response ``id``,
  ``model`` and ``created_at``, and say who wrote the answer. At the caller's token
  limit: the open part and item done, the item and the response ``incomplete``
  (``response.incomplete``, ``max_output_tokens``). No prefill: the partial answer
  goes as an assistant input item with a user instruction after it.

The shapes are OpenAI's Responses streaming reference (``ResponseStreamEvent`` in the
``openai`` SDK's types).
"""

from __future__ import annotations

import copy
from typing import Any

from ..sse import events as sse_events
from ..sse import last_event
from .base import WireFormat, count, kind_of, opening_only, refused
from .seam import INSTRUCTION, Seam, dump, load, tokens

__all__ = ["Responses", "ResponsesSeam"]

_ENDS = frozenset({"response.completed", "response.failed", "response.incomplete"})


class Responses(WireFormat):
    """OpenAI Responses: see the module docstring."""

    name = "responses"
    paths = (b"/responses",)
    opening = frozenset(
        {
            b"response.created",
            b"response.queued",
            b"response.in_progress",
            b"response.output_item.added",
            b"response.content_part.added",
        }
    )
    error_passes = False

    def no_progress(self, events: bytes, started: bool) -> bool:
        return not started and opening_only(self.opening, events)

    def judge(self, previous: bytes, last: bytes, end: bytes | None) -> tuple[bool, bool]:
        events = previous + last
        name, data = last_event(events)
        if data == b"[DONE]":
            name, data = last_event(events, skip_last=True)
        return kind_of(name, data) in _ENDS, False

    def whole(self, terminated: bool, finish_seen: bool, end: bytes | None) -> bool:
        return terminated

    def error_event(self, message: str, type: str, code: str | None) -> bytes:
        fields: dict[str, Any] = {
            "type": "error",
            "code": code,
            "message": message,
            "param": None,
            "error": {"type": type, "code": code, "message": message},
        }
        return b"event: error\ndata: " + dump(fields) + b"\n\n"

    def usage(self, obj: dict[str, Any]) -> tuple[int | None, int | None]:
        response = obj.get("response")
        usage = (response if isinstance(response, dict) else obj).get("usage")
        if isinstance(usage, dict):
            return count(usage.get("input_tokens")), count(usage.get("output_tokens"))
        return None, None

    def seam(self, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
        return refused(origin) if ndjson else ResponsesSeam(origin, sent)

    def check_request(
        self, model: str, prompt: str
    ) -> tuple[bytes, dict[str, Any], dict[str, str]]:
        # (16: the least output the API accepts)
        body = {"model": model, "input": prompt, "max_output_tokens": 16, "stream": True}
        return b"/v1/responses", body, {}


class ResponsesSeam(Seam):
    """The seam of an OpenAI Responses stream (see the module docstring)."""

    wire = "responses"

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
        for name, data in sse_events(events):
            obj = load(data)
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
        self.units = tokens(text)
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
