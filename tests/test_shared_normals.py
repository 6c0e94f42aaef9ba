"""The first minute of an outage: cold defaults sized for it, learned normals in the store.

A fresh gateway judges a backend it has not learned by its regime's cold default (a local
tower that goes quiet mid-stream is cut within 10 s, not the 120 s ceiling), and what a
gateway learned lives in the store, so a restarted gateway or a second replica sharing a
real redis-server judges its first request as the warm one would. Upstreams are fakes
speaking OpenAI's chat stream byte for byte (tests/test_continuation.py); time is virtual.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierchain import (
    Backend,
    Failover,
    Forwarder,
    MemoryStore,
    RedisStore,
    Routes,
    SaturationWatchdog,
)
from tierchain.config import from_env
from tierchain.learned import (
    BYTES_PER_TOKEN,
    COLD,
    COLD_OTHER,
    Learned,
    LearnedGap,
    PromptRate,
    SharedNormals,
    prompt_tokens,
)
from tierchain.stack import build_stack

from .support import (
    Exchange,
    FakeBackend,
    Script,
    chat_request,
    now,
    on_virtual_time,
    serve,
    streams,
)
from .test_continuation import FULL, finisher, read_with_sdk, tower


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    pass


def routes_file(tmp_path: Path, tower_url: str, hosted_url: str) -> Path:
    file = tmp_path / "routes.toml"
    file.write_text(
        f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower_url}"\nregime = "local"\n'
        f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{hosted_url}"\nregime = "hosted"\n'
    )
    return file


@contextlib.asynccontextmanager
async def serve_gateway(
    tmp_path: Path, first: Script, second: Script, env: dict[str, str] | None = None
) -> AsyncIterator[tuple[str, FakeBackend, FakeBackend]]:
    """``tierchain serve``'s defaults (build_stack from the variables) and a routes file."""
    async with FakeBackend("tower", first) as t, FakeBackend("hosted", second) as h:
        file = routes_file(tmp_path, t.url, h.url)
        settings = from_env({"TIERCHAIN_ROUTES_FILE": str(file), **(env or {})})
        async with serve(build_stack(None, settings, identity=False), lifespan="on") as url:
            yield url, t, h


def hosted_chat() -> Script:
    """Hosted: finishes a continued answer (tests/test_continuation.py's finisher), and
    answers a fresh request with a whole short stream."""
    from tierchain.failover.continuation import INSTRUCTION

    from .test_continuation import chat_events

    finish = finisher("chat")

    async def script(ex: Exchange) -> None:
        messages = json.loads(ex.request.body)["messages"]
        if messages[-1] == {"role": "user", "content": INSTRUCTION}:
            await finish(ex)
            return
        await ex.head(200)
        for event in chat_events(["from ", "hosted"], model="m", id="h"):
            await ex.write(event)
        await ex.end()

    return script


def timed(script: Script, at: list[float]) -> Script:
    async def wrapped(ex: Exchange) -> None:
        if ex.request.method == "POST":  # (not a GET asking what server it is)
            at.append(now())
        await script(ex)

    return wrapped


# -- cold is not patient -------------------------------------------------------------


def test_each_regime_has_a_cold_default_sized_for_the_outage():
    gaps = LearnedGap()
    assert gaps.window_for("tower", "local") == (COLD["local"].stall, False) == (8.0, False)
    assert gaps.window_for("api", "hosted") == (COLD_OTHER.stall, False) == (30.0, False)
    assert gaps.window_for("api", None) == (30.0, False)
    assert LearnedGap(maximum=5.0).window_for("tower", "local") == (5.0, False)  # the ceiling
    rate = PromptRate()
    assert rate.limit("tower", "local", b"x" * 2500) == (12.5, False)  # 625 tokens at 100/s x2
    assert rate.limit("tower", "local", b"hi") == (COLD["local"].first_token, False)
    assert rate.limit("api", "hosted", b"hi") == (COLD_OTHER.first_token, False)


