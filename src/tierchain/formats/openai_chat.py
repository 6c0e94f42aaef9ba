"""OpenAI chat, completions and embeddings (``openai``): the default wire format.

- Recognised by a path ending in ``/chat/completions``, ``/completions`` or
  ``/embeddings``, and any path no other format claims.
- Complete at ``data: [DONE]``, or a ``finish_reason`` in one of the last two data
  events before a clean end (a backend's ``stream_end`` may name another terminator).
- An error after the response began: ``data: {"error": {"message","type","code"}}``
  (the ``openai`` SDK raises ``APIError`` for a data object with ``error``,
  openai/_streaming.py); a whole error answer ``{"error": {...}}``.
- Usage: the body's ``usage`` (``prompt_tokens``, ``completion_tokens``); in a stream,
  the last chunk before ``data: [DONE]`` (``"choices": []``), only when the request
  asked with ``stream_options: {"include_usage": true}``.
- Heartbeat lines (SSE comments) may go in.
- Continuation (:class:`ChatSeam`): every chunk's ``id``, ``model``, ``created`` (and
  ``system_fingerprint``) become the first tier's; the repeated ``role`` is dropped;
  ``data: [DONE]`` passes once, at the end; the answer's last chunk (its finish, its
  usage) says who wrote it (``"tierchain": {..., "written_by": [...]}``). At the
  caller's token limit the stream ends as OpenAI ends one: a chunk with
  ``"finish_reason": "length"``, then ``data: [DONE]``. A prefill depends on the
  server behind the endpoint (llama.cpp, vLLM and Ollama take one: :mod:`tierchain.prefill`
  asks).

The shapes are OpenAI's API reference (chat.completion.chunk) and the ``openai`` SDK's.
"""

from __future__ import annotations

from typing import Any

from ..sse import events as sse_events
from .base import WireFormat, refused
from .seam import Seam, load, tokens

__all__ = ["ChatSeam", "OpenAIChat"]


class OpenAIChat(WireFormat):
    """OpenAI chat, completions and embeddings: every default of :class:`WireFormat`."""

    name = "openai"
    paths = (b"/chat/completions", b"/completions", b"/embeddings")
    prefill = "ask"

    def seam(self, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
        return refused(origin) if ndjson else ChatSeam(origin, sent)


class ChatSeam(Seam):
    """The seam of an OpenAI chat stream (see the module docstring)."""

    wire = "openai"

    def __init__(self, origin: str, events: bytes) -> None:
        super().__init__(origin)
        self.envelope: dict[str, Any] = {}
        text: list[str] = []
        for _, data in sse_events(events):
            if data == b"[DONE]":
                continue
            obj = load(data)
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
        self.units = tokens(text)

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
