"""A slow status answer is evidence (issue 32).

A starved llama-server answers its ``/slots`` slowly too (measured 63-810 ms, median
over 600 ms, where an idle one answers in a millisecond): such an answer never sends
a caller to it. Before sending, a status asked and not answered within
``status_late`` skips the tower as busy (not a failure). After a window, on our own
prefill, a late answer is no evidence (the server answers between prompt batches):
the prompt rate bounds that wait instead. Real uvicorn
gateways in front of fake backends on loopback, on a virtual clock; the status body
is llama.cpp's ``/slots`` shape (``server_slot::to_json``, as in
tests/fixtures/llamacpp_slots_captured_generating.json).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tierchain import Backend

from .support import (
    Exchange,
    FakeBackend,
    busy_for,
    chat_request,
    on_virtual_time,
    serve,
    streams,
)
from .test_prompt_rate import HOSTED_STREAM, TOWER_STREAM, ask
from .test_reserve import Gateway, hosted_script, llamacpp_slots


def late_status(delay: float, body: Callable[[], bytes], chat: Any) -> Any:
    """A tower whose ``/slots`` answers ``body()`` after ``delay`` seconds."""

    async def script(ex: Exchange) -> None:
        if ex.request.method == "GET":
            await asyncio.sleep(delay)
            await ex.respond(200, body(), {"content-type": "application/json"})
        else:
            await chat(ex)

    return script


async def one_request(tower: FakeBackend, hosted: FakeBackend) -> tuple[Gateway, Any]:
    """One chat request through the README stack: the tower (its status at ``/slots``),
    then hosted."""
    gw = Gateway(
        [
            Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
            Backend("hosted", hosted.url, regime="hosted"),
        ],
        budget=170.0,
        slow_after=45.0,
        status_interval=0.05,
    )
    async with serve(gw.app) as url:
        response = await ask(url, chat_request())
    await gw.aclose()
    return gw, response


@on_virtual_time
async def test_a_starved_towers_late_idle_status_never_sends_the_first_caller_to_it():
    # The slot says idle ("send it"), 600 ms late: the old ask_first took the silence
    # as unknown, and unknown as "try it".
    idle = lambda: llamacpp_slots(0, busy=False)  # noqa: E731
    async with (
        FakeBackend("tower", late_status(0.6, idle, streams(["from ", "tower"]))) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw, response = await one_request(tower, hosted)
    assert response.content == HOSTED_STREAM
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=busy, hosted;outcome=ok"
    assert [r for r in tower.requests if r.method == "POST"] == []  # never sent
    (busy,) = gw.states("backend_busy")
    assert busy["reason"] == "status late (0.25s)"
    assert (await gw.store.breaker_snapshot("echo", "tower")).saturations == 0  # busy only


@on_virtual_time
async def test_a_status_late_only_for_the_gateways_own_delay_still_sends_the_caller_to_it():
    # The tower answers its status at once, but the gateway's own loop is held up for
    # 0.5 s meanwhile (a gateway starved of CPU: everything here runs in its one loop).
    # That delay is the gateway's, measured by its loop's ticks: the tower is not busy.
    idle = llamacpp_slots(0, busy=False)

    async def tower_script(ex: Exchange) -> None:
        if ex.request.method == "GET":
            busy_for(0.5)
            await ex.respond(200, idle, {"content-type": "application/json"})
        else:
            await streams(["from ", "tower"])(ex)

    async with (
        FakeBackend("tower", tower_script) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw, response = await one_request(tower, hosted)
    assert response.content == TOWER_STREAM
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=ok"
    assert gw.states("backend_busy") == []
    assert hosted.requests == []


@on_virtual_time
async def test_a_late_working_answer_at_a_windows_end_still_keeps_our_own_healthy_prefill():
    # llama-server answers /slots from its main loop, between prompt batches: prefilling a
    # 2,048-token batch on a busy CPU, an unstarved server answered in 0.4 to 6 s. After a
    # window, lateness is no evidence against our own prefill: it is heard, and the prompt
    # rate (not the status) bounds the wait. Here the first token comes at 6 s (the local
    # default gives this prompt 10 s), each status answer 2 s late.
    moved = iter(range(1, 10**6))
    working = lambda: llamacpp_slots(next(moved))  # noqa: E731

    async def prefill(ex: Exchange) -> None:
        await asyncio.sleep(6.0)
        await streams(["from ", "tower"])(ex)

    async with (
        FakeBackend("tower", late_status(2.0, working, prefill)) as tower,
        FakeBackend("hosted", hosted_script()) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, regime="local", status_url=tower.url + "/slots"),
                Backend("hosted", hosted.url, regime="hosted"),
            ],
            budget=170.0,
            slow_after=0.5,
            status_interval=0,  # the window-end probe only
        )
        async with serve(gw.app) as url:
            response = await ask(url, chat_request())
        await gw.aclose()
    assert response.content == TOWER_STREAM
    assert hosted.requests == []
    assert gw.states("still_working")
    assert gw.states("backend_saturated") == []