@on_virtual_time
async def test_a_cold_gateway_finishes_a_stalled_local_stream_on_hosted_within_10s(tmp_path):
    """A fresh `tierchain serve`: the tower sends 20 tokens, then goes quiet with its
    connection open; hosted takes over within 10 s of the silence (not the 120 s ceiling)."""
    started: list[float] = []
    asked: list[float] = []
    async with serve_gateway(
        tmp_path,
        timed(tower("chat", upto=20, then="stall"), started),
        timed(finisher("chat"), asked),
    ) as (url, _, _h):
        assert await read_with_sdk("chat", url) == FULL
    assert len(asked) == 1
    print(f"figure: a cold gateway asks hosted {asked[0] - started[0]:.2f}s into the stall")
    assert COLD["local"].stall - 1e-6 <= asked[0] - started[0] < 10.0


# -- learned normals live in the store -------------------------------------------------


async def teach(watchdog: SaturationWatchdog, gap: float, rate_s: float) -> None:
    """What a few healthy streams at the tower teach (as learn() does after each)."""
    assert watchdog.learned_gap is not None
    assert watchdog.prompt_rate is not None
    assert watchdog.normals is not None
    for _ in range(watchdog.learned_gap.min_samples):
        watchdog.learned_gap.observe("tower", None, gap)
        watchdog.prompt_rate.observe("tower", b"x" * 4000, rate_s)
        watchdog.normals.taught("tower")


async def first_judgement(watchdog: SaturationWatchdog) -> tuple[float, bool, float]:
    """How a watchdog judges its first attempt at the tower: the stall window, whether it
    is learned, and the first-token limit of a 1000-token prompt."""
    assert watchdog.learned_gap is not None
    loading = watchdog.normals.before("tower") if watchdog.normals is not None else None
    if loading is not None:
        await loading
    window, learned = watchdog.learned_gap.window_for("tower", "local")
    assert watchdog.prompt_rate is not None
    return window, learned, watchdog.prompt_rate.limit("tower", "local", b"x" * 4000)[0]


@on_virtual_time
async def test_a_second_watchdog_on_the_same_memory_store_judges_as_the_first():
    store = MemoryStore()
    warm = SaturationWatchdog(_nothing, store=store)
    await teach(warm, gap=0.05, rate_s=1.0)
    await warm.aclose()  # (or within a second: the write is batched)
    fresh = SaturationWatchdog(_nothing, store=store)
    window, learned, limit = await first_judgement(fresh)
    assert learned
    assert window == LearnedGap.floor
    assert limit < COLD["local"].first_token  # 1000 tokens/s learned, not the 100 cold
    assert await first_judgement(SaturationWatchdog(_nothing)) == (8.0, False, 20.0)
    await fresh.aclose()


@on_virtual_time
async def test_learned_normals_are_written_at_most_once_a_second_without_a_close():
    store = MemoryStore()
    warm = SaturationWatchdog(_nothing, store=store)
    assert warm.normals is not None
    assert warm.learned_gap is not None

    async def one_stream() -> int:
        """One stream taught; the samples in the store after it."""
        warm.learned_gap.observe("tower", None, 0.05)
        warm.normals.taught("tower")
        await asyncio.sleep(0)  # (a write runs in the background)
        return int(json.loads(await store.normals_get("tower") or "{}")["gap"]["1k"]["n"])

    assert await one_stream() == 1  # the first is written at once
    assert [await one_stream() for _ in range(5)] == [1] * 5  # within a second: kept
    await asyncio.sleep(1.0)
    assert await one_stream() == 7  # a second on: everything taught meanwhile
    await warm.aclose()


