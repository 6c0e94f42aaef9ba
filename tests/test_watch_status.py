"""The watch's status conversation and the caller's time, rule by rule on the virtual clock
(docs/watchdog.md): at the window's end a backend with a status URL is asked (a ``working``
answer gives it one more window; what else it says ends the attempt), the expected prefill
stays on the timer while a probe is out, a held answer past its expected prefill is asked
whether a slot still reads a prompt, and a committed stream whose caller is not reading is
neither stalled nor cut at the reserve's point for it.

The status URL is a real socket (tests/support.py's FakeBackend) answering llama.cpp's
``/slots`` and the gate's shape; the watch is tests/watch_rig.py's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from tierchain import Backend
from tierchain.watch import Watch

from .support import Exchange, FakeBackend, now, on_virtual_time
from .watch_rig import commit, keeper, lane, run, watch_of

WORKING = json.dumps({"active_generation_count": 1, "active_generations": []}).encode()
IDLE = json.dumps({"active_generation_count": 0, "active_generations": []}).encode()
# llama.cpp's /slots: its one slot still reading a prompt (nothing decoded yet)
PREFILLING = json.dumps(
    [
        {
            "id": 0,
            "is_processing": True,
            "next_token": {"n_decoded": 0},
            "n_prompt_tokens_processed": 9,
        }
    ]
).encode()
HANGS = None  # a status that never answers (until the watch stops asking)


class Rig:
    """A watch whose backend's status URL answers ``answers`` in turn (then hangs)."""

    def __init__(self, watch: Watch, server: FakeBackend, lines: list[dict[str, Any]]) -> None:
        self.watch = watch
        self.server = server
        self.lines = lines

    @property
    def asked(self) -> int:
        return sum(r.path == "/status" for r in self.server.requests)

    def still_working(self) -> list[float]:
        return [e["elapsed_s"] for e in self.lines if e["state"] == "still_working"]


@asynccontextmanager
async def status_watch(answers: list[bytes | None], **options: Any) -> AsyncIterator[Rig]:
    pending = list(answers)

    async def status(ex: Exchange) -> None:
        body = pending.pop(0) if pending else HANGS
        if body is HANGS:
            await ex.wait_closed_by_peer()
            return
        await ex.respond(200, body, {"content-type": "application/json"})

    lines: list[dict[str, Any]] = []
    async with FakeBackend("tower", status) as server:
        tower = Backend("tower", server.url, status_url=server.url + "/status")
        watchdog = keeper(status_interval=0)
        try:
            yield Rig(
                watch_of(tier=tower, watchdog=watchdog, lines=lines, **options), server, lines
            )
        finally:
            await watchdog.aclose()


# -- at the window's end: asked --------------------------------------------------------


def not_reading(after: float, for_: float) -> Callable[[Watch], Awaitable[None]]:
    """A committed stream whose caller stops reading ``after`` seconds in, for ``for_``."""

    async def stream(watch: Watch) -> None:
        assert watch.req is not None
        commit(watch)
        await asyncio.sleep(after)
        watch.req.caller_blocked_since = now()
        await asyncio.sleep(for_)
        watch.req.caller_blocked_since = None
        watch.req.caller_unblocked_at = now()

    return stream


@on_virtual_time
async def test_a_working_answer_at_the_windows_end_gives_the_attempt_one_more_window():
    async with status_watch([WORKING, WORKING, IDLE]) as rig:
        assert await run(rig.watch) == ("idle", 30.0)
    assert rig.asked == 3  # at 10, 20 and 30 s: once at each window's end
    assert rig.still_working() == [10.0, 20.0]
    assert rig.watch.attempt is not None
    assert rig.watch.attempt.verdict == "idle"


@on_virtual_time
async def test_while_a_probe_is_out_the_expected_prefill_still_ends_the_wait():
    # the probe asked at 10 s would give up at 14 s; the expected prefill ends at 10.5 s
    async with status_watch([HANGS], prefill=10.5) as rig:
        assert await run(rig.watch) == ("too_slow", 10.5)
    assert rig.asked == 1


@on_virtual_time
async def test_a_probe_that_never_answers_is_no_working_answer():
    async with status_watch([HANGS]) as rig:  # probe_timeout: 4 s
        assert await run(rig.watch) == ("probe_unknown", 14.0)
    assert rig.still_working() == []


