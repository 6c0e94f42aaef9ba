"""What is never continued, end to end, with the outcome docs/continuation.md names: an
Anthropic ``thinking`` block in flight (``tool_calls``), a stream of several choices
(``unsupported``), and a next tier that answers the continuation with 400 (its attempt's
outcome ``prefill_rejected``).

Over real sockets through the README's stack (tests/test_continuation.py's gateway), on
virtual time. The Anthropic events follow Anthropic's "Streaming Messages" page (extended
thinking: a ``thinking`` content block with ``thinking_delta`` and ``signature_delta``
deltas, before the text block); the chat chunks the OpenAI API reference's chunk object.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .support import Exchange, on_virtual_time
from .test_continuation import finisher, gateway, raw, refuses_prefill, tower
from .wire_fakes import anthropic_stream


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


async def cut_while_thinking(ex: Exchange) -> None:
    """An Anthropic stream whose model is still thinking when the connection resets."""
    start = anthropic_stream([], model="tower-model")[0]  # message_start
    await ex.head()
    await ex.write(start)
    await ex.write(
        _event(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        )
    )
    for piece in ("Let me count", " to sixty."):
        delta = {"type": "thinking_delta", "thinking": piece}
        await ex.write(
            _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": delta},
            )
        )
    await asyncio.sleep(0.1)  # (virtual) the gateway has read every event sent
    await ex.reset()


def _chunk(index: int, delta: dict[str, Any]) -> bytes:
    payload = {
        "id": "chatcmpl-tower",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "tower-model",
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def two_choices_then_cut(ex: Exchange) -> None:
    """A chat stream of ``n: 2`` (chunks for choice 0 and choice 1), cut by a reset."""
    await ex.head()
    for i in range(5):
        await ex.write(_chunk(0, {"content": f"a{i} "}))
        await ex.write(_chunk(1, {"content": f"b{i} "}))
    await asyncio.sleep(0.1)
    await ex.reset()


def continuations(metric: Any, outcome: str) -> float:
    return float(
        metric(
            "tierchain_continuations_total",
            route="echo",
            to="hosted",
            outcome=outcome,
            **{"from": "tower"},
        )
    )


@on_virtual_time
async def test_an_anthropic_stream_cut_in_a_thinking_block_is_not_continued(metric):
    before = continuations(metric, "tool_calls")
    async with gateway(cut_while_thinking, finisher("anthropic")) as (url, _, hosted):
        content = await raw("anthropic", url)
        assert hosted.requests == []
    assert continuations(metric, "tool_calls") - before == 1
    assert content.endswith(b"\n\n")
    last = content.rstrip(b"\n").split(b"\n\n")[-1]
    assert last.startswith(b"event: error\n")
    assert b"stream_broken" in last


@on_virtual_time
async def test_a_stream_of_several_choices_is_not_continued_outcome_unsupported(metric):
    before = continuations(metric, "unsupported")
    async with gateway(two_choices_then_cut, finisher("chat")) as (url, _, hosted):
        content = await raw("chat", url)
        assert hosted.requests == []
    assert continuations(metric, "unsupported") - before == 1
    assert content.endswith(
        b'(stream_broken)","type":"upstream_error","code":"stream_broken"}}\n\n'
    )


@on_virtual_time
async def test_a_next_tier_refusing_the_continuation_is_an_attempt_of_outcome_prefill_rejected(
    metric,
):
    labels = {"route": "echo", "backend": "hosted", "outcome": "prefill_rejected"}
    before = metric("tierchain_attempts_total", **labels)
    async with gateway(tower("chat"), refuses_prefill) as (url, _, hosted):
        await raw("chat", url)
        # (besides the GETs that ask the server what it is, for OpenAI chat)
        assert [r.method for r in hosted.requests].count("POST") == 1
    assert metric("tierchain_attempts_total", **labels) - before == 1
    assert metric("tierchain_attempts_total", **{**labels, "outcome": "http_400"}) == 0
