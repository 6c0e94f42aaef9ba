"""Reserve, then settle: a key's token limits hold under concurrency, on real sockets.

Each request holds its prompt estimate plus its ``max_tokens`` in its key's token windows
from admission to its end, where the hold is replaced by what it spent; a stream that runs
past its hold holds more, or is ended at its next event once the key has no room. The
concurrent callers are real clients on real uvicorn servers (and a real redis-server where
replicas share the counts); the fake backend holds every admitted request until all the
callers are either at the backend or refused, so that they all overlap.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest

from tierchain import Backend, MemoryStore, RedisStore
from tierchain.keys import CallerKey
from tierchain.limits import usage_report
from tierchain.store import USAGE_BOUND

from .support import Exchange, FakeBackend, answers, openai_stream, serve
from .test_limits import KEY_A, KEY_B, call, limited_gateway, openai_body, totals

BUDGET = 1000


def asking(max_tokens: int | None, *, stream: bool = False) -> bytes:
    body: dict[str, Any] = {
        "model": "echo",
        "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return json.dumps(body).encode()


class Gate:
    """Holds every request at the backend until the test opens it."""

    def __init__(self) -> None:
        self.arrived = 0
        self.answered = 0
        self.callers = 0
        self.open = asyncio.Event()
        self.came = asyncio.Event()  # set at each arrival

    def _check(self) -> None:
        if self.callers and self.arrived + self.answered >= self.callers:
            self.open.set()

    def answering(self, body: bytes) -> Any:
        async def script(ex: Exchange) -> None:
            self.arrived += 1
            self.came.set()
            self._check()
            await self.open.wait()
            await ex.respond(200, body)

        return script

    def streaming(self, events: list[bytes]) -> Any:
        async def script(ex: Exchange) -> None:
            self.arrived += 1
            self.came.set()
            self._check()
            await self.open.wait()
            await ex.head()
            for event in events:
                await ex.write(event)
            await ex.end()

        return script

    async def overlap(self, tasks: list[asyncio.Task[httpx.Response]]) -> None:
        """Open once every caller is at the backend or already answered (refused)."""

        def answered(_: object) -> None:
            self.answered += 1
            self._check()

        self.callers = len(tasks)
        for task in tasks:
            task.add_done_callback(answered)
        self._check()
        await self.open.wait()


def spent(report: dict[str, Any], key_name: str) -> int:
    return sum(
        value
        for (backend, kind), value in totals(report, key_name).items()
        if backend != "-" and "attempts" not in kind
    )


@pytest.fixture(params=["memory", "redis"])
async def stores(request):
    """Two stores the two replicas use: one MemoryStore shared in one process, or two
    RedisStores on one real redis-server."""
    if request.param == "memory":
        store = MemoryStore()
        yield [store, store]
        return
    server = request.getfixturevalue("redis_server")
    made = [RedisStore(server.url, timeout=2.0), RedisStore(server.url, timeout=2.0)]
    try:
        yield made
    finally:
        for store in made:
            await store.aclose()


async def test_fifty_concurrent_requests_spend_at_most_the_budget_plus_one_request(stores):
    gate = Gate()
    keys = [CallerKey("team-a", KEY_A, budget_tokens=BUDGET)]
    async with FakeBackend("hosted", gate.answering(openai_body(10, 90))) as hosted:
        routes = {"echo": [Backend("hosted", hosted.url)]}
        one, fwd1 = limited_gateway(routes, keys, store=stores[0])
        two, fwd2 = limited_gateway(routes, keys, store=stores[1])
        async with serve(one) as url1, serve(two) as url2:
            tasks = [
                asyncio.create_task(call((url1, url2)[i % 2], KEY_A, asking(90))) for i in range(50)
            ]
            await gate.overlap(tasks)
            answers = await asyncio.gather(*tasks)
        await fwd1.aclose()
        await fwd2.aclose()
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(ok) + len(refused) == 50
    assert {a.json()["error"]["code"] for a in refused} == {"budget_exceeded"}
    used = spent(await usage_report(stores[0], keys), "team-a")
    assert used == 100 * len(ok)
    assert used <= BUDGET + 100  # the budget plus one request's own spend, never more
    assert len(ok) == 9  # and the budget is used, not kept idle: each held 116 (26 + 90)
    # Once settled, the windows hold what was spent, not what was reserved.
    report = await usage_report(stores[1], keys)
    assert report["limits"][0]["budget_used"] == used


def overlong_stream(events: int) -> list[bytes]:
    """A stream that ignores max_tokens: ``events`` data events, then [DONE]."""
    return openai_stream(["x"] * events)


async def test_ten_concurrent_streams_stay_within_tpm_and_a_crossing_stream_ends_cleanly(stores):
    gate = Gate()
    tpm = 1000
    keys = [CallerKey("team-a", KEY_A, tpm=tpm)]
    async with FakeBackend("tower", gate.streaming(overlong_stream(400))) as tower:
        routes = {"echo": [Backend("tower", tower.url)]}
        one, fwd1 = limited_gateway(routes, keys, store=stores[0])
        two, fwd2 = limited_gateway(routes, keys, store=stores[1])
        async with serve(one) as url1, serve(two) as url2:
            tasks = [
                asyncio.create_task(call((url1, url2)[i % 2], KEY_A, asking(100, stream=True)))
                for i in range(10)
            ]
            await gate.overlap(tasks)
            answers = await asyncio.gather(*tasks)
        await fwd1.aclose()
        await fwd2.aclose()
    streamed = [a for a in answers if a.status_code == 200]
    assert len(streamed) == 8  # each held 125 (25 + 100): the ninth found the minute full
    assert all(a.status_code in (200, 429) for a in answers)
    report = await usage_report(stores[0], keys)
    per_request = [
        a.text.count("data: {") - 1 for a in streamed
    ]  # data events each, without the error event
    used = spent(report, "team-a")
    assert used <= tpm + max(per_request) + 64  # (64: a prompt estimate's worth)
    for answer in streamed:
        events = [e for e in answer.text.split("\n\n") if e]
        assert "[DONE]" not in answer.text  # cut: not a complete stream
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["error"]["code"] == "tpm_exceeded"
        assert all(e.startswith("data: ") for e in events)  # whole events only


async def test_a_stream_within_the_room_left_holds_more_and_is_never_cut():
    """A key with room beyond a request's reservation: its long stream asks for more as it
    goes, and gets it."""
    keys = [CallerKey("team-a", KEY_A, budget_tokens=100_000)]
    store = MemoryStore()
    gate = Gate()
    gate.open.set()
    async with FakeBackend("tower", gate.streaming(overlong_stream(1500))) as tower:
        app, fwd = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=store)
        async with serve(app) as url:
            answer = await call(url, KEY_A, asking(10, stream=True))
        await fwd.aclose()
    assert answer.text.endswith("data: [DONE]\n\n")
    assert answer.text.count("data: {") == 1501  # (and the finish_reason event)
    report = await usage_report(store, keys)
    assert report["limits"][0]["budget_used"] == spent(report, "team-a")


@pytest.mark.parametrize("huge", [2**64, 10**31])
async def test_a_huge_usage_number_is_recorded_at_the_bound_and_every_limit_holds(
    stores, huge, caplog
):
    key_c = "sk-gw-team-c-5555555555"
    keys = [
        CallerKey("team-a", KEY_A, tpm=10_000),
        CallerKey("team-b", KEY_B, rpm=2),
        CallerKey("team-c", key_c),
    ]
    lying = openai_body(3, 4).replace(
        b'"completion_tokens": 4', f'"completion_tokens": {huge}'.encode()
    )
    name = f"liar-{len(str(huge))}-{type(stores[0]).__name__}"  # (logged once per process)
    async with FakeBackend(name, answers(200, lying)) as liar:
        app, fwd = limited_gateway({"echo": [Backend(name, liar.url)]}, keys, store=stores[0])
        async with serve(app) as url:
            with caplog.at_level(logging.WARNING, logger="tierchain"):
                first = await call(url, KEY_A, asking(5))
                again = await call(url, KEY_A, asking(5))
                unlimited = [(await call(url, key_c, asking(5))).status_code for _ in range(2)]
            b = [(await call(url, KEY_B, asking(5))).status_code for _ in range(3)]
        await fwd.aclose()
    assert first.status_code == 200
    assert again.status_code == 429  # the key's own tpm: it did report that much
    assert again.json()["error"]["code"] == "tpm_exceeded"
    assert unlimited == [200, 200]
    assert b == [200, 200, 429]  # another key's rpm still holds: the store is still there
    assert not getattr(stores[0], "degraded", False)
    report = await usage_report(stores[0], keys)
    assert totals(report, "team-a")[(name, "output")] == USAGE_BOUND
    assert totals(report, "team-c")[(name, "output")] == 2 * USAGE_BOUND
    clamped = [r for r in caplog.records if "usage.clamped" in r.getMessage()]
    assert len(clamped) == 1  # logged once, not once a request


async def test_a_refused_redis_script_fails_that_write_and_never_turns_redis_off(redis_server):
    import redis.asyncio as aioredis
    from redis.exceptions import ResponseError

    from tierchain.store import WindowCheck

    store = RedisStore(redis_server.url, timeout=2.0)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        check = WindowCheck("rpm\tteam-a", 60.0, 1, 1)
        assert await store.window_admit([check]) is None
        await raw.set("tierchain:usage", "not a hash")  # the totals script will be refused
        with pytest.raises(ResponseError):
            await store.usage_record([], [("team-a\t-\t-\trequests", 1)])
        assert not store.degraded
        refused = await store.window_admit([check])  # still Redis's window, not an empty one
        assert refused is not None
    finally:
        await raw.aclose()
        await store.aclose()


async def test_max_parallel_refuses_the_one_too_many_and_every_ending_gives_its_place_back(
    stores,
):
    gate = Gate()
    keys = [CallerKey("team-a", KEY_A, max_parallel=2)]
    store = stores[0]
    async with (
        FakeBackend("tower", gate.answering(openai_body(1, 1))) as tower,
        FakeBackend("broken", answers(500)) as broken,
    ):
        routes = {"echo": [Backend("tower", tower.url)], "bad": [Backend("broken", broken.url)]}
        app, fwd = limited_gateway(routes, keys, store=store)
        two, fwd2 = limited_gateway(routes, keys, store=stores[1])
        async with serve(app) as url, serve(two) as url2:
            tasks = [
                asyncio.create_task(call((url, url2)[i % 2], KEY_A, asking(5))) for i in range(5)
            ]
            await gate.overlap(tasks)
            first = await asyncio.gather(*tasks)
            # A failed answer and a caller who leaves give their places back too.
            failed = await call(url, KEY_A, asking(5).replace(b'"echo"', b'"bad"'))
            gate.open.clear()
            gate.came.clear()
            gate.callers = 0  # (held until the test opens it)
            async with httpx.AsyncClient(timeout=5) as client:
                leaving = asyncio.create_task(
                    client.post(
                        url + "/v1/chat/completions",
                        content=asking(5),
                        headers={"authorization": f"Bearer {KEY_A}"},
                    )
                )
                await gate.came.wait()
                leaving.cancel()
            gate.open.set()
            after = [await call(url, KEY_A, asking(5)) for _ in range(3)]
        await fwd.aclose()
        await fwd2.aclose()
    codes = sorted(a.status_code for a in first)
    assert codes == [200, 200, 429, 429, 429]
    refused = next(a for a in first if a.status_code == 429)
    assert refused.json()["error"]["code"] == "parallel_exceeded"
    assert failed.status_code >= 500
    assert [a.status_code for a in after] == [200, 200, 200]
    assert await store.lease_count("\tteam-a") == 0


async def test_limited_keys_get_litellms_ratelimit_headers():
    keys = [CallerKey("team-a", KEY_A, rpm=5, tpm=10_000)]
    store = MemoryStore()
    async with FakeBackend("tower", answers(200, openai_body(10, 20))) as tower:
        app, fwd = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=store)
        async with serve(app) as url:
            got = [await call(url, KEY_A, asking(50)) for _ in range(6)]
        await fwd.aclose()
    first, second, last = got[0].headers, got[1].headers, got[-1].headers
    assert first["x-ratelimit-limit-requests"] == "5"
    assert first["x-ratelimit-remaining-requests"] == "4"
    assert second["x-ratelimit-remaining-requests"] == "3"
    assert first["x-ratelimit-limit-tokens"] == "10000"
    held = 10_000 - int(first["x-ratelimit-remaining-tokens"])
    assert 50 < held < 120  # the prompt estimate plus max_tokens, held while it runs
    assert int(second["x-ratelimit-remaining-tokens"]) == 10_000 - 30 - held  # settled: 30
    assert first["x-ratelimit-reset-requests"].endswith("s")
    assert got[-1].status_code == 429
    assert last["x-ratelimit-remaining-requests"] == "0"


async def test_a_spent_budget_says_when_it_renews_and_the_openai_sdk_does_not_retry_it():
    import openai

    keys = [CallerKey("team-a", KEY_A, budget_tokens=20, budget_period=3600)]
    store = MemoryStore()
    async with FakeBackend("tower", answers(200, openai_body(10, 20))) as tower:
        app, fwd = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=store)
        async with serve(app) as url:
            await call(url, KEY_A, asking(5))  # spends 30 of 20
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=3)
            with pytest.raises(openai.RateLimitError) as raised:
                await client.chat.completions.create(
                    model="echo", messages=[{"role": "user", "content": "hi"}]
                )
            await client.close()
        await fwd.aclose()
    answer = raised.value.response
    assert answer.headers["x-should-retry"] == "false"
    error = answer.json()["error"]
    assert error["code"] == "budget_exceeded"
    assert 3000 < error["renews_in_s"] <= 3600
    assert error["renews_at"].endswith("Z")
    assert f"{error['renews_in_s']}s" in error["message"]
    # One request reached the gateway for the SDK's call: it did not retry.
    assert totals(await usage_report(store, keys), "team-a")[("-", "refused")] == 1


async def test_every_key_is_counted_with_what_its_answers_cost(metric, caplog):
    keys = [CallerKey("team-cost", KEY_A)]  # no limit at all: counted all the same
    store = MemoryStore()
    cost_labels = {"key_name": "team-cost", "route": "echo", "backend": "paid"}
    cost_before = metric("tierchain_cost_total", **cost_labels)  # (a run before this one)
    async with (
        FakeBackend("paid", answers(200, openai_body(1000, 500))) as paid,
        FakeBackend("local", answers(200, openai_body(10, 10))) as local,
        FakeBackend("unpriced", answers(200, openai_body(10, 10))) as unpriced,
    ):
        routes = {
            "echo": [Backend("paid", paid.url, price_input=0.15, price_output=0.6)],
            "home": [Backend("local", local.url, price_input=0)],
            "other": [Backend("unpriced", unpriced.url)],
        }
        app, fwd = limited_gateway(routes, keys, store=store)
        async with serve(app) as url:
            with caplog.at_level(logging.INFO, logger="tierchain"):
                for model in ("echo", "home", "other"):
                    body = asking(5).replace(b'"echo"', f'"{model}"'.encode())
                    assert (await call(url, KEY_A, body)).status_code == 200
        await fwd.aclose()
    report = await usage_report(store)
    rows = {(r["backend"], r["kind"]): r["cost"] for r in report["usage"]}
    assert rows[("paid", "input")] == pytest.approx(0.00015)
    assert rows[("paid", "output")] == pytest.approx(0.0003)
    assert rows[("local", "input")] == 0.0  # free, which is not unpriced
    assert rows[("unpriced", "input")] is None
    assert report["keys"][0]["cost"] == pytest.approx(0.00045)
    paid_cost = metric("tierchain_cost_total", **cost_labels) - cost_before
    assert paid_cost == pytest.approx(0.00045)
    lines = [r.getMessage() for r in caplog.records if "usage.recorded" in r.getMessage()]
    assert len(lines) == 3
    assert any("cost=0.00045" in line for line in lines)
    tokens = metric(
        "gen_ai_client_token_usage_sum",
        gen_ai_operation_name="chat",
        gen_ai_request_model="echo",
        gen_ai_token_type="output",
    )
    assert tokens >= 500


def test_check_config_and_the_identity_line_show_each_keys_limits_never_the_key(tmp_path):
    import io

    from tierchain.__main__ import check_config
    from tierchain.config import from_env
    from tierchain.identity import StartupIdentity, identity_fields
    from tierchain.stack import build_stack

    routes = tmp_path / "routes.toml"
    routes.write_text(
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "http://127.0.0.1:9"\n'
        "price_input = 0.15\nprice_output = 0.6\n"
    )
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nname = "app"\nkey = "{KEY_A}"\nrpm = 600\ntpm = 200000\n'
        'budget_tokens = 5000000\nbudget_period = "1d"\nmax_parallel = 8\n\n'
        f'[[keys]]\nname = "free"\nkey = "{KEY_B}"\n\n'
        '[[backend_budgets]]\nbackend = "hosted"\ntokens = 9000\n'
    )
    env = {"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_API_KEYS_FILE": str(keys)}
    out = io.StringIO()
    assert check_config(environ=env, out=out) == 0
    text = out.getvalue()
    (row,) = [line for line in text.splitlines() if "KeyLimits" in line]
    assert "keys.app=rpm 600, tpm 200000, budget 5000000 tokens/1d, max_parallel 8" in row
    assert "keys.free=counted, no limits" in row
    assert "backend.hosted=9000 tokens/1d" in row
    assert "price_input=0.15  price_output=0.6" in text
    out = io.StringIO()
    assert check_config(as_json=True, environ=env, out=out) == 0
    limits = json.loads(out.getvalue())["limits"]
    assert limits["keys"][0] == {
        "name": "app",
        "rpm": 600,
        "tpm": 200000,
        "budget": 5000000,
        "budget_period": "1d",
        "max_parallel": 8,
    }
    app = build_stack(None, from_env(env))
    assert isinstance(app, StartupIdentity)
    line = identity_fields(settings=app.settings, extra=app.extra)
    assert line["limits"]["keys"][0]["budget"] == 5000000  # not masked as a secret
    assert line["routes"]["echo"][0]["price_output"] == 0.6
    for shown in (text, json.dumps(limits), json.dumps(line)):
        assert KEY_A not in shown
        assert KEY_B not in shown


async def test_a_hundred_thousand_deep_answer_is_estimated_and_logged_never_a_crash(caplog):
    keys = [CallerKey("team-a", KEY_A, tpm=100_000)]
    store = MemoryStore()
    deep = b'{"usage": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with FakeBackend("deep", answers(200, deep)) as backend:
        app, fwd = limited_gateway({"echo": [Backend("deep", backend.url)]}, keys, store=store)
        async with serve(app) as url:
            with caplog.at_level(logging.INFO, logger="tierchain"):
                answer = await call(url, KEY_A, asking(5))
        await fwd.aclose()
    assert answer.status_code == 200
    assert len(answer.content) == len(deep)
    got = totals(await usage_report(store, keys), "team-a")
    assert got[("deep", "output_estimated")] == len(deep) // 4
    assert any("usage.unreadable" in r.getMessage() for r in caplog.records)


async def test_an_ollama_stream_past_its_keys_budget_ends_with_an_ndjson_error_line():
    from .wire_fakes import ollama_chat_lines

    lines = ollama_chat_lines(["x"] * 300)
    keys = [CallerKey("team-a", KEY_A, budget_tokens=100)]
    store = MemoryStore()

    async def script(ex: Exchange) -> None:
        await ex.head(headers={"content-type": "application/x-ndjson"})
        for line in lines:
            await ex.write(line)
        await ex.end()

    body = json.dumps(
        {
            "model": "echo",
            "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 40},
        }
    ).encode()
    async with FakeBackend("tower", script) as tower:
        app, fwd = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=store)
        async with serve(app) as url:
            answer = await call(url, KEY_A, body, path="/api/chat")
        await fwd.aclose()
    got = answer.text.splitlines()
    assert answer.status_code == 200
    assert json.loads(got[-1]) == {
        "error": "the key's budget ran out mid-stream: the answer ends here"
    }
    assert all(json.loads(line)["done"] is False for line in got[:-1])
    assert 60 < len(got) - 1 < 110  # about its budget of 100, less its prompt's estimate
    report = await usage_report(store, keys)
    assert report["limits"][0]["budget_used"] <= 100 + len(got)


async def test_spans_carry_opentelemetry_genai_attributes(monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tierchain import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    monkeypatch.setattr(telemetry, "tracer", provider.get_tracer("tierchain"))
    keys = [CallerKey("team-a", KEY_A)]
    try:
        async with FakeBackend("tower", answers(200, openai_body(12, 34))) as tower:
            app, fwd = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys)
            async with serve(app) as url:
                assert (await call(url, KEY_A, asking(5))).status_code == 200
            await fwd.aclose()
    finally:
        provider.shutdown()
    spans = {s.name: s.attributes for s in exporter.get_finished_spans()}
    assert spans["tierchain.request"]["gen_ai.request.model"] == "echo"
    genai = spans["chat echo"]
    assert genai["gen_ai.operation.name"] == "chat"
    assert genai["gen_ai.request.model"] == "echo"
    assert genai["gen_ai.usage.input_tokens"] == 12
    assert genai["gen_ai.usage.output_tokens"] == 34


async def test_a_body_too_complex_to_parse_is_never_parsed_for_its_max_tokens():
    from tierchain import _json
    from tierchain.usage import DEFAULT_MAX_TOKENS, asked_output, reservation

    many = b"[" + b",".join([b"[]"] * (_json.MAX_CONTAINERS + 10)) + b"]"
    body = b'{"model": "echo", "max_tokens": 7, "junk": ' + many + b"}"
    assert await asked_output(body) is None  # refused by its shape, before any parse
    assert (await reservation(body, DEFAULT_MAX_TOKENS))[1] > DEFAULT_MAX_TOKENS
    assert await asked_output(asking(7)) == 7
    assert await asked_output(b'{"options": {"num_predict": -1}}') is None
    assert await asked_output(b'{"options": {"num_predict": 33}}') == 33


async def test_a_request_on_an_open_path_without_a_key_is_counted_as_anonymous():
    from tierchain.keys import CallerKeys

    store = MemoryStore()
    async with FakeBackend("tower", answers(200, openai_body(4, 6))) as tower:
        keys = [CallerKey("team-a", KEY_A)]
        inner, fwd = limited_gateway({"echo": [Backend("tower", tower.url)]}, keys, store=store)
        app = CallerKeys(inner.app, keys=keys, open_paths=["/v1/"])
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            answer = await client.post(url + "/v1/chat/completions", content=asking(5))
        await fwd.aclose()
    assert answer.status_code == 200
    got = totals(await usage_report(store), "(anonymous)")
    assert got[("tower", "input")] == 4
    assert got[("tower", "output")] == 6


async def test_a_backends_own_ratelimit_headers_never_pass_for_a_limited_keys():
    keys = [CallerKey("team-a", KEY_A, rpm=5), CallerKey("team-b", KEY_B)]
    body = openai_body(1, 1)

    async def script(ex: Exchange) -> None:
        await ex.respond(200, body, {"x-ratelimit-remaining-requests": "9999"})

    async with FakeBackend("hosted", script) as hosted:
        app, fwd = limited_gateway({"echo": [Backend("hosted", hosted.url)]}, keys)
        async with serve(app) as url:
            limited = await call(url, KEY_A, asking(5))
            unlimited = await call(url, KEY_B, asking(5))
        await fwd.aclose()
    assert limited.headers.get_list("x-ratelimit-remaining-requests") == ["4"]
    assert unlimited.headers.get_list("x-ratelimit-remaining-requests") == ["9999"]
