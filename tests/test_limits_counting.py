"""What an answer is counted as, exactly (docs/limits.md, "what is counted"): the tokens a
backend reported, or estimated and marked so where it reported none (a whole body by its
size, a stream by its data events, an Ollama stream without a terminator to leave out), a
stream the backend broke as ``failed_`` tokens, a stream the key's own limit ended as an
answer, nothing for an answer that is not a 2xx, and a usage number past the bound at the
bound.

The layer is driven as ASGI directly (tests/test_limits_admission.py's ``ask``); behind it
either a small app answering (no TierRequest: nothing routed) or the routed stack with a
fake backend on a real socket.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tierchain import Backend, Failover, Forwarder, MemoryStore, Routes
from tierchain.accounts import total_field
from tierchain.keys import CallerKey, CallerKeys
from tierchain.limits import KeyLimits
from tierchain.store import USAGE_BOUND

from .support import Exchange, FakeBackend, chat_request, on_virtual_time, openai_stream
from .test_limits_admission import KEY, ask


def answering(status: int, chunks: list[bytes], content_type: bytes) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type)],
            }
        )
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


async def counted(store: MemoryStore, route: str = "-", backend: str = "-") -> dict[str, int]:
    """The key's running totals for (route, backend), by kind."""
    prefix = total_field("team-a", route, backend, "")
    return {
        field[len(prefix) :]: value
        for field, value in (await store.usage_totals()).items()
        if field.startswith(prefix)
    }


def alone(store: MemoryStore, inner: Any, **limits: Any) -> Any:
    key = CallerKey("team-a", KEY, **(limits or {"rpm": 100}))
    return CallerKeys(KeyLimits(inner, store=store), keys=[key])


@on_virtual_time
async def test_a_whole_answer_without_usage_is_estimated_by_its_size():
    store = MemoryStore()
    body = b'{"object": "chat.completion", "choices": []}'  # 44 bytes
    answer = await ask(alone(store, answering(200, [body], b"application/json")))
    assert answer.status == 200
    assert await counted(store) == {"requests": 1, "input_estimated": 1, "output_estimated": 11}


@on_virtual_time
async def test_a_stream_without_usage_is_estimated_by_its_data_events_less_the_terminator():
    store = MemoryStore()
    events = openai_stream(["one", "two", "three"])  # three pieces, the finish, [DONE]
    answer = await ask(alone(store, answering(200, events, b"text/event-stream")))
    assert answer.status == 200
    assert await counted(store) == {"requests": 1, "input_estimated": 1, "output_estimated": 4}


@on_virtual_time
async def test_a_stream_of_its_terminator_alone_is_estimated_at_no_output():
    store = MemoryStore()
    answer = await ask(alone(store, answering(200, [b"data: [DONE]\n\n"], b"text/event-stream")))
    assert answer.status == 200
    assert await counted(store) == {"requests": 1, "input_estimated": 1}


@on_virtual_time
async def test_an_answer_that_is_not_a_2xx_counts_no_tokens_even_with_a_usage_block():
    body = json.dumps({"usage": {"prompt_tokens": 5, "completion_tokens": 7}}).encode()
    for status in (199, 300, 429):
        store = MemoryStore()
        await ask(alone(store, answering(status, [body], b"application/json")))
        assert await counted(store) == {"requests": 1}, status
    store = MemoryStore()
    await ask(alone(store, answering(299, [body], b"application/json")))
    assert await counted(store) == {"requests": 1, "input": 5, "output": 7}


