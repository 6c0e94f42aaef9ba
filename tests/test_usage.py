"""Token usage as each wire format reports it, the estimates that stand in, and the bounds.

The reported shapes are those of the real services' answers (OpenAI's chat completion and
its last streamed chunk with ``stream_options.include_usage``; the Responses API's
``response.completed`` event; Anthropic's ``message_start`` and cumulative
``message_delta``; Ollama's final ``"done": true`` object), cut to the fields that matter.
"""

from __future__ import annotations

import json
import logging

import pytest

from tierchain import usage
from tierchain.store import USAGE_BOUND
from tierchain.usage import (
    Usage,
    asked_output,
    body_units,
    bounded,
    estimate,
    read_usage,
    reservation,
)
from tierchain.wire import ANTHROPIC, OLLAMA, OPENAI, RESPONSES


def _j(obj: object) -> bytes:
    return json.dumps(obj).encode()


CHAT_BODY = _j(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15},
    }
)
CHAT_LAST_CHUNK = _j(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
    }
)
EMBEDDINGS = _j({"object": "list", "data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}})
RESPONSES_DONE = _j(
    {
        "type": "response.completed",
        "response": {"id": "resp_1", "usage": {"input_tokens": 30, "output_tokens": 11}},
    }
)
ANTHROPIC_START = _j(
    {
        "type": "message_start",
        "message": {"id": "msg_1", "usage": {"input_tokens": 25, "output_tokens": 1}},
    }
)
ANTHROPIC_DELTA_1 = _j({"type": "message_delta", "usage": {"output_tokens": 4}})
ANTHROPIC_DELTA_2 = _j({"type": "message_delta", "usage": {"output_tokens": 9}})
OLLAMA_DONE = _j({"model": "m", "done": True, "prompt_eval_count": 26, "eval_count": 290})
OLLAMA_CACHED = _j({"model": "m", "done": True, "eval_count": 5})  # prompt all from cache


@pytest.mark.parametrize(
    ("wire", "values", "expected"),
    [
        (OPENAI, [CHAT_BODY], (12, 3)),
        (OPENAI, [b'{"choices":[{"delta":{"content":"x"}}]}', CHAT_LAST_CHUNK], (12, 7)),
        (OPENAI, [EMBEDDINGS], (8, 0)),
        (RESPONSES, [RESPONSES_DONE], (30, 11)),
        (ANTHROPIC, [ANTHROPIC_START, ANTHROPIC_DELTA_1, ANTHROPIC_DELTA_2], (25, 9)),
        (OLLAMA, [b'{"done":false,"eval_count":3}', OLLAMA_DONE], (26, 290)),
        (OLLAMA, [OLLAMA_CACHED], (None, 5)),
    ],
    ids=[
        "chat body",
        "chat stream's usage chunk",
        "embeddings",
        "responses completed",
        "anthropic start and the last delta",
        "ollama's final object, not a partial one",
        "ollama with its prompt from cache",
    ],
)
def test_each_wire_format_reports_its_usage_where_its_service_puts_it(wire, values, expected):
    assert read_usage(wire, values) == expected


def test_a_stream_without_a_usage_chunk_reports_nothing():
    chunk = b'{"choices":[{"delta":{"content":"hello"}}]}'
    assert read_usage(OPENAI, [chunk, chunk]) == (None, None)


def test_negative_fractional_or_boolean_counts_are_not_usage():
    bad = _j({"usage": {"prompt_tokens": -1, "completion_tokens": 2.5}})
    truthy = _j({"usage": {"prompt_tokens": True, "completion_tokens": 3}})
    assert read_usage(OPENAI, [bad]) == (None, None)
    assert read_usage(OPENAI, [truthy]) == (None, 3)


def test_an_answer_too_deep_to_parse_is_logged_and_counts_nothing(caplog):
    deep = b'{"usage":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with caplog.at_level(logging.INFO, logger="tierchain"):
        assert read_usage(OPENAI, [deep]) == (None, None)
    assert [r.event for r in caplog.records if hasattr(r, "event")] == ["usage.unreadable"]


def test_the_estimate_stands_in_only_for_the_side_not_reported_and_says_so():
    assert estimate((12, 7), 4000, 99) == Usage(12, 7)
    assert estimate((None, 7), 4000, 99) == Usage(1000, 7, input_estimated=True)
    assert estimate((12, None), 4000, 99) == Usage(12, 99, output_estimated=True)
    assert estimate((None, None), 2, 0) == Usage(1, 0, True, True)  # at least one token in


def test_a_whole_bodys_output_is_estimated_at_four_bytes_a_token():
    assert body_units(4001) == 1000


def test_a_number_past_the_bound_is_recorded_at_the_bound_and_logged_once(caplog):
    usage._CLAMPED.discard(("output", "test-backend"))
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        assert bounded(10**31, "output", "test-backend") == USAGE_BOUND
        assert bounded(2**64, "output", "test-backend") == USAGE_BOUND
    clamped = [r for r in caplog.records if getattr(r, "event", "") == "usage.clamped"]
    assert len(clamped) == 1
    assert clamped[0].tierchain["reported"] == 10**31
    assert bounded(-5, "output", "test-backend") == 0
    assert bounded(USAGE_BOUND, "output", "test-backend") == USAGE_BOUND


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        (_j({"model": "m", "max_tokens": 20}), 20),
        (_j({"model": "m", "max_completion_tokens": 30}), 30),
        (_j({"model": "m", "max_output_tokens": 40}), 40),
        (_j({"model": "m", "options": {"num_predict": 50}}), 50),
        (_j({"model": "m", "options": {"num_predict": -1}}), None),  # Ollama: no limit
        (_j({"model": "m"}), None),
        (b"not json but names max_tokens", None),
    ],
    ids=["max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict",
         "num_predict -1", "none named", "not json"],
)  # fmt: skip
async def test_the_output_a_request_asks_for_is_read_from_each_formats_key(body, asked):
    assert await asked_output(body) == asked


async def test_a_reservation_is_the_prompt_estimate_plus_what_the_request_may_write():
    body = _j({"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "x"}]})
    prompt, reserved = await reservation(body, default=4096)
    assert prompt >= 1
    assert reserved == prompt + 100
    _, by_default = await reservation(_j({"model": "m"}), default=4096)
    assert by_default > 4096
    _, huge = await reservation(_j({"model": "m", "max_tokens": 10**30}), default=4096)
    assert huge == USAGE_BOUND