# -- a held answer at its expected prefill ---------------------------------------------


@on_virtual_time
async def test_a_held_answer_past_its_expected_prefill_with_a_slot_reading_a_prompt_is_too_slow():
    async with status_watch([PREFILLING], prefill=4.0) as rig:
        assert rig.watch.req is not None
        rig.watch.req.streaming = False
        assert await run(rig.watch) == ("too_slow", 4.0)
    assert rig.asked == 1
    assert rig.watch.attempt is not None
    assert rig.watch.attempt.verdict == "too_slow"


@on_virtual_time
async def test_a_held_answer_being_written_at_its_expected_prefill_waits_out_its_own_window():
    # working at 4 s (the expected prefill: no extra window), asked again at the window's
    # end (10 s), idle there
    async with status_watch([WORKING, IDLE], prefill=4.0) as rig:
        assert rig.watch.req is not None
        rig.watch.req.streaming = False
        assert await run(rig.watch) == ("idle", 10.0)
    assert rig.asked == 2
    assert rig.still_working() == [4.0]


@on_virtual_time
async def test_a_held_answers_expected_prefill_while_a_probe_is_out_asks_no_second_time():
    # asked at the window's end (10 s), no answer; the expected prefill (12 s) waits for
    # that probe, which gives up at 14 s
    async with status_watch([HANGS], prefill=12.0) as rig:
        assert rig.watch.req is not None
        rig.watch.req.streaming = False
        assert await run(rig.watch) == ("probe_unknown", 14.0)
    assert rig.asked == 1


# -- a committed stream and its caller -------------------------------------------------


@on_virtual_time
async def test_a_stream_whose_caller_is_not_reading_is_looked_at_again_a_stall_window_later():
    # stall window 3 s; the caller stops reading at 1 s and takes our send back at 4 s:
    # looked at 3 s (the caller's time), again at 6 s (quiet since 4 s), stalled at 7 s
    stream = not_reading(1.0, 3.0)

    assert await run(watch_of(stall=3.0), stream) == ("stalled", 7.0)


@on_virtual_time
async def test_a_stream_whose_caller_never_reads_again_is_never_stalled():
    async def stream(watch: Watch) -> None:
        assert watch.req is not None
        commit(watch)
        watch.req.caller_blocked_since = now()

    assert await run(watch_of(stall=3.0), stream, within=100.0) == (None, 100.0)


@on_virtual_time
async def test_a_continuable_stream_whose_caller_is_not_reading_is_not_cut_at_the_reserves_point():
    # the reserve's point at 5 s passes while the caller is not reading (1 s to 6.5 s);
    # then only the stall window counts: quiet since 6.5 s, stalled at 8.5 s
    watch = watch_of(stall=2.0, deadline=now() + 30.0, reserve=25.0, continuable=True)
    assert watch.req is not None

    stream = not_reading(1.0, 5.5)

    assert await run(watch, stream) == ("stalled", 8.5)


@on_virtual_time
async def test_a_continuable_stream_that_ended_before_the_reserves_point_is_left_alone():
    watch = watch_of(stall=2.0, deadline=now() + 30.0, reserve=25.0, continuable=True)
    assert watch.req is not None

    async def stream(watch: Watch) -> None:
        commit(watch)
        await asyncio.sleep(1.0)
        watch.observer.end()

    assert await run(watch, stream, within=100.0) == (None, 101.0)


@on_virtual_time
async def test_a_probe_out_is_a_task_named_for_the_watchdog():
    # (every task of the package is named tierchain-...: the suite finds leftovers so)
    names: list[str] = []

    async def look(watch: Watch) -> None:
        await asyncio.sleep(wait)
        assert watch._prober is not None
        names.append(watch._prober.get_name())
        assert lane(watch) == "heap"  # the ceiling's timer while it is out: a one-off

    wait = 10.5  # asked at the window's end
    async with status_watch([HANGS]) as rig:
        await run(rig.watch, look)
    wait = 4.5  # asked at a held answer's expected prefill
    async with status_watch([HANGS], prefill=4.0) as rig:
        assert rig.watch.req is not None
        rig.watch.req.streaming = False
        await run(rig.watch, look)
    assert names == ["tierchain-watchdog-probe"] * 2