@on_virtual_time
async def test_a_usage_number_past_the_bound_is_counted_at_the_bound_and_logged_once(
    monkeypatch, caplog
):
    from tierchain import usage

    monkeypatch.setattr(usage, "_CLAMPED", set())  # (logged once a process: as if the first)
    store = MemoryStore()
    body = json.dumps({"usage": {"prompt_tokens": 10**30, "completion_tokens": 10**30}}).encode()
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        await ask(alone(store, answering(200, [body], b"application/json")))
    assert await counted(store) == {"requests": 1, "input": USAGE_BOUND, "output": USAGE_BOUND}
    clamped = [r.tierchain for r in caplog.records if getattr(r, "event", None) == "usage.clamped"]
    assert clamped == [{"what": "usage", "source": "-", "reported": 10**30, "bound": USAGE_BOUND}]


def routed(store: MemoryStore, url: str, wire: str | None = None, **limits: Any) -> Any:
    forwarder = Forwarder()
    routes = Routes({"echo": [Backend("tower", url, wire_format=wire)]})
    return alone(store, Failover(forwarder, routes=routes), **limits), forwarder


def ollama_lines(pieces: list[str]) -> list[bytes]:
    """An Ollama chat stream whose last line carries no counts."""
    lines = [
        {"model": "m", "message": {"role": "assistant", "content": p}, "done": False}
        for p in pieces
    ]
    lines.append({"model": "m", "message": {"role": "assistant", "content": ""}, "done": True})
    return [json.dumps(line).encode() + b"\n" for line in lines]


@on_virtual_time
async def test_an_ollama_stream_without_counts_is_estimated_by_every_line():
    store = MemoryStore()
    lines = ollama_lines(["a", "b", "c"])

    async def script(ex: Exchange) -> None:
        await ex.head(headers={"content-type": "application/x-ndjson"})
        for line in lines:
            await ex.write(line)
        await ex.end()

    body = json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]}).encode()
    async with FakeBackend("tower", script) as tower:
        app, forwarder = routed(store, tower.url, wire="ollama")
        answer = await ask(app, body)
        await forwarder.aclose()
    assert answer.status == 200
    assert await counted(store, "echo", "tower") == {
        "input_estimated": len(body) // 4,
        "output_estimated": 4,  # every line: Ollama has no terminator to leave out
    }


@on_virtual_time
async def test_a_stream_the_backend_broke_counts_failed_tokens_never_estimated_ones():
    store = MemoryStore()
    body = chat_request()
    events = openai_stream(["a", "b", "c", "d", "e", "f"])

    async def breaking(ex: Exchange) -> None:
        await ex.head()
        for event in events[:4]:
            await ex.write(event)
        await ex.close()  # FIN without the last chunk

    async with FakeBackend("tower", breaking) as tower:
        app, forwarder = routed(store, tower.url)
        answer = await ask(app, body)
        await forwarder.aclose()
    assert answer.status == 200
    assert await counted(store, "echo", "tower") == {
        "failed_attempts": 1,
        "failed_input": len(body) // 4,
        "failed_output": 3,  # four data events, less the terminator an estimate leaves out
    }


@on_virtual_time
async def test_a_stream_its_keys_tpm_ended_is_counted_as_answered_by_the_events_passed_on():
    store = MemoryStore()
    body = json.dumps(
        {
            "model": "echo",
            "stream": True,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()
    prompt = 24  # tierchain.usage.reservation(body, 0)[0]
    pieces = [f"p{i}" for i in range(20)]
    async with FakeBackend("tower", lambda ex: _stream(ex, openai_stream(pieces))) as tower:
        app, forwarder = routed(store, tower.url, tpm=prompt + 5)
        answer = await ask(app, body)
        await forwarder.aclose()
    assert answer.status == 200
    data = [line for line in answer.body.split(b"\n\n") if line.startswith(b"data:")]
    assert len(data) == 7  # six pieces (the one that crossed included), then the error
    assert b'"tpm_exceeded"' in data[-1]
    assert await counted(store, "echo", "tower") == {
        "input_estimated": len(body) // 4,
        "output_estimated": 6,
    }


async def _stream(ex: Exchange, events: list[bytes]) -> None:
    await ex.head()
    for event in events:
        await ex.write(event)
    await ex.end()