@pytest.mark.parametrize("given", [True, False], ids=["store given", "no store"])
@on_virtual_time
async def test_the_normals_are_written_only_to_a_store_that_was_given(given):
    """Five healthy streams through a watchdog: it learns the tower's first window either
    way; with a store given (shared with other layers or processes) the normals are in it,
    with none its own MemoryStore (which nothing else reads) holds no normals entry."""
    async with FakeBackend("tower", streams(["from ", "tower"])) as backend:
        forwarder = Forwarder()
        learned = Learned(maximum=2.0, floor=0.1, min_samples=5)
        store = MemoryStore() if given else None
        watchdog = SaturationWatchdog(forwarder, slow_after=learned, status_interval=0, store=store)
        app = Failover(watchdog, routes=Routes({"echo": [Backend("tower", backend.url)]}))
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            for _ in range(5):
                r = await client.post(url + "/v1/chat/completions", content=chat_request())
                assert r.headers["x-tierchain-attempts"] == "tower;outcome=ok"
        await forwarder.aclose()
        await watchdog.aclose()
    assert learned.window("tower", chat_request())[1]  # learned in the process
    assert (watchdog.normals is not None) is given
    written = await watchdog.store.normals_get("tower")
    assert (written is not None) is given
    if given:
        assert store is watchdog.store
        assert json.loads(written or "{}")["first"]


async def test_a_restarted_gateway_and_a_second_replica_judge_from_redis(redis_server):
    """Replica A learns and is stopped; A restarted and a second replica B, both on the
    same real redis-server, judge their first attempt by what A learned."""
    async with RedisStore(redis_server.url) as store_a:
        a = SaturationWatchdog(_nothing, store=store_a)
        await teach(a, gap=0.05, rate_s=1.0)
        await a.aclose()
    async with RedisStore(redis_server.url) as store_a2, RedisStore(redis_server.url) as store_b:
        restarted = SaturationWatchdog(_nothing, store=store_a2)
        replica = SaturationWatchdog(_nothing, store=store_b)
        for watchdog in (restarted, replica):
            window, learned, limit = await first_judgement(watchdog)
            assert learned
            assert window == LearnedGap.floor
            assert limit < COLD["local"].first_token
            await watchdog.aclose()
    async with RedisStore(redis_server.url, prefix="other:") as elsewhere:
        assert await first_judgement(SaturationWatchdog(_nothing, store=elsewhere)) == (
            8.0,
            False,
            20.0,
        )


async def test_a_store_that_fails_leaves_the_normals_in_the_process(caplog):
    class Broken:
        async def normals_get(self, backend: str) -> str | None:
            raise OSError("down")

        async def normals_put(self, backend: str, value: str, ttl: float) -> None:
            raise OSError("down")

    gaps = LearnedGap()
    shared = SharedNormals(Broken(), {"gap": gaps})
    loading = shared.before("tower")
    assert loading is not None
    await loading
    gaps.observe("tower", None, 0.05)
    shared.taught("tower")
    await shared.aclose()
    assert gaps._normals["tower", "1k"].sketch.count == 1
    assert "watchdog.normals_store_failed" in caplog.text


# -- the prompt estimate is calibrated -------------------------------------------------


def test_the_4_bytes_rule_lives_in_one_place():
    assert BYTES_PER_TOKEN == 4.0
    assert prompt_tokens(b"x" * 2500) == 625
    source = (Path(__file__).parents[1] / "src/tierchain/learned.py").read_text()
    assert source.count("/ 4") == 0
    assert source.count("/4") == 0


def test_a_body_of_5_7_bytes_a_token_waits_12_5s_once_its_usage_was_reported():
    """The finding: a 621-token prompt sent as 3,540 bytes (JSON and English words) was
    judged as 885 tokens, so its limit came at 17.7 s; once one answer reported its
    usage, the same body waits what 621 tokens need at 100 a second, twice: 12.4 s."""
    body = b"x" * 3540
    rate = PromptRate()
    assert rate.limit("tower", "local", body)[0] == pytest.approx(17.7)
    rate.calibrate("tower", body, 621)
    assert rate.tokens("tower", body) == pytest.approx(621)
    assert rate.limit("tower", "local", body)[0] == pytest.approx(12.42)
    assert rate.limit("other", "local", body)[0] == pytest.approx(17.7)  # per backend
    rate.calibrate("tower", b"x" * 10, 40)  # too small to say anything
    rate.calibrate("tower", b"x" * 100, 900)  # more tokens than bytes: a cache, not a ratio
    assert rate.tokens("tower", body) == pytest.approx(621)


