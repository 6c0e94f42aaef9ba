"""Per-key limits (rpm, tpm, budgets) and token accounting, on real sockets.

The fake backends speak each wire format's usage block as the real services send it
(shapes and sources in tests/wire_fakes.py; OpenAI's usage chunk: platform.openai.com,
"chat.completion.chunk" with ``stream_options: {"include_usage": true}``: a last chunk with
``"choices": []`` and ``usage`` before ``data: [DONE]``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tierchain import Backend, Failover, Forwarder, MemoryStore, RedisStore, Routes
from tierchain.admin import Admin
from tierchain.keys import CallerKey, CallerKeys, load_keys_file
from tierchain.limits import BackendBudget, BackendBudgets, KeyLimits, load_budgets, usage_report

from .support import Exchange, FakeBackend, answers, chat_request, openai_stream, serve, streams
from .wire_fakes import (
    NDJSON,
    _response,
    anthropic_message,
    anthropic_stream,
    ollama_chat_lines,
    responses_stream,
    sends,
)

KEY_A = "sk-gw-team-a-0123456789"
KEY_B = "sk-gw-team-b-9876543210"


def openai_usage_stream(pieces: list[str], prompt: int, completion: int) -> list[bytes]:
    """An OpenAI stream with include_usage: the usage chunk just before [DONE]."""
    events = openai_stream(pieces)
    usage = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    return [*events[:-1], b"data: " + json.dumps(usage).encode() + b"\n\n", events[-1]]


def openai_body(prompt: int, completion: int) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
    ).encode()


def replies(body: bytes, content_type: str = "application/json"):
    async def script(ex: Exchange) -> None:
        await ex.respond(200, body, {"content-type": content_type})

    return script


def limited_gateway(
    routes: dict[str, list[Backend]],
    keys: list[CallerKey],
    *,
    store: Any = None,
    budgets: tuple[BackendBudget, ...] = (),
) -> tuple[Any, Forwarder]:
    forwarder = Forwarder()
    app: Any = BackendBudgets(forwarder, store=store, budgets=budgets)
    app = Failover(app, routes=Routes(routes))
    app = KeyLimits(app, store=store, budgets=budgets)
    return CallerKeys(app, keys=keys), forwarder


async def call(url: str, key: str, body: bytes, path: str = "/v1/chat/completions"):
    # (a safety net, not a bound: fifty of these at once on a loaded machine took over 5 s)
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            url + path, content=body, headers={"authorization": f"Bearer {key}"}
        )


def totals(report: dict[str, Any], key_name: str) -> dict[tuple[str, str], int]:
    return {
        (row["backend"], row["kind"]): row["value"]
        for row in report["usage"]
        if row["key_name"] == key_name
    }


async def test_a_key_over_its_rpm_gets_429_with_retry_after_and_no_backend_sees_it():
    store = MemoryStore()
    async with FakeBackend("tower", streams(["ok"])) as tower:
        app, fwd = limited_gateway(
            {"echo": [Backend("tower", tower.url)]},
            [CallerKey("team-a", KEY_A, rpm=2), CallerKey("team-b", KEY_B)],
            store=store,
        )
        async with serve(app) as url:
            first = [await call(url, KEY_A, chat_request()) for _ in range(2)]
            seen = len(tower.requests)
            refused = await call(url, KEY_A, chat_request())
            other = await call(url, KEY_B, chat_request())  # another key is not limited
        await fwd.aclose()
    assert [r.status_code for r in first] == [200, 200]
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["code"] == "rpm_exceeded"
    assert "team-a" in error["message"]
    assert KEY_A not in refused.text
    assert seen == 2
    assert len(tower.requests) == 3
    assert tower.requests[-1].headers.get("authorization") is None
    assert other.status_code == 200
    assert totals(await usage_report(store), "team-a")[("-", "refused")] == 1


async def test_a_key_whose_tokens_this_minute_are_spent_gets_429_before_any_backend():
    async with FakeBackend("tower", replies(openai_body(8, 4))) as tower:
        app, fwd = limited_gateway(
            {"echo": [Backend("tower", tower.url)]}, [CallerKey("team-a", KEY_A, tpm=10)]
        )
        async with serve(app) as url:
            first = await call(url, KEY_A, chat_request(stream=False))
            tower.requests.clear()
            second = await call(url, KEY_A, chat_request(stream=False))
        await fwd.aclose()
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.json()["error"]["code"] == "tpm_exceeded"
    assert "retry-after" in second.headers
    assert tower.requests == []


async def test_a_spent_budget_gets_429_naming_it_before_any_backend():
    async with FakeBackend("tower", replies(openai_body(30, 20))) as tower:
        app, fwd = limited_gateway(
            {"echo": [Backend("tower", tower.url)]},
            [CallerKey("team-a", KEY_A, budget_tokens=50, budget_period=86400)],
        )
        async with serve(app) as url:
            first = await call(url, KEY_A, chat_request(stream=False))
            tower.requests.clear()
            second = await call(url, KEY_A, chat_request(stream=False))
        await fwd.aclose()
    assert first.status_code == 200
    assert second.status_code == 429
    error = second.json()["error"]
    assert error["code"] == "budget_exceeded"
    assert "50 tokens per 1d" in error["message"]
    assert tower.requests == []


# Each wire format's usage block, stream and whole, as (path, body, script, input, output).
_PIECES = ["Hel", "lo", "!"]


def _formats() -> list[tuple[str, str, bytes, Any, int, int]]:
    anthropic_req = json.dumps(
        {"model": "echo", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    )
    ollama_last = json.loads(ollama_chat_lines(["x"])[-1])
    responses_whole = _response(
        "completed", [], {"input_tokens": 7, "output_tokens": 9, "total_tokens": 16}
    )
    return [
        (
            "openai-stream",
            "/v1/chat/completions",
            chat_request(),
            sends(openai_usage_stream(_PIECES, 11, 3)),
            11,
            3,
        ),
        (
            "openai-whole",
            "/v1/chat/completions",
            chat_request(stream=False),
            replies(openai_body(13, 5)),
            13,
            5,
        ),
        (
            "anthropic-stream",
            "/v1/messages",
            json.dumps({**json.loads(anthropic_req), "stream": True}).encode(),
            sends(anthropic_stream(_PIECES)),
            25,  # message_start.message.usage.input_tokens
            3,  # message_delta.usage.output_tokens
        ),
        (
            "anthropic-whole",
            "/v1/messages",
            anthropic_req.encode(),
            replies(anthropic_message("hi")),
            10,
            2,
        ),
        (
            "responses-stream",
            "/v1/responses",
            json.dumps({"model": "echo", "input": "hi", "stream": True}).encode(),
            sends(responses_stream(_PIECES)),
            5,  # response.completed's response.usage
            3,
        ),
        (
            "responses-whole",
            "/v1/responses",
            json.dumps({"model": "echo", "input": "hi"}).encode(),
            replies(json.dumps(responses_whole).encode()),
            7,
            9,
        ),
        (
            "ollama-stream",
            "/api/chat",
            json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            sends(ollama_chat_lines(_PIECES), headers=NDJSON),
            26,  # the last line's prompt_eval_count
            282,  # and eval_count
        ),
        (
            "ollama-whole",
            "/api/chat",
            json.dumps(
                {"model": "echo", "stream": False, "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            replies(json.dumps(ollama_last).encode()),
            26,
            282,
        ),
    ]


@pytest.mark.parametrize(
    ("path", "body", "script", "tokens_in", "tokens_out"),
    [case[1:] for case in _formats()],
    ids=[case[0] for case in _formats()],
)
async def test_usage_is_counted_from_the_answering_backends_own_usage_block(
    path, body, script, tokens_in, tokens_out, metric
):
    store = MemoryStore()
    labels = {"key_name": "team-a", "route": "echo", "backend": "tower"}
    before = metric("tierchain_tokens_total", **labels, kind="input")
    async with FakeBackend("tower", script) as tower:
        app, fwd = limited_gateway(
            {"echo": [Backend("tower", tower.url)]},
            [CallerKey("team-a", KEY_A, tpm=100_000)],
            store=store,
        )
        async with serve(app) as url:
            response = await call(url, KEY_A, body, path)
        await fwd.aclose()
    assert response.status_code == 200
    got = totals(await usage_report(store), "team-a")
    assert got == {
        ("tower", "input"): tokens_in,
        ("tower", "output"): tokens_out,
        ("-", "requests"): 1,
    }
    assert metric("tierchain_tokens_total", **labels, kind="input") == before + tokens_in


async def test_a_stream_without_a_usage_block_is_estimated_and_marked_so():
    store = MemoryStore()
    async with FakeBackend("tower", streams(["one", "two", "three"])) as tower:
        app, fwd = limited_gateway(
            {"echo": [Backend("tower", tower.url)]},
            [CallerKey("team-a", KEY_A, rpm=100)],
            store=store,
        )
        async with serve(app) as url:
            response = await call(url, KEY_A, chat_request())
        await fwd.aclose()
    assert response.status_code == 200
    got = totals(await usage_report(store), "team-a")
    assert set(got) == {
        ("tower", "input_estimated"),
        ("tower", "output_estimated"),
        ("-", "requests"),
    }
    assert got["tower", "output_estimated"] == 4  # three pieces and the finish chunk
    assert got["tower", "input_estimated"] == len(chat_request()) // 4


async def test_a_failed_attempt_is_told_apart_from_the_billed_one():
    store = MemoryStore()
    async with (
        FakeBackend("tower", answers(500)) as tower,
        FakeBackend("hosted", replies(openai_body(6, 2))) as hosted,
    ):
        app, fwd = limited_gateway(
            {"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]},
            [CallerKey("team-a", KEY_A, rpm=100)],
            store=store,
        )
        async with serve(app) as url:
            response = await call(url, KEY_A, chat_request(stream=False))
        await fwd.aclose()
    assert response.status_code == 200
    got = totals(await usage_report(store), "team-a")
    assert got == {
        ("tower", "failed_attempts"): 2,  # a 500, and the same-tier retry's 500
        ("hosted", "input"): 6,
        ("hosted", "output"): 2,
        ("-", "requests"): 1,
    }


async def test_a_backend_whose_budget_is_spent_is_skipped_and_the_next_tier_answers():
    store = MemoryStore()
    budgets = (BackendBudget("hosted", 10, 3600),)
    async with (
        FakeBackend("hosted", replies(openai_body(8, 4))) as hosted,
        FakeBackend("tower", replies(openai_body(1, 1))) as tower,
    ):
        app, fwd = limited_gateway(
            {"echo": [Backend("hosted", hosted.url), Backend("tower", tower.url)]},
            [CallerKey("team-a", KEY_A), CallerKey("team-b", KEY_B, rpm=100)],
            store=store,
            budgets=budgets,
        )
        async with serve(app) as url:
            first = await call(url, KEY_A, chat_request(stream=False))
            second = await call(url, KEY_B, chat_request(stream=False))
        await fwd.aclose()
    assert first.headers["x-tierchain-attempts"] == "hosted;outcome=ok"
    assert second.status_code == 200
    assert second.headers["x-tierchain-attempts"] == "hosted;outcome=busy, tower;outcome=ok"
    assert len(hosted.requests) == 1


async def test_two_gateways_on_one_redis_share_the_counts(redis_server):
    stores = [RedisStore(redis_server.url), RedisStore(redis_server.url)]
    keys = [CallerKey("team-a", KEY_A, rpm=3)]
    async with FakeBackend("tower", replies(openai_body(4, 2))) as tower:
        one, fwd1 = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=stores[0])
        two, fwd2 = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=stores[1])
        async with serve(one) as url1, serve(two) as url2:
            answers_ = [
                await call(url, KEY_A, chat_request(stream=False))
                for url in (url1, url2, url1, url2)
            ]
        await fwd1.aclose()
        await fwd2.aclose()
    try:
        assert [r.status_code for r in answers_] == [200, 200, 200, 429]
        assert len(tower.requests) == 3
        for store in stores:  # either replica reads the shared totals
            got = totals(await usage_report(store, keys), "team-a")
            assert got[("tower", "input")] == 12
            assert got[("tower", "output")] == 6
            assert got[("-", "requests")] == 3
            assert got[("-", "refused")] == 1
        report = await usage_report(stores[1], keys)
        assert report["limits"][0]["rpm_used"] == 3
    finally:
        for store in stores:
            await store.aclose()


async def test_the_admin_shows_usage_per_key_name_as_json_and_on_its_page():
    store = MemoryStore()
    keys = [CallerKey("team-a", KEY_A, tpm=1000)]
    token = "admin-token-0123456789"
    async with FakeBackend("tower", replies(openai_body(3, 2))) as tower:
        app, fwd = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=store)
        admin = Admin(
            routes={"echo": [Backend("tower", tower.url)]}, store=store, token=token, keys=keys
        )
        async with serve(app) as url, serve(admin) as admin_url:
            await call(url, KEY_A, chat_request(stream=False))
            async with httpx.AsyncClient(timeout=5) as client:
                auth = {"authorization": f"Bearer {token}"}
                usage = (await client.get(admin_url + "/usage", headers=auth)).json()
                page = (await client.get(admin_url + "/", headers=auth)).text
                unauth = await client.get(admin_url + "/usage")
        await fwd.aclose()
    assert unauth.status_code == 401
    assert usage["keys"] == [{"key_name": "team-a", "input": 3, "output": 2, "requests": 1}]
    assert usage["limits"][0]["tpm"] == 1000
    assert usage["limits"][0]["tpm_used"] == 5
    assert KEY_A not in json.dumps(usage)
    assert KEY_A not in page
    assert '<table id="usage">' in page
    assert "5 of 1000" in page


def test_the_keys_file_carries_limits_and_backend_budgets(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(
        '[[keys]]\nname = "team-a"\nkey = "' + KEY_A + '"\nrpm = 60\ntpm = 20000\n'
        'budget_tokens = 1000000\nbudget_period = "1d"\n\n'
        '[[backend_budgets]]\nbackend = "hosted"\ntokens = 500000\nperiod = "12h"\n'
    )
    (key,) = load_keys_file(str(path))
    assert (key.rpm, key.tpm, key.budget_tokens, key.budget_period) == (60, 20000, 1000000, 86400.0)
    assert load_budgets(str(path)) == (BackendBudget("hosted", 500000, 43200.0),)
    path.write_text('[[keys]]\nname = "a"\nkey = "' + KEY_A + '"\nrpm = 0\n')
    with pytest.raises(ValueError, match="rpm must be a whole number >= 1"):
        load_keys_file(str(path))


def test_the_keys_file_on_the_limits_page_loads_as_it_is_shown(tmp_path):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "limits.md").read_text()
    block, prices = re.findall(r"```toml\n(.*?)```", page, re.S)
    path = tmp_path / "keys.toml"
    path.write_text(block)
    env = {"GW_KEY_APP": KEY_A, "GW_KEY_BATCH": KEY_B}
    app, batch = load_keys_file(str(path), env)
    assert (app.rpm, app.tpm, app.budget_tokens, app.budget_period) == (
        600,
        200000,
        5000000,
        86400.0,
    )
    assert (app.max_parallel, app.default_max_tokens) == (8, 2048)
    assert (batch.rpm, batch.tpm, batch.budget_tokens) == (30, 50000, None)
    assert load_budgets(str(path)) == (BackendBudget("hosted", 20000000, 86400.0),)
    # The prices' routes file, as shown.
    import tomllib

    from tierchain.routes_file import routes_from_toml

    tower, hosted = routes_from_toml(tomllib.loads(prices))["chat"]
    assert (tower.price_input, tower.price_output) == (0.0, None)
    assert (hosted.price_input, hosted.price_output) == (0.15, 0.6)


async def test_when_no_tier_answers_only_failed_attempts_are_counted_not_tokens():
    from tierchain import Heartbeats

    store = MemoryStore()
    async with (
        FakeBackend("tower", answers(500)) as tower,
        FakeBackend("hosted", answers(500)) as hosted,
    ):
        forwarder = Forwarder()
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        app: Any = Heartbeats(Failover(forwarder, routes=routes), commit_after=0.0)
        app = CallerKeys(KeyLimits(app, store=store), keys=[CallerKey("team-a", KEY_A, rpm=9)])
        async with serve(app) as url:
            response = await call(url, KEY_A, chat_request())  # a stream: Heartbeats commits
        await forwarder.aclose()
    assert response.status_code == 200  # committed by Heartbeats, then the error event
    assert b'"error"' in response.content
    assert totals(await usage_report(store), "team-a") == {
        ("tower", "failed_attempts"): 2,  # a 500, and the same-tier retry's 500
        ("hosted", "failed_attempts"): 1,  # (retries are counted per request: none left)
        ("-", "requests"): 1,
    }


async def test_an_embeddings_usage_block_has_no_output_tokens_and_nothing_is_estimated():
    body = json.dumps(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}],
            "model": "text-embedding-3-small",
            "usage": {"prompt_tokens": 8, "total_tokens": 8},
        }
    ).encode()
    store = MemoryStore()
    async with FakeBackend("tower", replies(body)) as tower:
        app, fwd = limited_gateway(
            {"echo": [Backend("tower", tower.url)]},
            [CallerKey("team-a", KEY_A, rpm=9)],
            store=store,
        )
        async with serve(app) as url:
            request = json.dumps({"model": "echo", "input": "hello"}).encode()
            response = await call(url, KEY_A, request, "/v1/embeddings")
        await fwd.aclose()
    assert response.status_code == 200
    got = totals(await usage_report(store), "team-a")
    assert got == {("tower", "input"): 8, ("-", "requests"): 1}


def _layers(app: Any) -> list[str]:
    names = []
    while app is not None:
        names.append(type(app).__name__)
        app = getattr(app, "app", None)
    return names


@pytest.mark.parametrize(
    "extra",
    ["", "rpm = 5\n", '\n[[backend_budgets]]\nbackend = "tower"\ntokens = 9\n'],
)
def test_serve_counts_every_key_behind_the_keys_limited_or_not(tmp_path, extra):
    from tierchain.config import from_env
    from tierchain.stack import build_stack

    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nname = "a"\nkey = "{KEY_A}"\n{extra}')
    env = {"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_API_KEYS_FILE": str(keys)}
    layers = _layers(build_stack(None, from_env(env), identity=False))
    assert layers[layers.index("CallerKeys") + 1] == "KeyLimits"  # right behind the keys
    assert ("BackendBudgets" in layers) is ("backend_budgets" in extra)


def test_serve_without_keys_has_no_limits_layer(tmp_path):
    from tierchain.config import from_env
    from tierchain.stack import build_stack

    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    layers = _layers(
        build_stack(None, from_env({"TIERCHAIN_ROUTES_FILE": str(routes)}), identity=False)
    )
    assert "KeyLimits" not in layers
