"""SaturationWatchdog over real sockets: a hang is not an error, so make it one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tierchain import Backend, Failover, Forwarder, Routes, SaturationWatchdog, TierRequest

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    completion_body,
    now,
    on_virtual_time,
    openai_stream,
    parse_sse,
    serve,
    streams,
)

HOSTED = openai_stream(["from ", "hosted"])


def recording(app: Any, events: list[dict[str, Any]]) -> Any:
    """An outer layer that records every state event of every request."""

    async def outer(scope, receive, send):
        if scope["type"] == "http":
            TierRequest.of(scope).subscribe(events.append)
        await app(scope, receive, send)

    return outer


class Gateway:
    """Failover -> SaturationWatchdog -> Forwarder, with its state events recorded."""

    def __init__(self, chain: list[Backend], **watchdog: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.forwarder = Forwarder()
        watchdog.setdefault("status_interval", 0)  # probes only: exact GET counts below
        self.watchdog = SaturationWatchdog(self.forwarder, **watchdog)
        self.app = recording(Failover(self.watchdog, routes=Routes({"echo": chain})), self.events)

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()

    def states(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["state"] == name]


async def post(url: str, body: bytes, **kw: Any) -> tuple[httpx.Response, float]:
    async with httpx.AsyncClient(timeout=5) as client:
        t0 = now()
        response = await client.post(url + "/v1/chat/completions", content=body, **kw)
        return response, now() - t0


async def quiet(ex: Exchange) -> None:
    """Accept the request and say nothing until the gateway hangs up."""
    await ex.wait_closed_by_peer()


def answers_after(delay: float, script: Callable[[Exchange], Any]) -> Callable[[Exchange], Any]:
    async def later(ex: Exchange) -> None:
        await asyncio.sleep(delay)
        await script(ex)

    return later


def with_status(chat: Callable[[Exchange], Any], status: Callable[[], tuple[int, bytes]]):
    """A backend script: ``GET /status`` answers ``status()``; anything else runs ``chat``."""

    async def script(ex: Exchange) -> None:
        if ex.request.path == "/status":
            code, body = status()
            await ex.respond(code, body, {"content-type": "text/plain"})
        else:
            await chat(ex)

    return script


def after_probes(n: int, script: Callable[[Exchange], Any]) -> tuple[Any, Any]:
    """A chat script that answers once ``n`` status probes were answered, and the hook."""
    answered = 0
    enough = asyncio.Event()

    def probed() -> None:
        nonlocal answered
        answered += 1
        if answered >= n:
            enough.set()

    async def chat(ex: Exchange) -> None:
        await enough.wait()
        await script(ex)

    return chat, probed


def counted(status: Callable[[], tuple[int, bytes]], hook: Callable[[], None]):
    def wrapped() -> tuple[int, bytes]:
        try:
            return status()
        finally:
            asyncio.get_running_loop().call_later(0.01, hook)  # after the answer is sent

    return wrapped


def vllm(running: int, generated: float) -> bytes:
    return (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n'
        f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} 900.0\n'
        f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {generated}\n'
    ).encode()


# -- the outage shape ----------------------------------------------------------------


@on_virtual_time
async def test_a_quiet_backend_fails_over_instead_of_being_waited_on(metric):
    before = metric("tierchain_backend_saturated_total", route="echo", backend="tower")
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [Backend("tower", tower.url, regime="local"), Backend("hosted", hosted.url)],
            slow_after=0.2,
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
            await asyncio.wait_for(tower.connection_closed.wait(), 1)
        await gw.aclose()
    assert response.status_code == 200
    assert response.content == b"".join(HOSTED)
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=saturated, hosted;outcome=ok"
    )
    assert took == pytest.approx(0.2, abs=1e-6)
    assert len(tower.requests) == 1
    assert len(hosted.requests) == 1
    assert tower.open_connections == 0  # the quiet backend's connection was closed
    assert {"state": "backend_saturated", "backend": "tower", "failing_over": True} in gw.events
    after = metric("tierchain_backend_saturated_total", route="echo", backend="tower")
    assert after == before + 1


@on_virtual_time
async def test_pings_before_the_first_data_event_do_not_restart_the_window():
    async def pings_forever(ex: Exchange) -> None:
        await ex.head()
        for _ in range(40):
            await ex.write(b": ping\n\n")
            await asyncio.sleep(0.03)

    async with (
        FakeBackend("tower", pings_forever) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.15)
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(HOSTED)
    assert took == pytest.approx(0.15, abs=1e-6)
    assert response.headers["x-tierchain-attempts"].startswith("tower;outcome=saturated")


@on_virtual_time
async def test_a_stream_already_generating_is_not_cut_for_being_long():
    events = openai_stream(["a", "b", "c", "d", "e"])

    async def long_stream(ex: Exchange) -> None:
        await ex.head()
        for event in events:
            await ex.write(event)
            await asyncio.sleep(0.07)  # the whole stream lasts over 2 windows
        await ex.end()

    async with (
        FakeBackend("tower", long_stream) as tower,
        FakeBackend("hosted") as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.15)
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(events)
    assert took > 0.33
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=ok"
    assert hosted.requests == []
    assert gw.states("backend_saturated") == []


@on_virtual_time
async def test_a_non_streaming_attempt_is_bounded_whole():
    async def headers_then_think(ex: Exchange) -> None:
        await ex.head(sse=False)  # headers at once, the completion much later
        await asyncio.sleep(2)
        await ex.write(completion_body("too late"))
        await ex.end()

    async def quick(ex: Exchange) -> None:
        await ex.respond(200, completion_body("from hosted"))

    async with (
        FakeBackend("tower", headers_then_think) as tower,
        FakeBackend("hosted", quick) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.15)
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request(stream=False))
        await gw.aclose()
    assert response.json()["choices"][0]["message"]["content"] == "from hosted"
    assert took == pytest.approx(0.15, abs=1e-6)
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=saturated, hosted;outcome=ok"
    )


@on_virtual_time
async def test_a_non_streaming_answer_inside_the_window_is_untouched():
    async def thinks(ex: Exchange) -> None:
        await asyncio.sleep(0.05)
        await ex.respond(200, completion_body("from tower"))

    async with FakeBackend("tower", thinks) as tower, FakeBackend("hosted") as hosted:
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.3)
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request(stream=False))
        await gw.aclose()
    assert response.json()["choices"][0]["message"]["content"] == "from tower"
    assert hosted.requests == []


@on_virtual_time
async def test_the_last_tier_is_not_cut_only_recorded_as_slow(metric, caplog):
    before = metric("tierchain_backend_saturated_total", route="echo", backend="hosted")
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", answers_after(0.2, streams(["late ", "but ", "valid"]))) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.08)
        with caplog.at_level("INFO", logger="tierchain"):
            async with serve(gw.app) as url:
                response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(openai_stream(["late ", "but ", "valid"]))
    assert response.headers["x-tierchain-attempts"] == (
        "tower;outcome=saturated, hosted;outcome=ok"
    )
    assert took == pytest.approx(0.28, abs=1e-6)  # tower's window, then hosted's whole late answer
    assert [e["backend"] for e in gw.states("backend_saturated")] == ["tower"]
    slow = gw.states("backend_slow")
    assert [(e["backend"], e["failing_over"]) for e in slow] == [("hosted", False)]
    assert any(r.getMessage().startswith("dispatch.backend_slow ") for r in caplog.records)
    assert metric("tierchain_backend_saturated_total", route="echo", backend="hosted") == before


@on_virtual_time
async def test_without_failover_the_watchdog_never_cuts_before_the_ceiling():
    async def slow_answer(ex: Exchange) -> None:
        await asyncio.sleep(0.25)
        await streams(["alone"])(ex)

    async with FakeBackend("tower", slow_answer) as tower:
        forwarder = Forwarder(backend=Backend("tower", tower.url))
        watchdog = SaturationWatchdog(forwarder, slow_after=0.05)
        async with serve(watchdog) as url:
            response, _ = await post(url, chat_request())
        await forwarder.aclose()
        await watchdog.aclose()
    assert response.content == b"".join(openai_stream(["alone"]))


@on_virtual_time
async def test_without_failover_the_ceiling_answers_504():
    async with FakeBackend("tower", quiet) as tower:
        forwarder = Forwarder(backend=Backend("tower", tower.url))
        watchdog = SaturationWatchdog(forwarder, slow_after=0.05, ceiling=0.2)
        async with serve(watchdog) as url:
            response, took = await post(url, chat_request())
            await asyncio.wait_for(tower.connection_closed.wait(), 1)
        await forwarder.aclose()
        await watchdog.aclose()
    assert response.status_code == 504
    assert response.json()["error"]["type"] == "backend_saturated"
    assert took == pytest.approx(0.2, abs=1e-6)


# -- asking before killing -------------------------------------------------------------


@on_virtual_time
async def test_a_backend_that_says_it_is_working_is_given_another_window(metric):
    generated = iter(range(100, 10_000, 37))  # moves at every probe
    before = metric("tierchain_probe_answers_total", backend="tower", verdict="working")

    chat, probed = after_probes(2, streams(["prefilled"]))
    status = counted(lambda: (200, vllm(1, next(generated))), probed)
    async with (
        FakeBackend("tower", with_status(chat, status)) as tower,
        FakeBackend("hosted") as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("h", hosted.url),
            ],
            slow_after=0.12,
        )
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(openai_stream(["prefilled"]))
    assert hosted.requests == []
    still = gw.states("still_working")
    assert len(still) >= 2  # the chat answers after the second probe (a third may race it)
    assert all(e["backend"] == "tower" and e["elapsed_s"] >= 0.1 for e in still)
    assert sum(r.path == "/status" for r in tower.requests) == len(still)  # one GET per expiry
    after = metric("tierchain_probe_answers_total", backend="tower", verdict="working")
    assert after == before + len(still)


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (lambda: (200, vllm(0, 500)), "idle"),
        (lambda: (200, b'{"active_generation_count": 0, "active_generations": []}'), "idle"),
        (lambda: (500, b"oops"), "unknown"),
        (lambda: (200, b"<html>not a status</html>"), "unknown"),
        (lambda: (404, b""), "unknown"),
    ],
)
@on_virtual_time
async def test_idle_or_unknown_answers_mean_saturated_at_the_first_window(metric, status, verdict):
    before = metric("tierchain_probe_answers_total", backend="tower", verdict=verdict)
    async with (
        FakeBackend("tower", with_status(quiet, status)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.12,
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(HOSTED)
    assert took == pytest.approx(0.12, abs=1e-6)
    assert gw.states("still_working") == []
    assert metric("tierchain_probe_answers_total", backend="tower", verdict=verdict) == before + 1


@on_virtual_time
async def test_a_status_url_that_does_not_answer_in_time_is_unknown(metric):
    before = metric("tierchain_probe_answers_total", backend="tower", verdict="unknown")

    async def chat_or_hang(ex: Exchange) -> None:
        await ex.wait_closed_by_peer()  # the chat request and the status GET alike

    async with (
        FakeBackend("tower", chat_or_hang) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.1,
            probe_timeout=0.08,
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(HOSTED)
    assert took == pytest.approx(0.18, abs=1e-6)
    after = metric("tierchain_probe_answers_total", backend="tower", verdict="unknown")
    assert after == before + 1


@on_virtual_time
async def test_an_unknown_answer_after_a_working_one_keeps_the_attempt():
    # Working, then a status that errors (a busy server's late or failed answer), then
    # working again: the unknown answer in between is not evidence (issue 42).
    generated = iter(range(100, 10_000, 37))
    answers = iter([True, False, True, True, True, True])

    def status() -> tuple[int, bytes]:
        if next(answers, True):
            return 200, vllm(1, next(generated))
        return 503, b"busy"

    chat, probed = after_probes(3, streams(["prefilled"]))
    async with (
        FakeBackend("tower", with_status(chat, counted(status, probed))) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.12,
        )
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(openai_stream(["prefilled"]))
    assert hosted.requests == []
    assert gw.states("backend_saturated") == []


@on_virtual_time
async def test_a_status_unknown_for_progress_span_after_working_is_the_stopwatch_again():
    answers = iter([True])

    def status() -> tuple[int, bytes]:
        return (200, vllm(1, 100)) if next(answers, False) else (503, b"busy")

    async with (
        FakeBackend("tower", with_status(quiet, status)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.1,
            progress_span=0.35,
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(HOSTED)
    # working at 0.1 (to 0.2); unknown at 0.2, 0.3 and 0.4 (kept: within 0.35 s of the
    # working answer); unknown at 0.5: 0.4 s since it, the stopwatch ends the attempt.
    assert took == pytest.approx(0.5, abs=0.02)
    assert len(gw.states("still_working")) == 1


@on_virtual_time
async def test_busy_without_progress_is_starved_not_working(metric):
    before = metric("tierchain_probe_answers_total", backend="tower", verdict="no_progress")
    async with (
        FakeBackend("tower", with_status(quiet, lambda: (200, vllm(1, 4242)))) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.1,
            progress_span=0.15,  # this fake's counters would move at every probe if alive
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(HOSTED)
    # the first answer cannot judge progress (extend once); the second sees none
    assert len(gw.states("still_working")) == 1
    assert took == pytest.approx(0.2, abs=1e-6)
    after = metric("tierchain_probe_answers_total", backend="tower", verdict="no_progress")
    assert after == before + 1


@on_virtual_time
async def test_the_ceiling_holds_against_a_backend_that_always_says_busy():
    generated = iter(range(1, 10_000))
    async with (
        FakeBackend("tower", with_status(quiet, lambda: (200, vllm(1, next(generated))))) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.06,
            ceiling=0.3,
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(HOSTED)
    assert len(gw.states("still_working")) >= 3
    assert took == pytest.approx(0.3, abs=1e-6)


@on_virtual_time
async def test_a_gate_reporting_another_models_generation_counts_as_working():
    gate = {
        "active_generation_count": 1,
        "active_generations": [{"id": "g1", "model": "other-model", "age_s": 3.0}],
    }
    chat, probed = after_probes(1, streams(["swapped in"]))
    status = counted(lambda: (200, json.dumps(gate).encode()), probed)
    async with (
        FakeBackend("tower", with_status(chat, status)) as tower,
        FakeBackend("hosted") as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("h", hosted.url),
            ],
            slow_after=0.12,
        )
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(openai_stream(["swapped in"]))
    assert hosted.requests == []
    assert len(gw.states("still_working")) >= 1


@on_virtual_time
async def test_a_custom_reader_is_a_plain_callable():
    from tierchain.probes import Status

    seen: list[bytes] = []

    def reader(body: bytes) -> Status | None:
        seen.append(body)
        return Status(busy=body == b"BUSY")

    chat, probed = after_probes(1, streams(["ok"]))
    async with (
        FakeBackend("tower", with_status(chat, counted(lambda: (200, b"BUSY"), probed))) as tower,
        FakeBackend("hosted") as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("h", hosted.url),
            ],
            slow_after=0.12,
            readers={"tower": reader},
        )
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(openai_stream(["ok"]))
    assert seen
    assert set(seen) == {b"BUSY"}


@on_virtual_time
async def test_the_caller_leaving_mid_wait_stops_the_probe_and_the_attempt():
    probe_started = asyncio.Event()

    async def script(ex: Exchange) -> None:
        if ex.request.path == "/status":
            probe_started.set()
        await ex.wait_closed_by_peer()

    async with FakeBackend("tower", script) as tower, FakeBackend("hosted") as hosted:
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.05,
        )
        async with serve(gw.app) as url:
            async with httpx.AsyncClient(timeout=5) as client:
                request = asyncio.create_task(
                    client.post(url + "/v1/chat/completions", content=chat_request())
                )
                await asyncio.wait_for(probe_started.wait(), 1)
                request.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await request
            for _ in range(100):
                if tower.open_connections == 0:
                    break
                await asyncio.sleep(0.005)
        await gw.aclose()
    assert tower.open_connections == 0  # chat request and probe both closed
    assert hosted.requests == []


# -- options ---------------------------------------------------------------------------


def test_options_are_validated_in_init():
    app = Forwarder()
    with pytest.raises(ValueError, match="slow_after"):
        SaturationWatchdog(app, slow_after=-1)
    with pytest.raises(ValueError, match="ceiling"):
        SaturationWatchdog(app, ceiling=0)
    with pytest.raises(ValueError, match="probe_timeout"):
        SaturationWatchdog(app, probe_timeout=float("nan"))
    with pytest.raises(ValueError, match="not callable"):
        SaturationWatchdog(app, readers={"tower": "vllm"})  # type: ignore[dict-item]


def test_the_window_comes_from_an_allowance_and_never_exceeds_the_ceiling():
    from tierchain import Allowance

    watchdog = SaturationWatchdog(Forwarder(), slow_after=Allowance(), ceiling=500)
    assert watchdog.window(chat_request(content="x" * 40_000)) == pytest.approx(400.0)
    assert watchdog.window(chat_request(content="x" * 4_000_000)) == 500
    assert SaturationWatchdog(Forwarder(), slow_after=0).off


@on_virtual_time
async def test_a_saturation_is_visible_in_the_sse_heartbeat_channel():
    async with (
        FakeBackend("tower", quiet) as tower,
        FakeBackend("hosted", streams(["x"])) as hosted,
    ):
        gw = Gateway([Backend("tower", tower.url), Backend("hosted", hosted.url)], slow_after=0.1)
        async with serve(gw.app) as url:
            response, _ = await post(url, chat_request())
        await gw.aclose()
    states = [e["state"] for e in gw.events]
    assert states == ["attempt", "backend_saturated", "attempt", "generating"]
    assert parse_sse(response.content)[0]["data"] is not None


@pytest.mark.parametrize(
    "fixture",
    ["llamacpp_metrics_deferred.txt", "llamacpp_slots_list_generating.json"],
)
@on_virtual_time
async def test_another_requests_progress_never_holds_a_queued_caller(metric, fixture):
    # A one-slot llama.cpp server generating someone else's long answer: its
    # counters move at every probe, but ours is the deferred one.
    from pathlib import Path

    body = (Path(__file__).parent / "fixtures" / fixture).read_bytes()
    moved = iter(range(2000, 100_000, 50))

    def status() -> tuple[int, bytes]:
        n = str(next(moved)).encode()
        return 200, body.replace(b"1874", n).replace(b"1873", n)

    before = metric("tierchain_probe_answers_total", backend="tower", verdict="queued")
    async with (
        FakeBackend("tower", with_status(quiet, status)) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        gw = Gateway(
            [
                Backend("tower", tower.url, status_url=tower.url + "/status"),
                Backend("hosted", hosted.url),
            ],
            slow_after=0.12,
        )
        async with serve(gw.app) as url:
            response, took = await post(url, chat_request())
        await gw.aclose()
    assert response.content == b"".join(HOSTED)
    assert gw.states("still_working") == []  # saturated at the first expiry
    assert took == pytest.approx(0.12, abs=1e-6)
    assert metric("tierchain_probe_answers_total", backend="tower", verdict="queued") == before + 1
