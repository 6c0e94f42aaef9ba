"""Virtual time (tierchain.testing): the clock moves only while every coroutine waits."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tierchain import Budget
from tierchain._runtime import clock as runtime_clock
from tierchain.testing import VirtualClock, virtual_time

from .support import chat_request, serve


def run(clock: VirtualClock, coro):
    with asyncio.Runner(loop_factory=clock.new_event_loop) as runner:
        return runner.run(coro)


def test_an_idle_loop_jumps_to_its_next_timer_and_the_package_reads_the_same_clock():
    async def scenario() -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        started, package_started = loop.time(), runtime_clock.now()
        await asyncio.sleep(3600)
        return loop.time() - started, runtime_clock.now() - package_started, loop.time()

    with virtual_time() as clock:
        slept, package_slept, reading = run(clock, scenario())
    assert (slept, package_slept) == (3600.0, 3600.0)
    assert reading == clock() == 1_000_000.0 + 3600
    assert clock.jumps >= 1


def test_the_switch_restores_the_real_clock_even_when_the_block_raises():
    assert runtime_clock.now is time.monotonic
    with pytest.raises(RuntimeError, match="inside"), virtual_time() as clock:
        assert runtime_clock.now is clock.read
        assert runtime_clock.now() == clock.reading
        raise RuntimeError("inside")
    assert runtime_clock.now is time.monotonic


def test_a_clock_only_goes_forward():
    clock = VirtualClock(start=5.0)
    clock.advance(2.5)
    assert clock() == 7.5
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1)


def test_work_that_never_waits_takes_no_virtual_time():
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(200):
            await asyncio.sleep(0)  # ready at once each time: the loop is never idle
        sum(range(200_000))  # real work: real time passes, virtual time does not
        return loop.time() - started

    with virtual_time() as clock:
        assert run(clock, scenario()) == 0.0
    assert clock.jumps == 0


def test_a_budget_over_real_loopback_sockets_is_spent_exactly_on_time():
    # uvicorn and httpx in the test's loop: bytes across loopback are ready at once,
    # so the only time that passes is the budget's own.
    async def never_answers(scope, receive, send):
        await asyncio.Event().wait()

    async def scenario() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        async with (
            serve(Budget(never_answers, default=30.0)) as url,
            httpx.AsyncClient(timeout=120) as client,
        ):
            started = loop.time()
            response = await client.post(url + "/v1/chat/completions", content=chat_request())
            return response.status_code, loop.time() - started

    with virtual_time() as clock:
        status, took = run(clock, scenario())
    assert status == 504
    assert took == pytest.approx(30.0, abs=1e-6)


def test_real_io_from_another_thread_is_waited_for_before_the_clock_jumps():
    # A thread answers after some real milliseconds; a 10-minute timer is armed
    # meanwhile. The loop waits its grace of real time per idle turn, so the reply
    # that comes within it is taken before the timer.
    async def scenario() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply: asyncio.Future[str] = loop.create_future()

        def answer() -> None:
            time.sleep(0.005)
            loop.call_soon_threadsafe(reply.set_result, "from the thread")

        thread = threading.Thread(target=answer)
        thread.start()
        try:
            got = await asyncio.wait_for(reply, 600)
        finally:
            thread.join()
        return got, loop.time() - started

    with virtual_time(VirtualClock(grace=5.0)) as clock:
        got, took = run(clock, scenario())
    assert got == "from the thread"
    assert took == 0.0
