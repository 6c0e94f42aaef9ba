"""JSON nested too deeply: refused as invalid JSON everywhere the package parses it.

Python's parser recurses once per nested array or object, so a few kilobytes of ``[[[...``
raise RecursionError (not a ValueError). A caller's body gets a 400 in its own wire format
with no traceback logged; an upstream's error body is a failure like any other and the chain
moves on.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tierchain import Backend, Failover, Forwarder, Routes, _json
from tierchain.allowance import prompt_text
from tierchain.picker import prefix_keys
from tierchain.probes import gate_status
from tierchain.wire import answer_event

from .support import FakeBackend, answers, chat_request, on_virtual_time, serve, streams

DEEP = b"[" * 3000 + b"]" * 3000


def deep_body(prefix: bytes = b'{"model":"echo","messages":') -> bytes:
    return prefix + DEEP + b"}"


def test_the_loader_refuses_a_text_nested_past_its_limit_as_a_value_error():
    limit = _json.MAX_DEPTH
    assert _json.loads(b"[" * limit + b"]" * limit) is not None
    with pytest.raises(_json.TooDeep):
        _json.loads(b"[" * (limit + 1) + b"]" * (limit + 1))
    with pytest.raises(ValueError):
        _json.loads(DEEP)
    with pytest.raises(ValueError):
        _json.loads(DEEP.decode())
    deep_object = "".join('{"a":' for _ in range(limit + 1)) + "1" + "}" * (limit + 1)
    with pytest.raises(_json.TooDeep):
        _json.loads(deep_object)


def test_a_wide_text_with_many_brackets_but_little_depth_parses():
    wide = json.dumps({"messages": [{"role": "user", "content": [1, [2]]}] * 500})
    assert len(_json.loads(wide)["messages"]) == 500


def test_the_helpers_that_read_a_body_treat_a_deep_one_as_not_json():
    assert gate_status(b'{"active_generations":' + DEEP + b"}") is None
    assert prefix_keys(deep_body()).keys == []
    assert prompt_text(deep_body())  # the raw text, as for any body that is not JSON
    event = answer_event(500, b'{"error":' + DEEP + b"}", "openai")
    assert event.startswith(b"data: ")


async def post(url: str, path: str, body: bytes) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.post(url + path, content=body)


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/messages", "anthropic"),
        ("/api/chat", "ollama"),
    ],
)
@on_virtual_time
async def test_a_caller_body_nested_too_deeply_gets_400_in_its_format_and_no_traceback(
    path, shape, caplog
):
    caplog.set_level(logging.DEBUG)
    async with FakeBackend("tower") as tower:
        forwarder = Forwarder()
        app = Failover(forwarder, routes=Routes({"echo": [Backend("tower", tower.url)]}))
        async with serve(app) as url:
            response = await post(url, path, deep_body())
        await forwarder.aclose()
    assert response.status_code == 400
    body = response.json()
    if shape == "ollama":
        assert "nested deeper than" in body["error"]
    elif shape == "anthropic":
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert "nested deeper than" in body["error"]["message"]
    else:
        assert "nested deeper than" in body["error"]["message"]
    assert tower.requests == []
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


@on_virtual_time
async def test_an_upstream_error_body_nested_too_deeply_fails_over_to_the_next_tier(caplog):
    caplog.set_level(logging.DEBUG)
    deep_error = b'{"error":' + DEEP + b"}"
    async with (
        FakeBackend("tower", answers(500, deep_error)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        forwarder = Forwarder()
        app = Failover(
            forwarder,
            routes=Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]}),
        )
        async with serve(app) as url:
            response = await post(url, "/v1/chat/completions", chat_request())
        await forwarder.aclose()
    assert response.status_code == 200
    assert response.headers["x-tierchain-attempts"].startswith("tower;outcome=http_500")
    assert response.headers["x-tierchain-backend"] == "hosted"
    assert not [r for r in caplog.records if r.exc_info]
