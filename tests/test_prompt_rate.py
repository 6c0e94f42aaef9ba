"""Progress against the backend's normal, not against nothing (issue 32).

A status that says ``working`` is judged against the backend's normal prompt rate:
a request whose expected prefill (its size at the learned rate, with the margin) is
over with no first token is ``too_slow``, whatever the status says; before anything
is learned, its regime's built-in default rate. Real uvicorn gateways in front of
fake backends on loopback, on a virtual clock; the tower's ``/slots`` is llama.cpp's
shape (``server_slot::to_json``, as in tests/fixtures/llamacpp_slots_captured_generating.json),
a prefilling slot whose ``n_prompt_tokens_processed`` moves once per 2,048-token
batch, so for a prompt under one batch it never moves before the first token.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tierchain import Backend
from tierchain.learned import PromptRate, prompt_tokens

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    completion_body,
    now,
    on_virtual_time,
    openai_stream,
    serve,
    streams,
)
from .test_reserve import Gateway, hosted_script, llamacpp_slots, quiet, routed

TOWER_STREAM = b"".join(openai_stream(["from ", "tower"]))
HOSTED_STREAM = b"".join(openai_stream(["from ", "hosted"]))
# About 625 tokens by the byte estimate (2,500 bytes of body), as in the table.
PROMPT = chat_request(content="w" * 2400)


def prefilling(_path: str) -> bytes:
    """Our one slot busy with a prompt under one batch: ``working``, never moving."""
    return llamacpp_slots(0)


def after(seconds: float) -> Any:
    """A tower that answers its first token ``seconds`` after the request."""

    async def script(ex: Exchange) -> None:
        await asyncio.sleep(seconds)
        await streams(["from ", "tower"])(ex)

    return script


async def ask(url: str, body: bytes = PROMPT) -> httpx.Response:
    async with httpx.AsyncClient(timeout=600) as client:
        return await client.post(url + "/v1/chat/completions", content=body)


def tower_elapsed(gw: Gateway, i: int) -> float:
    record = gw.requests[i].attempts[0]
    assert record.backend == "tower"
    return record.elapsed


# -- the pieces ------------------------------------------------------------------


def test_before_anything_is_learned_each_regime_has_a_conservative_default():
    rate = PromptRate()
    body = b"x" * 2500  # 625 tokens by the byte estimate
    assert prompt_tokens(body) == 625
    # local: 100 tokens/s, at least 10 s, times the margin (2).
    assert rate.limit("tower", "local", body) == (12.5, False)
    assert rate.limit("tower", "local", b"hi") == (10.0, False)
    # any other regime: 500 tokens/s, at least 30 s.
    assert rate.limit("hosted", "hosted", body) == (30.0, False)
    assert rate.limit("x", None, b"x" * 40_000) == (40.0, False)
    # never infinitely patient, however large the prompt.
    assert rate.limit("tower", "local", b"x" * 400_000)[0] == 2000.0


def test_the_rate_is_learned_from_healthy_first_tokens_and_small_prompts_teach_the_overhead(
    metric,
):
    rate = PromptRate()
    body = b"x" * 2500
    for _ in range(3):
        rate.observe("learned-tower", body, 5.0)  # 125 tokens/s
    assert metric("tierchain_learned_prompt_rate", backend="learned-tower") == pytest.approx(125.0)
    limit, learned = rate.limit("learned-tower", "local", body)
    assert learned
    assert limit == pytest.approx(10.0)  # twice the normal first token
    for _ in range(3):
        rate.observe("learned-tower", b"hi", 0.5)  # under min_tokens: the fixed cost
    assert rate.limit("learned-tower", "local", body)[0] == pytest.approx(2 * (0.5 + 5.0))
    assert rate.normal_rate("learned-tower") == pytest.approx(125.0)
    assert rate.normal_rate("other") is None
    # A learned rate never waits less than the floor (2 s).
    assert rate.limit("learned-tower", "local", b"")[0] == 2.0


def test_prompt_rate_options_are_checked():
    with pytest.raises(ValueError, match="margin"):
        PromptRate(margin=0.5)
    with pytest.raises(ValueError, match="rate"):
        PromptRate(rate=-1.0)
    from tierchain import Forwarder, SaturationWatchdog

    with pytest.raises(ValueError, match="prompt_rate"):
        SaturationWatchdog(Forwarder(), prompt_rate="fast")
    assert SaturationWatchdog(Forwarder(), prompt_rate=0).prompt_rate is None
    fixed = SaturationWatchdog(Forwarder(), prompt_rate=50, prompt_margin=3).prompt_rate
    assert fixed is not None
    assert fixed.limit("t", "local", b"x" * 400) == (6.0, False)


# -- over real sockets ------------------------------------------------------------


@on_virtual_time
async def test_a_working_status_does_not_keep_an_unlearned_tower_past_its_regimes_default():
    # The README stack's window (45 s) with a status URL: the status can only say
    # ``working`` (one prompt batch never moves); the old watchdog extended window after
    # window until the reserve. The regime's default rate ends it at 12.5 s.
    async with (
        FakeBackend("tower", routed(quiet, prefilling)) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
                Backend("hosted", hosted.url, regime="hosted"),
            ],
            budget=170.0,
            slow_after=45.0,
        )
        async with serve(gw.app) as url:
            response = await ask(url)
        await gw.aclose()
    assert response.content == HOSTED_STREAM
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=saturated, hosted;outcome=ok"
    )
    assert tower_elapsed(gw, 0) == pytest.approx(12.5, abs=0.1)
    assert gw.attempts[0][0].verdict == "too_slow"
    (saturated,) = gw.states("backend_saturated")
    assert saturated["reason"] == "too_slow"


@on_virtual_time
async def test_a_learned_normal_cuts_the_first_caller_at_twice_the_towers_first_token():
    healthy = [True]

    async def tower_script(ex: Exchange) -> None:
        if healthy[0]:
            await after(5.0)(ex)  # the tower's normal: 5 s to a first token
        else:
            await quiet(ex)  # starved: says working, never answers in time

    async with (
        FakeBackend("tower", routed(tower_script, prefilling)) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
                Backend("hosted", hosted.url, regime="hosted"),
            ],
            budget=170.0,
            slow_after=45.0,
        )
        async with serve(gw.app) as url:
            answers = [await ask(url) for _ in range(3)]
            assert [a.content for a in answers] == [TOWER_STREAM] * 3
            healthy[0] = False
            started = now()
            starved = await ask(url)
            took = now() - started
        await gw.aclose()
    assert starved.content == HOSTED_STREAM
    assert tower_elapsed(gw, 3) == pytest.approx(10.0, rel=0.05)
    assert took < 11.0  # hosted answers at once here
    assert gw.attempts[3][0].verdict == "too_slow"


@on_virtual_time
async def test_a_long_prompt_on_a_healthy_tower_is_given_its_prefill_at_the_learned_rate():
    # Seed 002's side: learned at 125 tokens/s on 625-token prompts, a 6,000-token
    # prompt that takes 55 s (a little slower per token: attention grows) is kept.
    waits = iter([5.0, 5.0, 5.0, 55.0])

    async def tower_script(ex: Exchange) -> None:
        await after(next(waits))(ex)

    async with (
        FakeBackend("tower", routed(tower_script, prefilling)) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
                Backend("hosted", hosted.url, regime="hosted"),
            ],
            budget=170.0,
            slow_after=45.0,
        )
        async with serve(gw.app) as url:
            for _ in range(3):
                assert (await ask(url)).content == TOWER_STREAM
            long = await ask(url, chat_request(content="w" * 23_900))  # about 6,000 tokens
        await gw.aclose()
    assert long.content == TOWER_STREAM
    assert hosted.requests == []
    assert gw.states("backend_saturated") == []


def batches(rate: float, started: list[float]) -> Any:
    """Our slot's ``/slots``: its prompt moves a 2,048-token batch at a time at ``rate``
    tokens a second (llama.cpp counts ``n_prompt_tokens_processed`` per batch)."""

    def status(_path: str) -> bytes:
        if not started:
            return llamacpp_slots(0)
        done = rate * (now() - started[0])
        return llamacpp_slots(int(done // 2048) * 2048)

    return status


@pytest.mark.parametrize(("rate", "kept"), [(82.0, True), (30.0, False)])
@on_virtual_time
async def test_a_long_prompts_batches_at_the_normal_rate_keep_it_past_the_regimes_default(
    rate, kept
):
    # About 6,000 tokens (24,000 bytes): the local default gives it 2 x 6,000 / 100 = 120 s.
    # At 82 tokens a second (an idle CPU) it needs 73 s of prefill plus its decode, and
    # here 140 s in all: its batches move at the normal rate, so it is kept. At 30 tokens a
    # second (starved) the batches are slower than the normal allows: cut at 120 s.
    started: list[float] = []
    tokens = 6000

    async def tower_script(ex: Exchange) -> None:
        started.append(now())
        await asyncio.sleep(140.0 if kept else 10_000.0)
        await streams(["from ", "tower"])(ex)

    async with (
        FakeBackend("tower", routed(tower_script, batches(rate, started))) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
                Backend("hosted", hosted.url, regime="hosted"),
            ],
            budget=600.0,
            slow_after=45.0,
        )
        body = chat_request(content="w" * (tokens * 4 - 60))
        async with serve(gw.app) as url:
            response = await ask(url, body)
        await gw.aclose()
    if kept:
        assert response.content == TOWER_STREAM
        assert hosted.requests == []
    else:
        assert response.content == HOSTED_STREAM
        assert gw.attempts[0][0].verdict == "too_slow"
        assert tower_elapsed(gw, 0) == pytest.approx(120.0, abs=0.5)


@pytest.mark.parametrize(
    "generating", [False, True, None], ids=["prefilling", "generating", "unknown"]
)
@on_virtual_time
async def test_an_answer_that_does_not_stream_is_judged_by_its_slot_at_its_expected_prefill(
    generating,
):
    # No first token to wait for: past the expected prefill (12.5 s), /slots tells a slot
    # still reading a prompt (too slow: the starved tower) from one writing the answer (a
    # long healthy answer, kept until it is whole at 30 s). A status that does not answer
    # (None: unknown) is no evidence: the plain stopwatch does not judge a held answer's
    # prefill, so it is kept as well (issue 42).
    def slots(_path: str) -> bytes:
        if generating is None:
            return b"<html>not a status</html>"
        return llamacpp_slots(625, decoded=40) if generating else llamacpp_slots(0)

    async def tower_script(ex: Exchange) -> None:
        if generating is False:
            await quiet(ex)
            return
        await asyncio.sleep(30.0)
        await ex.respond(200, completion_body("from tower"))

    async with (
        FakeBackend("tower", routed(tower_script, slots)) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
                Backend("hosted", hosted.url, regime="hosted"),
            ],
            budget=170.0,
            slow_after=45.0,
        )
        async with serve(gw.app) as url:
            response = await ask(url, chat_request(stream=False, content="w" * 2400))
        await gw.aclose()
    if generating is not False:
        assert response.content == completion_body("from tower")
        assert hosted.requests == []
    else:
        assert response.content == completion_body("from hosted")
        assert gw.attempts[0][0].verdict == "too_slow"
        assert tower_elapsed(gw, 0) == pytest.approx(12.4, abs=0.2)


@on_virtual_time
async def test_a_prompt_stuck_after_a_batch_is_no_progress_after_one_batch_at_the_normal_rate():
    # Learned: 625-token prompts read in 0.625 s (1,000 tokens a second). A 10,000-token
    # prompt's slot moves its first 2,048-token batch at 1 s, then never again: one batch
    # at the normal rate, times the margin, is 4.1 s, so it is no_progress some 4 s after
    # the move, not after progress_span (30 s) and before its expected prefill (20 s).
    phase = ["learn"]
    started: list[float] = []

    def slots(_path: str) -> bytes:
        if not started or now() - started[0] < 1.0:
            return llamacpp_slots(0)
        return llamacpp_slots(2048)

    async def tower_script(ex: Exchange) -> None:
        if phase[0] == "learn":
            await after(0.625)(ex)
            return
        started.append(now())
        await quiet(ex)

    async with (
        FakeBackend("tower", routed(tower_script, slots)) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
                Backend("hosted", hosted.url, regime="hosted"),
            ],
            budget=170.0,
            slow_after=0.5,
        )
        async with serve(gw.app) as url:
            for _ in range(3):
                assert (await ask(url, chat_request(content="w" * 2440))).content == TOWER_STREAM
            phase[0] = "stuck"
            response = await ask(url, chat_request(content="w" * 39_940))
        await gw.aclose()
    assert response.content == HOSTED_STREAM
    assert gw.attempts[3][0].verdict == "no_progress"
    assert 4.0 < tower_elapsed(gw, 3) < 7.0