def usage_stream(pieces: list[str], prompt_tokens: int) -> list[bytes]:
    """An OpenAI chat stream asked with stream_options.include_usage: the last chunk
    before [DONE] has empty choices and the usage (openai.com API reference)."""

    def chunk(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    base = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [
        chunk({**base, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]})
        for p in pieces
    ]
    events.append(chunk({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 2, "total_tokens": 0}
    events.append(chunk({**base, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return events


USAGE_BODY = json.dumps(
    {
        "model": "echo",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "count to three " * 40}],
    }
).encode()


async def not_asked(ex: Exchange) -> None:
    raise AssertionError("not asked")


@contextlib.contextmanager
def built_watchdogs() -> Iterator[list[SaturationWatchdog]]:
    """Every SaturationWatchdog built inside the block (the one the served gateway makes)."""
    watchdogs: list[SaturationWatchdog] = []
    real_init = SaturationWatchdog.__init__

    def spy(self: SaturationWatchdog, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        watchdogs.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SaturationWatchdog, "__init__", spy)
        yield watchdogs


@on_virtual_time
async def test_the_bytes_per_token_are_learned_from_the_usage_an_answer_reports(tmp_path):
    import httpx

    async def tower_with_usage(ex: Exchange) -> None:
        reported = round(len(ex.request.body) / 5.7)
        await ex.head(200)
        for event in usage_stream(["a", "b"], reported):
            await ex.write(event)
        await ex.end()

    with built_watchdogs() as watchdogs:
        async with (
            serve_gateway(tmp_path, tower_with_usage, not_asked) as (url, _, _h),
            httpx.AsyncClient() as client,
        ):
            raw = USAGE_BODY
            got = await client.post(
                url + "/v1/chat/completions",
                content=raw,
                headers={"content-type": "application/json"},
            )
            assert got.status_code == 200
            rate = watchdogs[0].prompt_rate
            assert rate is not None
            size = len(raw)
            assert rate.tokens("tower", b"x" * size) == pytest.approx(size / 5.7, rel=0.02)


def test_every_answer_is_read_until_the_bytes_per_token_are_calibrated_then_one_in_16():
    """The usage read at an attempt's end costs a parse of the last events: it is done
    while a backend's ratio is being learned, then for one answer in 16."""
    rate = PromptRate()
    read = []
    for answer in range(1, 50):
        if rate.calibrating("tower"):
            read.append(answer)
            rate.calibrate("tower", b"x" * 3540, 621)
    assert read == [1, 2, 3, 16, 32, 48]


def test_a_backend_whose_answers_report_no_usage_is_read_16_times_then_one_in_16():
    """A stream asked without stream_options.include_usage reports nothing: after 16
    answers read in vain, one in 16 is still read (the caller may start asking)."""
    rate = PromptRate()
    read = [answer for answer in range(1, 50) if rate.calibrating("tower")]
    assert read == [*range(1, 17), 32, 48]
    assert rate.calibrating("other")  # per backend


def test_a_fixed_prompt_rate_reads_no_usage():
    assert not PromptRate(rate=100.0).calibrating("tower")


@on_virtual_time
async def test_once_calibrated_the_usage_of_most_answers_is_not_read(tmp_path):
    """Three answers at 5.7 bytes a token calibrate the tower; then it reports 2 bytes a
    token: answers 4 to 15 are not read (the ratio stays), the 16th is (it moves)."""
    import httpx

    answers = 0

    async def tower_with_usage(ex: Exchange) -> None:
        nonlocal answers
        answers += 1
        ratio = 5.7 if answers <= 3 else 2.0
        await ex.head(200)
        for event in usage_stream(["a", "b"], round(len(ex.request.body) / ratio)):
            await ex.write(event)
        await ex.end()

    raw = USAGE_BODY
    seen = []
    with built_watchdogs() as watchdogs:
        async with (
            serve_gateway(tmp_path, tower_with_usage, not_asked) as (url, _, _h),
            httpx.AsyncClient() as client,
        ):
            for _ in range(16):
                got = await client.post(
                    url + "/v1/chat/completions",
                    content=raw,
                    headers={"content-type": "application/json"},
                )
                assert got.status_code == 200
                rate = watchdogs[0].prompt_rate
                assert rate is not None
                seen.append(len(raw) / rate.tokens("tower", raw))
    assert seen[2:15] == pytest.approx([5.7] * 13, rel=0.02)  # calibrated, then not read
    assert seen[15] < 5.0  # the 16th answer's usage was read


# -- one verdict spares the next caller ------------------------------------------------


async def first_data(url: str, content: str = "hi") -> tuple[float, str, str]:
    """One streamed chat request: seconds to its first data event, the backend that
    answered (by its text, "from " "hosted" or "from " "tower": a committed stream's headers
    went out before any backend answered) and its attempt trail (or "")."""
    import httpx

    body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": content}]}
    started = now()
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as got,
    ):
        lines = got.aiter_lines()
        text = ""
        async for line in lines:
            if line.startswith("data:"):
                took = now() - started
                text += line
                break
        else:
            raise AssertionError("no data event")
        async for line in lines:
            text += line
    backend = "hosted" if '"content": "hosted"' in text else "tower"
    return took, backend, got.headers.get("x-tierchain-attempts", "")


@on_virtual_time
async def test_after_a_stall_the_next_caller_reaches_hosted_within_1s(tmp_path, metric):
    """The tower stalls mid-stream, connection open: the first caller's stream goes on on
    hosted within 10 s of the silence; the second caller is not sent to the tower at all
    (it is suspect) and hosted's first data reaches it within 1 s."""
    started: list[float] = []
    asked: list[float] = []
    before = metric("tierchain_backend_suspect_total", route="echo", backend="tower", why="stalled")
    async with serve_gateway(
        tmp_path,
        timed(tower("chat", upto=20, then="stall"), started),
        timed(hosted_chat(), asked),
    ) as (url, t, _h):
        assert await read_with_sdk("chat", url) == FULL
        took, backend, trail = await first_data(url)
    print(
        f"figure: stalled tower: first caller continued by hosted {asked[0] - started[0]:.2f}s "
        f"into the silence; the second caller's first data from hosted in {took:.3f}s"
    )
    assert asked[0] - started[0] < 10.0
    assert (backend, trail) == ("hosted", "tower;outcome=busy, hosted;outcome=ok")
    assert took < 1.0
    assert len(t.requests) == 1
    assert (
        metric("tierchain_backend_suspect_total", route="echo", backend="tower", why="stalled")
        == before + 1
    )


@on_virtual_time
async def test_after_the_hold_one_caller_probes_and_a_healthy_answer_clears_the_mark(tmp_path):
    healthy = False

    async def flaky(ex: Exchange) -> None:
        if healthy:
            await finisher_free(ex)
        else:
            await tower("chat", upto=5, then="stall")(ex)

    async def finisher_free(ex: Exchange) -> None:
        from .test_continuation import chat_events

        await ex.head(200)
        for event in chat_events(["from ", "tower"], model="m", id="c"):
            await ex.write(event)
        await ex.end()

    async with serve_gateway(tmp_path, flaky, hosted_chat()) as (url, t, _h):
        await read_with_sdk("chat", url)  # stalled: the tower is suspect
        assert (await first_data(url))[1] == "hosted"
        healthy = True
        await asyncio.sleep(10.0)  # the hold (suspect_for) is over
        _, backend, trail = await first_data(url)  # the one probe
        assert (backend, trail) == ("tower", "tower;outcome=ok")
        assert (await first_data(url))[1] == "tower"  # the mark is gone
    assert len(t.requests) == 3


def metrics_of_a_starved_tower() -> Any:
    """llama.cpp's /metrics while a game starves its GPU: one request processing (ours),
    none deferred, llama_decode() calls creeping up."""
    from .test_reserve import llamacpp_metrics

    decode = iter(range(100, 10**6, 3))

    async def script(ex: Exchange) -> None:
        if ex.request.method == "GET":
            body = llamacpp_metrics(1, 0, next(decode)) if ex.request.path == "/metrics" else b"{}"
            await ex.respond(200, body, {"content-type": "text/plain"})
            return
        await ex.head(200)  # accepted, and no token comes
        await ex.wait_closed_by_peer()
        ex.finished = True

    return script


@pytest.mark.parametrize("stack", ["serve", "readme"])
@on_virtual_time
async def test_after_one_verdict_on_a_starved_tower_every_caller_reaches_hosted_within_1s(
    stack, tmp_path
):
    from tierchain import Backend, Forwarder, Routes

    from .test_continuation import readme_stack

    starved = metrics_of_a_starved_tower()
    hosted = hosted_chat()
    async with FakeBackend("tower", starved) as t, FakeBackend("hosted", hosted) as h:
        if stack == "serve":
            file = tmp_path / "routes.toml"
            file.write_text(
                f'[[routes.echo.backends]]\nname = "tower"\nurl = "{t.url}"\n'
                f'regime = "local"\nstatus_url = "{t.url}/metrics"\n'
                f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{h.url}"\n'
                'regime = "hosted"\n'
            )
            settings = from_env({"TIERCHAIN_ROUTES_FILE": str(file)})
            app: Any = build_stack(None, settings, identity=False)
            forwarder = None
        else:
            routes = Routes(
                {
                    "echo": [
                        Backend("tower", t.url, regime="local", status_url=t.url + "/metrics"),
                        Backend("hosted", h.url, regime="hosted"),
                    ]
                }
            )
            forwarder = Forwarder()
            app = readme_stack(routes, MemoryStore(), forwarder)
        async with serve(app, lifespan="on") as url:
            first, backend, _ = await first_data(url)
            assert backend == "hosted"
            later = [await first_data(url) for _ in range(5)]
        if forwarder is not None:
            await forwarder.aclose()
    posts = [r for r in t.requests if r.method == "POST"]
    print(
        f"figure: starved tower ({stack}): first caller's first data from hosted in "
        f"{first:.2f}s; the next five in at most {max(took for took, _, _ in later):.3f}s"
    )
    assert len(posts) == 1  # the one caller who paid the wait
    assert first >= 5.0  # hedged at 5 s (serve), too slow at 10 s (the README's stack)
    for took, backend, trail in later:
        assert (backend, trail) == ("hosted", "tower;outcome=busy, hosted;outcome=ok")
        assert took < 1.0


async def test_a_second_replica_and_a_restarted_gateway_skip_a_tower_that_stalled(
    redis_server, tmp_path
):
    """Two `tierchain serve` replicas share a real redis-server. The tower stalls mid-stream
    under replica A (its caller's stream goes on on hosted); replica B's next caller, then
    the caller of A restarted, are not sent to the tower: the mark is in Redis."""
    async with (
        FakeBackend("tower", tower("chat", upto=20, then="stall")) as t,
        FakeBackend("hosted", hosted_chat()) as h,
    ):
        file = routes_file(tmp_path, t.url, h.url)
        env = {"TIERCHAIN_ROUTES_FILE": str(file), "TIERCHAIN_STORE_URL": redis_server.url}

        def replica() -> Any:
            return build_stack(None, from_env(env), identity=False)

        async with serve(replica(), lifespan="on") as a_url:
            began = now()
            assert await read_with_sdk("chat", a_url) == FULL  # stalled, finished by hosted
            first = now() - began
        async with serve(replica(), lifespan="on") as b_url:
            on_b, backend, trail = await first_data(b_url)
            assert (backend, trail) == ("hosted", "tower;outcome=busy, hosted;outcome=ok")
        async with serve(replica(), lifespan="on") as a_again:
            on_a, backend, trail = await first_data(a_again)
            assert (backend, trail) == ("hosted", "tower;outcome=busy, hosted;outcome=ok")
    print(
        f"figure: redis: the first caller's whole answer in {first:.2f}s (tower stalled, "
        f"hosted finished it); replica B's next caller's first data in {on_b:.3f}s, "
        f"replica A restarted: {on_a:.3f}s"
    )
    assert len(t.requests) == 1


# -- a first-token limit per backend -------------------------------------------------


def test_a_backend_takes_a_first_token_limit_as_seconds_or_a_timedelta():
    from datetime import timedelta

    from tierchain import Backend

    assert Backend("t", "http://127.0.0.1:1", first_token=timedelta(seconds=3)).first_token == 3.0
    assert Backend("t", "http://127.0.0.1:1").first_token is None
    with pytest.raises(ValueError, match="first_token must be a finite number of seconds"):
        Backend("t", "http://127.0.0.1:1", first_token=0)


@pytest.mark.parametrize(
    ("limit", "cut_at", "reason"), [(3.0, 3.0, "first_token"), (60.0, 10.0, "too_slow")]
)
@on_virtual_time
async def test_a_first_token_limit_on_a_backend_cuts_a_quiet_tower_at_the_smaller_limit(
    tmp_path, limit, cut_at, reason
):
    """`first_token = 3` in the routes file: a tower that accepts and says nothing is cut
    at 3 s (the cold prompt-rate limit would be 10 s); 60 s is above the learned (here:
    cold) limit, and the smaller wins."""
    import logging

    async def quiet(ex: Exchange) -> None:
        await ex.head(200)
        await ex.wait_closed_by_peer()
        ex.finished = True

    async with FakeBackend("tower", quiet) as t, FakeBackend("hosted", hosted_chat()) as h:
        file = tmp_path / "routes.toml"
        file.write_text(
            f'[[routes.echo.backends]]\nname = "tower"\nurl = "{t.url}"\nregime = "local"\n'
            f'first_token = "{limit:g}s"\n'
            f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{h.url}"\nregime = "hosted"\n'
        )
        settings = from_env(
            {"TIERCHAIN_ROUTES_FILE": str(file), "TIERCHAIN_FAILOVER_HEDGE_AFTER": "0"}
        )
        assert settings.routes is not None
        assert settings.routes["echo"][0].first_token == limit
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger("tierchain").addHandler(handler)
        try:
            async with serve(build_stack(None, settings, identity=False), lifespan="on") as url:
                took, backend, _ = await first_data(url)
        finally:
            logging.getLogger("tierchain").removeHandler(handler)
    assert backend == "hosted"
    assert cut_at <= took < cut_at + 0.5
    saturated = [r.getMessage() for r in records if "dispatch.backend_saturated" in r.getMessage()]
    assert len(saturated) == 1
    assert f'reason="{reason}"' in saturated[0]


def test_check_config_shows_a_backends_first_token(tmp_path, capsys):
    from tierchain.__main__ import main

    file = tmp_path / "routes.toml"
    file.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:8080"\n'
        'regime = "local"\nfirst_token = "20s"\n'
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "https://api.example.com"\n'
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIERCHAIN_ROUTES_FILE", str(file))
        main(["check-config"])
    assert "first_token=20" in capsys.readouterr().out


@on_virtual_time
async def test_a_stream_that_broke_mid_answer_makes_its_backend_suspect(tmp_path, metric):
    labels = {"route": "echo", "backend": "tower", "why": "broke_mid_stream"}
    before = metric("tierchain_backend_suspect_total", **labels)
    async with serve_gateway(tmp_path, tower("chat", upto=40, then="reset"), hosted_chat()) as (
        url,
        t,
        _h,
    ):
        assert await read_with_sdk("chat", url) == FULL  # reset after 40 tokens: continued
        _, backend, trail = await first_data(url)
    assert (backend, trail) == ("hosted", "tower;outcome=busy, hosted;outcome=ok")
    assert len(t.requests) == 1
    assert metric("tierchain_backend_suspect_total", **labels) == before + 1
