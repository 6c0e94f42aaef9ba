"""Fake upstreams that speak Anthropic Messages, OpenAI Responses and Ollama's native API.

Each shape is written as the real service sends it; where it comes from:

- Anthropic Messages streaming: docs.anthropic.com, "Streaming Messages" (the
  event flow message_start, content_block_start, ping, content_block_delta,
  content_block_stop, message_delta, message_stop, each as ``event:`` + ``data:``);
  the non-stream body: "Messages" API reference; the 400 for a prompt that does
  not fit: "Errors" (``invalid_request_error``, "prompt is too long: N tokens > M
  maximum").
- OpenAI Responses streaming: platform.openai.com, "Streaming API responses"
  and the API reference's streaming events (response.created, in_progress,
  output_item.added, content_part.added, output_text.delta/done,
  content_part.done, output_item.done, response.completed, each with its
  ``sequence_number``), as the openai SDK's ResponseStreamState
  (openai/lib/streaming/responses/_responses.py) checks them.
- Ollama ``/api/chat``: github.com/ollama/ollama docs/api.md ("Chat request
  (streaming)"): ``application/x-ndjson``, one object per line, the last with
  ``"done": true`` and its timings; errors ``{"error": "..."}``.
- llama.cpp's server context refusal: tools/server/server-common.cpp
  (``format_error_response``, ``exceed_context_size_error``, 400) and
  server-context.cpp ("request (%d tokens) exceeds the available context size
  (%d tokens), try increasing it").
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .support import Exchange, Script


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


# -- Anthropic Messages -------------------------------------------------------------


def anthropic_stream(pieces: Iterable[str], *, model: str = "claude-x") -> list[bytes]:
    pieces = list(pieces)
    events = [
        _event(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_01",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": model,
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": 25, "output_tokens": 1},
                },
            },
        ),
        _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
        ),
        _event("ping", {"type": "ping"}),
    ]
    for piece in pieces:
        events.append(
            _event(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": piece},
                },
            )
        )
    events += [
        _event("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": len(pieces)},
            },
        ),
        _event("message_stop", {"type": "message_stop"}),
    ]
    return events


def anthropic_message(text: str, *, model: str = "claude-x") -> bytes:
    return json.dumps(
        {
            "id": "msg_01",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 2},
        }
    ).encode()


ANTHROPIC_TOO_LONG = json.dumps(
    {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 208310 tokens > 200000 maximum",
        },
    }
).encode()

LLAMA_CPP_TOO_LONG = json.dumps(
    {
        "error": {
            "code": 400,
            "message": "request (9412 tokens) exceeds the available context size (8192 tokens), "
            "try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 9412,
            "n_ctx": 8192,
        }
    }
).encode()

OPENAI_TOO_LONG = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, your "
            "messages resulted in 9412 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
).encode()

ANTHROPIC_OVERLOADED = json.dumps(
    {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
).encode()


# -- OpenAI Responses ---------------------------------------------------------------


def _response(status: str, output: list[dict[str, Any]], usage: Any = None) -> dict[str, Any]:
    return {
        "id": "resp_01",
        "object": "response",
        "created_at": 1741290958,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": "gpt-x",
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
    }


def responses_stream(pieces: Iterable[str]) -> list[bytes]:
    pieces = list(pieces)
    text = "".join(pieces)
    seq = iter(range(10_000))
    item = {"id": "msg_01", "type": "message", "status": "in_progress", "role": "assistant"}
    part = {"type": "output_text", "text": "", "annotations": []}
    done_part = {"type": "output_text", "text": text, "annotations": []}
    done_item = {**item, "status": "completed", "content": [done_part]}
    usage = {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": len(pieces),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5 + len(pieces),
    }

    def ev(name: str, **fields: Any) -> bytes:
        return _event(name, {"type": name, **fields, "sequence_number": next(seq)})

    events = [
        ev("response.created", response=_response("in_progress", [])),
        ev("response.in_progress", response=_response("in_progress", [])),
        ev("response.output_item.added", output_index=0, item={**item, "content": []}),
        ev(
            "response.content_part.added",
            item_id="msg_01",
            output_index=0,
            content_index=0,
            part=part,
        ),
    ]
    for piece in pieces:
        events.append(
            ev(
                "response.output_text.delta",
                item_id="msg_01",
                output_index=0,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
    events += [
        ev(
            "response.output_text.done",
            item_id="msg_01",
            output_index=0,
            content_index=0,
            text=text,
            logprobs=[],
        ),
        ev(
            "response.content_part.done",
            item_id="msg_01",
            output_index=0,
            content_index=0,
            part=done_part,
        ),
        ev("response.output_item.done", output_index=0, item=done_item),
        ev("response.completed", response=_response("completed", [done_item], usage)),
    ]
    return events


# -- Ollama's native API -------------------------------------------------------------


def ollama_chat_lines(pieces: Iterable[str], *, model: str = "llama3.2") -> list[bytes]:
    lines = [
        json.dumps(
            {
                "model": model,
                "created_at": "2023-08-04T08:52:19.385406455-07:00",
                "message": {"role": "assistant", "content": piece},
                "done": False,
            }
        ).encode()
        + b"\n"
        for piece in pieces
    ]
    last = {
        "model": model,
        "created_at": "2023-08-04T19:22:45.499127Z",
        "message": {"role": "assistant", "content": ""},
        "done_reason": "stop",
        "done": True,
        "total_duration": 4883583458,
        "load_duration": 1334875,
        "prompt_eval_count": 26,
        "prompt_eval_duration": 342546000,
        "eval_count": 282,
        "eval_duration": 4535599000,
    }
    return [*lines, json.dumps(last).encode() + b"\n"]


NDJSON = {"content-type": "application/x-ndjson"}


# -- scripts ----------------------------------------------------------------------------


def sends(
    events: list[bytes],
    *,
    headers: dict[str, str] | None = None,
    upto: int | None = None,
    then: str = "end",
) -> Script:
    """Send ``events`` (the first ``upto`` of them), then ``end`` cleanly or ``reset``."""

    async def script(ex: Exchange) -> None:
        await ex.head(200, headers)
        for event in events[:upto]:
            await ex.write(event)
        if then == "reset":
            await ex.reset()
        else:
            await ex.end()

    return script
