"""Prefill where the backend takes it, without the operator knowing (tierchain.prefill).

The next tier of an OpenAI chat route is asked what server it is, once, when a stream is
first continued on it: fakes answer as llama.cpp's server (``Server: llama.cpp`` on every
answer), vLLM (``GET /version``: ``{"version": ...}``), Ollama (``GET /api/version``) or
a hosted API (404) do. What was found is remembered in the store (a MemoryStore, or a
real redis-server shared by two gateways), and a prefilled continuation's 400 is
remembered as "no". The operator's ``Backend(prefill=...)`` always wins.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tierchain import Backend, Failover, Forwarder, MemoryStore, RedisStore, Routes
from tierchain.failover.continuation import INSTRUCTION
from tierchain.prefill import FACT, Prefills

from .support import Exchange, FakeBackend, Script, on_virtual_time, serve
from .test_continuation import FULL, TOKENS, chat_events, posts, raw, tower


def server(kind: str, seen: list[dict[str, Any]], *, refuse: bool = False) -> Script:
    """A chat backend that says what it is as ``kind`` does and finishes the answer
    from its request (``refuse``: a 400 to a prefill)."""
    llama = {"server": "llama.cpp"} if kind == "llama.cpp" else {}

    async def script(ex: Exchange) -> None:
        path = ex.request.path
        if ex.request.method == "GET":
            if kind == "vllm" and path == "/version":
                await ex.respond(200, b'{"version":"0.6.3"}', {"content-type": "application/json"})
            elif kind == "ollama" and path == "/api/version":
                await ex.respond(200, b'{"version":"0.5.7"}', {"content-type": "application/json"})
            else:
                await ex.respond(404, b'{"error":"not found"}', llama)
            return
        body = json.loads(ex.request.body)
        seen.append(body)
        last = body["messages"][-1]
        if refuse and last["role"] == "assistant":
            await ex.respond(400, b'{"error":{"message":"no prefill"}}', llama)
            return
        partial = body["messages"][-2 if last["role"] == "user" else -1]["content"]
        rest = FULL[len(partial) :]
        await ex.head(200, llama or None)
        for event in chat_events([rest], model="hosted-model", id="chatcmpl-hosted"):
            await ex.write(event)
        await ex.end()

    return script


async def broken_twice(kind: str, store: Any, **backend: Any) -> tuple[list[Any], Any]:
    """Two callers whose tower breaks after 40 tokens; what the next tier was sent."""
    seen: list[dict[str, Any]] = []
    async with FakeBackend("tower", tower("chat")) as t, FakeBackend("h", server(kind, seen)) as h:
        routes = Routes({"echo": [Backend("tower", t.url), Backend("hosted", h.url, **backend)]})
        forwarder = Forwarder()
        async with serve(Failover(forwarder, routes=routes, store=store)) as url:
            for _ in range(2):
                content = await raw("chat", url)
                assert b"error" not in content
        await forwarder.aclose()
    gets = [r.path for r in h.requests if r.method == "GET"]
    return seen, gets


PARTIAL = "".join(TOKENS[:40]).rstrip()


@pytest.mark.parametrize(
    ("kind", "asked", "adds"),
    [
        ("llama.cpp", ["/version"], {}),
        ("vllm", ["/version"], {"continue_final_message": True, "add_generation_prompt": False}),
        ("ollama", ["/version", "/api/version"], {}),
    ],
)
@on_virtual_time
async def test_a_server_that_takes_a_prefill_is_found_out_once_and_sent_one(kind, asked, adds):
    store = MemoryStore()
    seen, gets = await broken_twice(kind, store)
    assert gets == asked  # once: the second continuation asks the store
    for body in seen:
        assert body["messages"][-1] == {"role": "assistant", "content": PARTIAL}
        assert {k: body[k] for k in adds} == adds
        assert "continue_final_message" in body or not adds
    fact = json.loads(await store.fact_get("hosted", FACT) or "{}")
    assert fact == {"takes": True, "server": kind, "source": "server"}


@on_virtual_time
async def test_a_hosted_api_that_says_nothing_of_itself_is_asked_in_words_and_remembered():
    store = MemoryStore()
    seen, gets = await broken_twice("hosted", store)
    assert gets == ["/version", "/api/version"]
    for body in seen:
        assert body["messages"][-1] == {"role": "user", "content": INSTRUCTION}
        assert "continue_final_message" not in body
    assert json.loads(await store.fact_get("hosted", FACT) or "{}")["takes"] is False


@on_virtual_time
async def test_the_operators_word_wins_and_nothing_is_asked():
    seen, gets = await broken_twice("llama.cpp", MemoryStore(), prefill=False)
    assert gets == []
    assert all(body["messages"][-1]["content"] == INSTRUCTION for body in seen)


@on_virtual_time
async def test_a_prefill_refused_with_a_400_is_remembered_and_the_next_is_asked_in_words():
    store = MemoryStore()
    seen: list[dict[str, Any]] = []
    script = server("llama.cpp", seen, refuse=True)
    async with FakeBackend("tower", tower("chat")) as t, FakeBackend("h", script) as h:
        routes = Routes({"echo": [Backend("tower", t.url), Backend("hosted", h.url)]})
        forwarder = Forwarder()
        async with serve(Failover(forwarder, routes=routes, store=store)) as url:
            first = await raw("chat", url)
            second = await raw("chat", url)
        await forwarder.aclose()
        assert len(posts(h)) == 2
    assert b"failed mid-stream (stream_broken)" in first  # the original break
    assert b"error" not in second  # asked in words: finished
    assert seen[0]["messages"][-1]["role"] == "assistant"
    assert seen[1]["messages"][-1] == {"role": "user", "content": INSTRUCTION}
    fact = json.loads(await store.fact_get("hosted", FACT) or "{}")
    assert fact == {"takes": False, "server": None, "source": "recorded"}


async def test_what_was_found_is_shared_through_redis(redis_server):
    first, second = RedisStore(redis_server.url), RedisStore(redis_server.url)
    try:
        seen, gets = await broken_twice("llama.cpp", first)
        assert gets == ["/version"]
        # A second gateway (a replica, or this one restarted) asks the store, not the server.
        seen, gets = await broken_twice("llama.cpp", second)
        assert gets == []
        assert all(body["messages"][-1]["role"] == "assistant" for body in seen)
    finally:
        await first.aclose()
        await second.aclose()


@on_virtual_time
async def test_a_server_that_does_not_answer_in_time_is_not_remembered():
    async def silent(ex: Exchange) -> None:
        await ex.wait_closed_by_peer()

    async with FakeBackend("h", silent) as h:
        prefills = Prefills(probe_timeout=0.5)
        found = await prefills.for_backend(Backend("hosted", h.url), "openai")
    assert (found.takes, found.source) == (False, "format")
    assert await prefills.store.fact_get("hosted", FACT) is None


async def test_native_formats_take_a_prefill_and_responses_is_asked_in_words():
    prefills = Prefills()
    backend = Backend("b", "http://127.0.0.1:9")
    assert (await prefills.for_backend(backend, "anthropic")).takes is True
    assert (await prefills.for_backend(backend, "ollama")).takes is True
    assert (await prefills.for_backend(backend, "responses")).takes is False
