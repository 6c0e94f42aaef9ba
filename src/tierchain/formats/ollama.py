"""Ollama's native API (``ollama``): NDJSON lines.

- Recognised by a path ending in ``/api/chat``, ``/api/generate``, ``/api/embed`` or
  ``/api/embeddings``; the gateway's own errors on any ``/api/`` path take its shape
  (Ollama's own apps read ``{"error": "..."}`` there).
- Progress is the first complete line; complete at a line with ``"done": true``.
- An error after the response began: an ``{"error": "..."}`` line (the ``ollama``
  client raises ``ResponseError`` for it, ollama/_client.py); a whole error answer
  ``{"error": "..."}``, what Ollama itself answers.
- Usage: the final object (``"done": true``, the last line of a stream) with
  ``prompt_eval_count`` and ``eval_count`` (Ollama leaves ``prompt_eval_count`` out
  when the whole prompt came from its cache: the input is then estimated). No
  terminator event to leave out of a stream's count of units.
- No heartbeat lines: NDJSON has no comments, so an Ollama request is never
  committed as ``text/event-stream`` on the gateway's own account.
- Continuation (:class:`ChatLinesSeam`, ``/api/chat`` only): every line's ``model``
  and ``created_at`` become the first tier's; the ``done`` line says who wrote the
  answer. At the caller's token limit: a ``done`` line with ``"done_reason":
  "length"``. A prefill is the format's own rule (Ollama continues a trailing
  assistant message).

The shapes are Ollama's API reference (docs/api.md: generate, chat) and its server.
"""

from __future__ import annotations

from typing import Any

from .. import _json
from .base import WireFormat, count, refused
from .seam import Seam, dump, load, tokens

__all__ = ["ChatLinesSeam", "Ollama"]


class Ollama(WireFormat):
    """Ollama's native API: see the module docstring."""

    name = "ollama"
    paths = (b"/api/chat", b"/api/generate", b"/api/embed", b"/api/embeddings")
    error_prefix = b"/api/"
    lines = True
    comments = False
    needs_done_line = True
    prefill = "native"

    def line_ends(self, lines: bytes) -> bool:
        last = lines.rstrip().rsplit(b"\n", 1)[-1]
        try:
            parsed = _json.loads(last)
        except ValueError:
            return False
        return isinstance(parsed, dict) and parsed.get("done") is True

    def error_body(
        self, message: str, type: str, code: str | None, extra: dict[str, Any]
    ) -> dict[str, Any]:
        return {"error": message, **extra}

    def usage(self, obj: dict[str, Any]) -> tuple[int | None, int | None]:
        if obj.get("done") is True:
            return count(obj.get("prompt_eval_count")), count(obj.get("eval_count"))
        return None, None

    def seam(self, origin: str, sent: bytes, *, ndjson: bool) -> Seam:
        return ChatLinesSeam(origin, sent) if ndjson else refused(origin)

    def check_request(
        self, model: str, prompt: str
    ) -> tuple[bytes, dict[str, Any], dict[str, str]]:
        body = {"model": model, "prompt": prompt, "stream": True, "options": {"num_predict": 1}}
        return b"/api/generate", body, {"accept": "application/x-ndjson"}


class ChatLinesSeam(Seam):
    """The seam of an Ollama chat stream (see the module docstring)."""

    wire = "ollama"

    def __init__(self, origin: str, lines: bytes) -> None:
        super().__init__(origin)
        self.envelope: dict[str, Any] = {}
        self.created_at = ""
        text: list[str] = []
        for line in lines.splitlines():
            obj = load(line) if line.strip() else None
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
        self.units = tokens(text)

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
        return [(None, load(line)) for line in events.splitlines() if line.strip()]

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
        return dump(obj) + b"\n"
