"""The reserve: no tier may eat the whole budget (issue 20), over real sockets.

A real uvicorn gateway (Budget -> Failover -> Breaker -> SaturationWatchdog ->
Forwarder) in front of fake backends on loopback. Each outage shape must reach
hosted with at least the reserve left, told from the attempt's own recorded
times (its start, its elapsed time, the request's deadline), never from the
wall clock; and the breaker must skip the tower by the third request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tierchain import (
    Allowance,
    Backend,
    Breaker,
    Budget,
    Failover,
    Forwarder,
    MemoryStore,
    Routes,
    SaturationWatchdog,
)

from .support import (
    Exchange,
    FakeBackend,
    RecordedGateway,
    chat_request,
    completion_body,
    now,
    on_virtual_time,
    openai_stream,
    parse_sse,
    serve,
    streams,
)

HOSTED_STREAM = b"".join(openai_stream(["from ", "hosted"]))
HOSTED_WHOLE = completion_body("from hosted")


def hosted_script() -> Callable[[Exchange], Any]:
    """Hosted answers at once, a stream or a whole JSON answer as the request asks."""

    async def script(ex: Exchange) -> None:
        if json.loads(ex.request.body).get("stream"):
            await streams(["from ", "hosted"])(ex)
        else:
            await ex.respond(200, HOSTED_WHOLE)

    return script


class Gateway(RecordedGateway):
    """Budget -> Failover -> Breaker -> SaturationWatchdog -> Forwarder, recorded."""

    def __init__(
        self, chain: list[Backend], *, budget: float, continuations: int = 1, **watchdog: Any
    ) -> None:
        self.forwarder = Forwarder()
        watchdog.setdefault("status_interval", 0)
        # Each caller is judged on its own here: no suspect mark spares the next one
        # (tests/test_shared_normals.py is where one verdict spares the next caller).
        watchdog.setdefault("suspect_for", 0)
        self.watchdog = SaturationWatchdog(self.forwarder, **watchdog)
        self.store = MemoryStore()
        breaker = Breaker(self.watchdog, store=self.store, failure_threshold=2)
        failover = Failover(breaker, routes=Routes({"echo": chain}), continuations=continuations)
        inner = Budget(failover, default=budget)
        self._record(inner)

    def left_after_tower(self, i: int) -> tuple[float, float]:
        """For request ``i``: the budget left when the tower's attempt ended, and the
        reserve that attempt had to keep (both from the recorded times)."""
        req = self.requests[i]
        tower = self.attempts[i][0]
        record = req.attempts[0]
        assert record.backend == "tower"
        assert req.deadline is not None
        ended = tower.started + record.elapsed
        return req.deadline - ended, tower.reserve


async def post(client: httpx.AsyncClient, url: str, *, stream: bool) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", content=chat_request(stream=stream))


async def quiet(ex: Exchange) -> None:
    await ex.wait_closed_by_peer()


def routed(chat: Callable[[Exchange], Any], status: Callable[[str], bytes] | None = None):
    """A tower script: GET of a status path answers ``status(path)``; chat otherwise."""

    async def script(ex: Exchange) -> None:
        if ex.request.method == "GET" and status is not None:
            await ex.respond(200, status(ex.request.path), {"content-type": "text/plain"})
        else:
            await chat(ex)

    return script


def llamacpp_metrics(processing: int, deferred: int, decode: int) -> bytes:
    """llama.cpp ``/metrics`` in the field names and order of the captured fixture."""
    return (
        "# HELP llamacpp:n_decode_total Total number of llama_decode() calls\n"
        "# TYPE llamacpp:n_decode_total counter\n"
        f"llamacpp:n_decode_total {decode}\n"
        "# HELP llamacpp:requests_processing Number of requests processing\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        f"llamacpp:requests_processing {processing}\n"
        "# HELP llamacpp:requests_deferred Number of requests deferred\n"
        "# TYPE llamacpp:requests_deferred gauge\n"
        f"llamacpp:requests_deferred {deferred}\n"
    ).encode()


def llamacpp_slots(processed: int, *, decoded: int = 0, busy: bool = True) -> bytes:
    """One slot of llama.cpp ``/slots`` (``server_slot::to_json`` in
    tools/server/server-context.cpp: ``n_prompt_tokens_processed``, ``next_token`` as
    a list), as in tests/fixtures/llamacpp_slots_captured_generating.json."""
    slot = {
        "id": 0,
        "n_ctx": 4096,
        "speculative": False,
        "is_processing": busy,
        "id_task": 2,
        "n_prompt_tokens": processed,
        "n_prompt_tokens_processed": processed,
        "n_prompt_tokens_cache": 0,
        "next_token": [
            {"has_next_token": True, "has_new_line": False, "n_remain": -1, "n_decoded": decoded}
        ],
    }
    return json.dumps([slot], separators=(",", ":")).encode()


async def three_requests(gw: Gateway, *, stream: bool) -> list[httpx.Response]:
    async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
        return [await post(client, url, stream=stream) for _ in range(3)]


def assert_reached_hosted_with_the_reserve(
    gw: Gateway, responses: list[httpx.Response], *, stream: bool, reason: str
) -> None:
    expected = HOSTED_STREAM if stream else HOSTED_WHOLE
    for response in responses:
        assert response.status_code == 200
        assert response.content == expected
    trails = [r.headers["x-tierchain-attempts"] for r in responses]
    assert trails[:2] == ["tower;outcome=saturated, hosted;outcome=ok"] * 2
    assert trails[2] == "tower;outcome=skipped, hosted;outcome=ok"  # the breaker learned
    for i in range(2):
        left, reserve = gw.left_after_tower(i)
        assert reserve > 0
        # The tower left the later tier its reserve: cut at the reserve, less the few
        # milliseconds of closing its upstream (a twentieth of the reserve on a busy machine).
        assert left >= reserve * 0.95
    saturated = gw.states("backend_saturated")
    assert (
        saturated[:2]
        == [
            {
                "state": "backend_saturated",
                "backend": "tower",
                "reason": reason,
                "failing_over": True,
            }
        ]
        * 2
    )


# -- shape 1: the documented quick start, a quiet tower ------------------------------


@pytest.mark.parametrize("stream", [True, False])
@on_virtual_time
async def test_a_window_longer_than_the_budget_ends_at_the_reserve(metric, stream):
    # The allowance's smallest window is 360 s, far past a 2 s budget: the reserve ends it.
    before = metric("tierchain_reserve_ended_total", route="echo", backend="tower")
    async with FakeBackend("tower", quiet) as tower, FakeBackend("hosted", hosted_script()) as h:
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", h.url)],
            budget=2.0,
            slow_after=Allowance(),
        )
        responses = await three_requests(gw, stream=stream)
        await gw.aclose()
    assert_reached_hosted_with_the_reserve(gw, responses, stream=stream, reason="reserve")
    assert gw.attempts[0][0].reserve == 1.0  # the 5 s floor, at most half the 2 s budget
    assert len(tower.requests) == 2
    assert metric("tierchain_reserve_ended_total", route="echo", backend="tower") == before + 2


@on_virtual_time
async def test_with_slow_after_off_the_reserve_still_reaches_hosted():
    async with FakeBackend("tower", quiet) as tower, FakeBackend("hosted", hosted_script()) as h:
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", h.url)], budget=2.0)
        responses = await three_requests(gw, stream=True)
        await gw.aclose()
    assert_reached_hosted_with_the_reserve(gw, responses, stream=True, reason="reserve")


@on_virtual_time
async def test_the_last_tier_keeps_the_whole_budget():
    async with FakeBackend("tower", quiet) as tower:
        gw = Gateway([Backend("tower", tower.url)], budget=0.5, slow_after=0.1)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            response = await post(client, url, stream=True)
        await gw.aclose()
    assert response.status_code == 504
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=budget_exhausted"
    assert gw.attempts[0][0].reserve == 0.0


# -- shape 2: a starved tower that reports progress ----------------------------------


@pytest.mark.parametrize("stream", [True, False])
@on_virtual_time
async def test_a_starved_tower_whose_metrics_move_a_little_ends_at_the_reserve(stream):
    decode = iter(range(100, 10**6, 3))  # one request processing (ours), none deferred

    def status(path: str) -> bytes:
        return llamacpp_metrics(1, 0, next(decode)) if path == "/metrics" else b"{}"

    async with (
        FakeBackend("tower", routed(quiet, status)) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/metrics"),
                Backend("hosted", h.url),
            ],
            budget=2.0,
            slow_after=0.2,
        )
        responses = await three_requests(gw, stream=stream)
        await gw.aclose()
    assert_reached_hosted_with_the_reserve(gw, responses, stream=stream, reason="reserve")
    assert gw.states("still_working")  # it was given its windows, up to the reserve


@pytest.mark.parametrize("stream", [True, False])
@on_virtual_time
async def test_a_status_probe_still_waiting_at_the_reserve_ends_the_attempt_for_it(metric, stream):
    # A starved server answers its status slowly too (seen on a real llama-server
    # under cpulimit): the probe is given until the reserve's point, no further, and
    # when it has no answer by then it is the reserve that ended the attempt.
    before = metric("tierchain_reserve_ended_total", route="echo", backend="tower")
    async with FakeBackend("tower", quiet) as tower, FakeBackend("hosted", hosted_script()) as h:
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/slots"),
                Backend("hosted", h.url),
            ],
            budget=2.0,
            slow_after=0.2,  # the probe at 0.2 s would wait 4 s; the reserve's point is at 1 s
        )
        responses = await three_requests(gw, stream=stream)
        await gw.aclose()
    assert_reached_hosted_with_the_reserve(gw, responses, stream=stream, reason="reserve")
    assert "/slots" in [r.path for r in tower.requests if r.method == "GET"]  # it was asked
    assert gw.attempts[0][0].verdict is None  # cut short at the reserve: no verdict
    assert metric("tierchain_reserve_ended_total", route="echo", backend="tower") == before + 2


@pytest.mark.parametrize("stream", [True, False])
@on_virtual_time
async def test_a_prompt_progressing_far_too_slowly_is_too_slow(metric, stream):
    # Our slot's prompt moves 2 tokens a probe (about 20 a second); it has about
    # 1,000, so it would need some 50 s where 15 s are left before the reserve.
    processed = iter(range(0, 10**6, 2))
    before = metric("tierchain_probe_answers_total", backend="tower", verdict="too_slow")

    async with (
        FakeBackend("tower", routed(quiet, lambda _: llamacpp_slots(next(processed)))) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/slots"),
                Backend("hosted", h.url),
            ],
            budget=20.0,
            slow_after=0.1,
        )
        body = chat_request(stream=stream, content="word " * 800)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            responses = [
                await client.post(url + "/v1/chat/completions", content=body) for _ in range(3)
            ]
        await gw.aclose()
    assert_reached_hosted_with_the_reserve(gw, responses, stream=stream, reason="too_slow")
    assert gw.attempts[0][0].verdict == "too_slow"
    # Found at the second probe that saw it move, long before the reserve (5 s).
    left, reserve = gw.left_after_tower(0)
    assert left > 3 * reserve
    after = metric("tierchain_probe_answers_total", backend="tower", verdict="too_slow")
    assert after == before + 2


@on_virtual_time
async def test_a_healthy_long_prefill_on_our_slot_is_kept_until_its_first_token():
    # Seed 002: the prefill moves one prompt batch (250 tokens) every 0.3 s, far
    # slower than the probes (every 0.1 s), at a rate that finishes well in time.
    total = 1000
    started: list[float] = []

    def processed() -> int:
        if not started:
            return 0
        return min(total, 250 * int((now() - started[0]) / 0.3))

    async def prefill(ex: Exchange) -> None:
        started.append(now())
        await asyncio.sleep(0.3 * total / 250 + 0.01)  # the fake server's own prompt batches
        await streams(["from ", "tower"])(ex)

    async with (
        FakeBackend("tower", routed(prefill, lambda _: llamacpp_slots(processed()))) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/slots"),
                Backend("hosted", h.url),
            ],
            budget=20.0,
            slow_after=0.1,
            progress_span=1.0,  # longer than one prompt batch of this server
        )
        body = chat_request(content="word " * 800)  # about 1,000 tokens
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            response = await client.post(url + "/v1/chat/completions", content=body)
        await gw.aclose()
    assert response.content == b"".join(openai_stream(["from ", "tower"]))
    assert h.requests == []
    assert len(gw.states("still_working")) >= 3  # probes between batches saw no move
    assert gw.states("backend_saturated") == []


# -- shape 3: a held non-stream answer that stalls or trickles ------------------------


async def half_then_silent(ex: Exchange) -> None:
    await ex.head(sse=False)
    await ex.write(HOSTED_WHOLE[: len(HOSTED_WHOLE) // 2])
    await ex.wait_closed_by_peer()


async def trickles(ex: Exchange) -> None:
    await ex.head(sse=False)
    body = completion_body("from tower, slowly")
    for i in range(len(body)):  # a byte every 0.2 s: never whole in time
        await ex.write(body[i : i + 1])
        await asyncio.sleep(0.2)
    await ex.end()


@pytest.mark.parametrize("script", [half_then_silent, trickles], ids=["stalls", "trickles"])
@on_virtual_time
async def test_a_held_answer_not_whole_at_its_window_fails_over(script):
    async with FakeBackend("tower", script) as tower, FakeBackend("hosted", hosted_script()) as h:
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", h.url)],
            budget=10.0,
            slow_after=0.4,
        )
        responses = await three_requests(gw, stream=False)
        await gw.aclose()
    assert_reached_hosted_with_the_reserve(gw, responses, stream=False, reason="incomplete")
    # Ended by its window (0.4 s), not by the reserve (5 s of the 10 s budget).
    assert gw.requests[0].attempts[0].elapsed < 5.0


# -- shape 4: a committed stream that goes silent -------------------------------------


@on_virtual_time
async def test_a_committed_stream_silent_when_the_budget_ends_it_is_a_stalled_failure():
    first = openai_stream(["one", "two"])[0]

    async def goes_silent(ex: Exchange) -> None:
        await ex.head()
        await ex.write(first)
        await ex.wait_closed_by_peer()

    async with (
        FakeBackend("tower", goes_silent) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", h.url)],
            budget=1.0,
            slow_after=0.2,
            stall_after=0.5,  # shorter than the budget: the stall is found first
            continuations=0,  # (hosted would finish it: test_continuation.py)
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            responses = [await post(client, url, stream=True) for _ in range(3)]
        await gw.aclose()
    for response in responses[:2]:
        events = parse_sse(response.content)
        assert events[0]["data"] == first.decode()[6:-2]
        assert json.loads(events[-1]["data"])["error"]["code"] == "stalled"
    assert responses[2].content == HOSTED_STREAM
    assert (
        responses[2].headers["x-tierchain-attempts"] == "tower;outcome=skipped, hosted;outcome=ok"
    )
    snapshot = await gw.store.breaker_snapshot("echo", "tower")
    # Opened by the two stalls (half-open once its first recovery probe is due, 2 s on: the
    # virtual clock moves on while the loaded machine's sockets are read).
    assert snapshot.state in ("open", "half_open")
    assert snapshot.failures == 2


@on_virtual_time
async def test_a_stream_the_budget_ends_while_silent_counts_against_the_backend():
    first = openai_stream(["one", "two"])[0]

    async def goes_silent(ex: Exchange) -> None:
        await ex.head()
        await ex.write(first)
        await ex.wait_closed_by_peer()

    async with (
        FakeBackend("tower", goes_silent) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", h.url)],
            budget=12.0,  # the reserve (5 s) ends nothing: the stream is committed
            slow_after=0.2,  # stall_after stays 120 s, longer than the budget
            continuations=0,  # (with one, it is cut at the reserve: test_continuation.py)
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=20) as client:
            responses = [await post(client, url, stream=True) for _ in range(3)]
        await gw.aclose()
    for response in responses[:2]:
        events = parse_sse(response.content)
        assert json.loads(events[-1]["data"])["error"]["code"] == "budget_exhausted"
    assert (
        responses[2].headers["x-tierchain-attempts"] == "tower;outcome=skipped, hosted;outcome=ok"
    )
    assert (await gw.store.breaker_snapshot("echo", "tower")).state == "open"


@on_virtual_time
async def test_a_glitch_after_the_terminator_is_a_whole_answer():
    events = openai_stream(["one", "two"])

    async def done_then_reset(ex: Exchange) -> None:
        await ex.head()
        for event in events:  # every event, [DONE] included
            await ex.write(event)
        await ex.reset()  # and then no final chunk: the transport breaks

    async with (
        FakeBackend("tower", done_then_reset) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", h.url)], budget=5.0, slow_after=1.0
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            responses = [await post(client, url, stream=True) for _ in range(3)]
        await gw.aclose()
    for response in responses:
        assert response.content == b"".join(events)  # no error event after [DONE]
        assert response.headers["x-tierchain-attempts"] == "tower;outcome=ok"
    snapshot = await gw.store.breaker_snapshot("echo", "tower")
    assert snapshot.state == "closed"
    assert snapshot.failures == 0


# -- prevention from the first request (issue 20, item 7) ----------------------------


def llamacpp_tower(metrics: Callable[[], bytes], chat: Callable[[Exchange], Any]):
    """A one-slot llama-server: ``/metrics``, ``/props`` (``total_slots``: the field
    ``get_props`` writes in tools/server/server-context.cpp) and chat."""

    async def script(ex: Exchange) -> None:
        if ex.request.path == "/metrics":
            await ex.respond(200, metrics(), {"content-type": "text/plain; version=0.0.4"})
        elif ex.request.path == "/props":
            body = json.dumps({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1})
            await ex.respond(200, body.encode())
        else:
            await chat(ex)

    return script


@on_virtual_time
async def test_the_first_caller_after_a_quiet_spell_is_not_sent_to_a_full_one_slot_server():
    # Another caller's generation holds the only slot: one processing, none deferred.
    busy = lambda: llamacpp_metrics(1, 0, 500)  # noqa: E731
    async with (
        FakeBackend("tower", llamacpp_tower(busy, quiet)) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/metrics"),
                Backend("hosted", h.url),
            ],
            budget=10.0,
            slow_after=2.0,
            status_interval=0.05,
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            response = await post(client, url, stream=True)
        await gw.aclose()
    assert response.content == HOSTED_STREAM
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=busy, hosted;outcome=ok"
    assert [r.path for r in tower.requests if r.method == "POST"] == []  # never sent
    assert gw.states("backend_busy") == [
        {
            "state": "backend_busy",
            "backend": "tower",
            "reason": "all slots busy",
            "failing_over": True,
        }
    ]
    assert (await gw.store.breaker_snapshot("echo", "tower")).saturations == 0


@on_virtual_time
async def test_a_slot_still_busy_with_our_cut_prefill_is_busy_not_a_saturation():
    cut = asyncio.Event()

    def metrics() -> bytes:  # idle until we cut our request; then its batch runs on
        return llamacpp_metrics(1 if cut.is_set() else 0, 0, 500)

    async def prefill_then_cut(ex: Exchange) -> None:
        await ex.wait_closed_by_peer()
        cut.set()

    async with (
        FakeBackend("tower", llamacpp_tower(metrics, prefill_then_cut)) as tower,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/metrics"),
                Backend("hosted", h.url),
            ],
            budget=10.0,
            slow_after=0.3,
            status_interval=0.05,
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            first = await post(client, url, stream=True)
            await asyncio.wait_for(cut.wait(), 5)
            second = await post(client, url, stream=True)
        await gw.aclose()
    assert first.headers["x-tierchain-attempts"] == "tower;outcome=saturated, hosted;outcome=ok"
    assert second.headers["x-tierchain-attempts"] == "tower;outcome=busy, hosted;outcome=ok"
    busy = gw.states("backend_busy")
    assert busy[0]["reason"] == "all slots busy, finishing a prompt batch of a request we cut"
    snapshot = await gw.store.breaker_snapshot("echo", "tower")
    assert snapshot.saturations == 1  # the busy slot after the cut counted nothing more


# -- the pieces ------------------------------------------------------------------------


def test_slots_report_our_prefilling_slots_prompt_progress():
    from tierchain.probes import llamacpp_slots as read

    status = read(llamacpp_slots(2048))
    assert status is not None
    assert status.prompt_done == 2048
    assert status.prefilling == 1
    generating = read(llamacpp_slots(2048, decoded=7))
    assert generating is not None
    assert generating.prompt_done is None  # generating: no prompt left to judge


def test_llamacpp_metrics_report_requests_processing_and_props_the_slot_count():
    from tierchain.probes import llamacpp_metrics as read
    from tierchain.probes import total_slots

    status = read(llamacpp_metrics(1, 0, 9))
    assert status is not None
    assert status.processing == 1
    assert status.slots is None  # /metrics alone does not say how many slots there are
    assert total_slots(b'{"total_slots": 1, "model_path": "m.gguf"}') == 1
    assert total_slots(b'{"detail": "Not Found"}') is None


def test_the_stall_window_is_learned_from_each_backends_gaps(metric):
    from tierchain.learned import LearnedGap

    gaps = LearnedGap(min_samples=3, floor=0.5, margin=10.0, maximum=120.0)
    assert gaps.window("tower", None) == (120.0, False)  # the configured stall_after
    for gap in (0.05, 0.06, 0.05):
        gaps.observe("tower", None, gap)
    window, learned = gaps.window("tower", None)
    assert learned
    assert 0.5 <= window < 1.0  # q99 (0.06 s, to within one bucket) x 10
    gauge = metric("tierchain_learned_stall_after_seconds", backend="tower", bucket="1k")
    assert gauge == window


@on_virtual_time
async def test_stall_after_auto_cuts_a_stream_at_its_learned_gap():
    from tierchain.learned import LearnedGap

    quick = openai_stream(["a", "b", "c", "d"])
    gate = asyncio.Event()

    async def tower_script(ex: Exchange) -> None:
        if gate.is_set():  # learned: now it goes silent after its first event
            await ex.head()
            await ex.write(quick[0])
            await ex.wait_closed_by_peer()
            return
        await streams(["a", "b", "c"])(ex)

    async with FakeBackend("tower", tower_script) as tower, FakeBackend("h", hosted_script()) as h:
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", h.url)],
            budget=30.0,
            slow_after=5.0,
            stall_after=LearnedGap(min_samples=3, floor=0.3),
            continuations=0,  # the cut's own error (hosted finishing it: test_continuation.py)
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=20) as client:
            for _ in range(3):
                assert (await post(client, url, stream=True)).status_code == 200
            gate.set()
            stalled = await post(client, url, stream=True)
        await gw.aclose()
    error = json.loads(parse_sse(stalled.content)[-1]["data"])["error"]
    assert error["code"] == "stalled"
    assert gw.watchdog.learned_gap is not None
    window, learned = gw.watchdog.learned_gap.window("tower", None)
    assert learned
    assert window == 0.3  # the floor: loopback gaps are far shorter
    # Ended by the learned window, long before the configured 120 s or the budget.
    assert gw.requests[-1].attempts[-1].elapsed < 15.0


@on_virtual_time
async def test_by_default_a_mid_answer_stall_on_a_quick_tower_is_cut_within_seconds():
    """Issue 31: with the watchdog's defaults (no stall_after given), a tower whose tokens
    come every 50 ms and that goes quiet after 20 of them is cut within 5 s of its last
    token, not after 120 s; the last tier keeps the patient ceiling."""
    tokens = [f"t{i} " for i in range(60)]
    events = openai_stream(tokens)
    stall = asyncio.Event()

    async def tower_script(ex: Exchange) -> None:
        await ex.head()
        for i, event in enumerate(events):
            if stall.is_set() and i == 20:
                await ex.wait_closed_by_peer()
                return
            await ex.write(event)
            await asyncio.sleep(0.05)
        await ex.end()

    async with FakeBackend("tower", tower_script) as tower, FakeBackend("h", hosted_script()) as h:
        gw = Gateway(
            [Backend("tower", tower.url), Backend("hosted", h.url)],
            budget=300.0,
            continuations=0,  # the cut's own error (hosted finishing it: test_continuation.py)
        )
        assert gw.watchdog.learned_gap is not None  # the default: learned
        assert gw.watchdog.stall_after == 120.0  # the ceiling, until learned
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=300) as client:
            for _ in range(10):  # ten whole streams: the tower's rhythm is learned
                assert (await post(client, url, stream=True)).status_code == 200
            stall.set()
            started = now()
            stalled = await post(client, url, stream=True)
            took = now() - started
        await gw.aclose()
    error = json.loads(parse_sse(stalled.content)[-1]["data"])["error"]
    assert error["code"] == "stalled"
    window, learned = gw.watchdog.learned_gap.window("tower", None)
    assert learned
    assert window == 2.0  # the floor: 50 ms x 10 is under it
    # 20 tokens (1 s) then the stall, cut 2 s into it: within 5 s of the last token.
    assert took < 20 * 0.05 + 5.0
    assert gw.requests[-1].attempts[-1].outcome == "stalled"
    # The same tower as the last tier is judged by the ceiling: nothing to move on to.
    from tierchain.request import Attempt, TierRequest

    backend = Backend("tower", tower.url)
    first = gw.watchdog._watch(TierRequest(), Attempt(1, 2, backend, "echo"))
    last = gw.watchdog._watch(TierRequest(), Attempt(2, 2, backend, "echo"))
    assert first is not None
    assert last is not None
    assert (first.stall, last.stall) == (2.0, 120.0)


def test_check_config_warns_about_windows_and_the_reserve():
    from tierchain.watchdog import window_warnings

    chains = {"echo": ("tower", "hosted"), "solo": ("tower",)}
    off = SaturationWatchdog(lambda *a: None, status_interval=0, prompt_rate=0)  # type: ignore[arg-type]
    rate_off, warning = window_warnings(off, chains, 170.0)
    assert "prompt_rate is off (0)" in rate_off
    assert rate_off.endswith("set prompt_rate='auto' (TIERCHAIN_WATCHDOG_PROMPT_RATE=auto)")
    assert "slow_after is off (0) while route(s) 'echo' have a later tier" in warning
    # With the prompt rate on (the default), a quiet tower is caught without a window.
    assert window_warnings(SaturationWatchdog(lambda *a: None), chains, 170.0) == []  # type: ignore[arg-type]
    allowance = SaturationWatchdog(lambda *a: None, slow_after=Allowance(), status_interval=0)  # type: ignore[arg-type]
    (warning,) = window_warnings(allowance, chains, 170.0)
    assert warning == (
        "slow_after's smallest window (360s) is longer than the budget minus the reserve "
        "(170s - 5s): the prompt rate or the reserve, not the window, ends a quiet first "
        "tier's attempt; set slow_after below 165s (TIERCHAIN_SLOW_AFTER=auto, or a number of "
        "seconds), or the budget above 365s (TIERCHAIN_BUDGET_DEFAULT)"
    )
    fine = SaturationWatchdog(lambda *a: None, slow_after=45.0, status_interval=0)  # type: ignore[arg-type]
    assert window_warnings(fine, chains, 170.0) == []
    assert window_warnings(fine, {"solo": ("tower",)}, 10.0) == []  # no later tier
    (missing,) = window_warnings(None, chains, None)
    assert missing.startswith("SaturationWatchdog is not in the stack")


def test_check_config_prints_the_warnings(tmp_path):
    import io

    from tierchain.__main__ import check_config

    routes = tmp_path / "routes.toml"
    routes.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n\n'
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "https://api.example.com"\n'
    )
    env = {"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_SLOW_AFTER": "0"}
    env["TIERCHAIN_WATCHDOG_PROMPT_RATE"] = "0"
    out = io.StringIO()
    assert check_config(environ=env, out=out) == 0  # a warning is not a problem
    assert "2 warning(s):\n  - prompt_rate is off (0) while route(s) 'echo' have a later" in (
        out.getvalue()
    )
    assert "  - slow_after is off (0) while route(s) 'echo' have a later tier" in out.getvalue()
    out = io.StringIO()
    assert check_config(as_json=True, environ=env, out=out) == 0
    assert len(json.loads(out.getvalue())["warnings"]) == 2
    # serve's defaults catch a quiet tower; a tower with no regime is given 30 s, and the
    # warning names the value to set.
    out = io.StringIO()
    assert check_config(environ={"TIERCHAIN_ROUTES_FILE": str(routes)}, out=out) == 0
    assert "1 warning(s):\n  - first tier(s) 'tower' have no regime: a quiet one is waited on " in (
        out.getvalue()
    )
    assert 'set regime = "local" on a local server\'s backend' in out.getvalue()
    routes.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n'
        'regime = "local"\n\n'
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "https://api.example.com"\n'
    )
    out = io.StringIO()
    assert check_config(environ={"TIERCHAIN_ROUTES_FILE": str(routes)}, out=out) == 0
    assert "warning(s)" not in out.getvalue()


def test_reserve_options_are_checked():
    app: Any = lambda *a: None  # noqa: E731
    words = r"must be a finite number of seconds >= 0 \(or a timedelta\), or 'auto', got"
    with pytest.raises(ValueError, match=f"reserve {words} 'most'"):
        SaturationWatchdog(app, reserve="most")
    with pytest.raises(ValueError, match=f"stall_after {words} 'learned'"):
        SaturationWatchdog(app, stall_after="learned")
    with pytest.raises(ValueError, match="normal_multiple"):
        SaturationWatchdog(app, normal_multiple=0.5)
    with pytest.raises(ValueError, match="reserve_floor"):
        SaturationWatchdog(app, reserve_floor=-1)


@on_virtual_time
async def test_a_middle_tier_with_no_time_before_the_reserve_is_passed_over_not_charged():
    # Three tiers, a 2 s budget: the first keeps 1 s for the rest and is cut there; the
    # second would start with nothing before its own reserve, so it is skipped as busy.
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("spare", quiet) as spare,
        FakeBackend("hosted", hosted_script()) as h,
    ):
        gw = Gateway(
            [Backend("tower", tower.url), Backend("spare", spare.url), Backend("hosted", h.url)],
            budget=2.0,
            slow_after=30.0,
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=10) as client:
            response = await post(client, url, stream=True)
        await gw.aclose()
    assert response.content == HOSTED_STREAM
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=saturated, spare;outcome=busy, hosted;outcome=ok"
    )
    assert spare.requests == []
    assert {
        "state": "backend_busy",
        "backend": "spare",
        "reason": "reserve",
        "failing_over": True,
    } in gw.events
    assert (await gw.store.breaker_snapshot("echo", "spare")).saturations == 0
