"""What the watchdog says of an attempt it cut (docs/watchdog.md): the exception Failover
gets for each reason (a saturation, a stall, the reserve's point reached mid-stream), the
``dispatch.backend_saturated`` line with its fields, the backend marked suspect, and,
alone (no Failover), the 504 or the stream's own error event the caller gets.

Each watch is cut at its exact time on the virtual clock (tests/watch_rig.py), then
:func:`tierchain.verdicts.verdict` is asked why.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from tierchain.errors import BackendSaturated, BackendUnavailable, StreamError
from tierchain.verdicts import verdict

from .support import on_virtual_time
from .watch_rig import commit, cut_at, keeper, run, watch_of


class Marks:
    """Stands in for the watchdog's suspect marks: the marks made."""

    def __init__(self) -> None:
        self.made: list[tuple[str, str, str]] = []

    def mark(self, route: str, backend: str, why: str) -> None:
        self.made.append((route, backend, why))


async def said(watch: Any) -> tuple[BaseException | None, list[dict[str, Any]], Marks]:
    marks = Marks()
    watch.watchdog.suspects = marks
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    try:
        await verdict(watch, send)
    except Exception as exc:  # the verdict, as Failover gets it
        return exc, sent, marks
    return None, sent, marks


@on_virtual_time
async def test_no_first_chunk_in_the_window_is_a_saturation_logged_and_marked(caplog):
    watch = watch_of()
    await cut_at(watch)
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        error, sent, marks = await said(watch)
    assert isinstance(error, BackendSaturated)
    assert str(error) == "backend 'tower' produced no first chunk in 10.0s (no_first_chunk)"
    assert (error.waited, error.why) == (10.0, "no_first_chunk")
    assert sent == []
    assert marks.made == [("echo", "tower", "no_first_chunk")]
    (line,) = [
        r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_saturated"
    ]
    assert line.tierchain == {
        "route": "echo",
        "backend": "tower",
        "waited_s": 10.0,
        "reason": "no_first_chunk",
        "failing_over": True,
        "n": 1,
        "of": 2,
        "reserve_s": None,
        "verdict": None,
    }


@on_virtual_time
async def test_a_too_slow_prefill_carries_its_verdict_and_teaches_the_learned_window(caplog):
    watch = watch_of(prefill=4.0)
    await cut_at(watch)
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        error, _, marks = await said(watch)
    assert isinstance(error, BackendSaturated)
    assert error.why == "too_slow"
    assert marks.made == [("echo", "tower", "too_slow")]
    (line,) = [
        r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_saturated"
    ]
    assert (line.tierchain["verdict"], line.tierchain["waited_s"]) == ("too_slow", 4.0)


@on_virtual_time
async def test_the_reserves_point_before_a_first_chunk_is_a_saturation_with_its_reserve(caplog):
    from .support import now

    watch = watch_of(deadline=now() + 30.375, reserve=25.0625)
    await cut_at(watch)
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        error, _, _ = await said(watch)
    assert isinstance(error, BackendSaturated)
    assert (error.why, error.waited) == ("reserve", 5.3125)
    (line,) = [
        r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_saturated"
    ]
    assert (line.tierchain["reserve_s"], line.tierchain["waited_s"]) == (25.062, 5.312)


@on_virtual_time
async def test_a_last_tier_cut_at_its_ceiling_is_not_failing_over(caplog):
    watch = watch_of(last=True, ceiling=40.0)
    await cut_at(watch)
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        error, _, _ = await said(watch)
    assert isinstance(error, BackendSaturated)
    assert str(error) == "backend 'hosted' produced no first chunk in 40.0s (ceiling)"
    (line,) = [
        r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_saturated"
    ]
    assert (line.tierchain["failing_over"], line.tierchain["n"]) == (False, 2)


async def _stalled_watch() -> Any:
    watch = watch_of(stall=3.0)

    async def stream(watch: Any) -> None:
        commit(watch)

    await run(watch, stream)
    return watch


@on_virtual_time
async def test_a_stalled_stream_is_a_stream_error_and_marks_its_backend():
    watch = await _stalled_watch()
    assert watch.fired == "stalled"
    error, _, marks = await said(watch)
    assert isinstance(error, StreamError)
    assert str(error) == "backend 'tower' sent no data event for 3s"
    assert error.reason == "stalled"
    assert marks.made == [("echo", "tower", "stalled")]


@on_virtual_time
async def test_a_committed_stream_at_the_reserves_point_is_the_gateways_doing():
    import asyncio

    from .support import now

    watch = watch_of(deadline=now() + 30.0, reserve=25.0, continuable=True)
    assert watch.req is not None

    async def stream(watch: Any) -> None:
        await asyncio.sleep(1.0)
        commit(watch)

    await run(watch, stream)
    assert watch.fired == "reserve"
    error, _, marks = await said(watch)
    assert isinstance(error, BackendUnavailable)
    assert str(error) == (
        "backend 'tower' was still streaming 25s before the budget ends "
        "(the reserve kept for the next tier)"
    )
    assert (error.reason, error.gateway_fault) == ("reserve", True)
    assert marks.made == []  # no verdict on the backend


@on_virtual_time
async def test_alone_a_quiet_backend_at_the_ceiling_is_answered_504():
    from tierchain.watch import Watch

    watch = Watch(keeper(ceiling=20.0), None, None, window=0.0, stall=0.0)
    assert await cut_at(watch) == ("ceiling", 20.0)
    error, sent, _ = await said(watch)
    assert error is None
    assert sent[0]["status"] == 504
    assert json.loads(sent[1]["body"]) == {
        "error": {
            "message": "the backend produced no first chunk in 20.0s (ceiling)",
            "type": "backend_saturated",
            "code": "ceiling",
        }
    }


class Learned:
    """Stands in for the learned windows: the saturations told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, bytes | None, bool]] = []

    def saturated(self, backend: str, body: bytes | None, learned: bool) -> None:
        self.told.append((backend, body, learned))


@on_virtual_time
async def test_a_saturation_is_counted_traced_and_taught_to_the_learned_window(metric):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from .support import now

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    labels = {"route": "echo", "backend": "tower"}
    before = metric("tierchain_backend_saturated_total", **labels)
    reserves = metric("tierchain_reserve_ended_total", **labels)
    watch = watch_of(prefill=4.0625, learned=True)
    assert watch.req is not None
    watch.req.body = b'{"model": "m"}'
    await cut_at(watch)
    learned = Learned()
    watch.watchdog.learned = learned
    with provider.get_tracer("t").start_as_current_span("attempt"):
        error, _, _ = await said(watch)
    assert isinstance(error, BackendSaturated)
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert dict(span.attributes) == {
        "tierchain.saturated_reason": "too_slow",
        "tierchain.verdict": "too_slow",
    }
    (event,) = span.events
    assert event.name == "tierchain.backend_saturated"
    assert dict(event.attributes or {}) == {
        "tierchain.backend": "tower",
        "reason": "too_slow",
        "waited_s": 4.062,
    }
    assert metric("tierchain_backend_saturated_total", **labels) == before + 1
    assert metric("tierchain_reserve_ended_total", **labels) == reserves
    assert learned.told == [("tower", b'{"model": "m"}', True)]

    watch = watch_of(deadline=now() + 30.0, reserve=25.0)  # the reserve: not the backend's pace
    await cut_at(watch)
    learned = Learned()
    watch.watchdog.learned = learned
    await said(watch)
    assert learned.told == []
    assert metric("tierchain_reserve_ended_total", **labels) == reserves + 1


@on_virtual_time
async def test_alone_a_stream_cut_at_its_ceiling_ends_with_its_own_error_event():

    from tierchain.watch import Watch

    sent_down: list[dict[str, Any]] = []

    async def downstream(message: dict[str, Any]) -> None:
        sent_down.append(message)

    watch = Watch(keeper(ceiling=20.0), None, None, window=0.0, stall=0.0, send=downstream)

    async def head(watch: Any) -> None:
        await watch.send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )

    assert await run(watch, head) == ("ceiling", 20.0)
    error, sent, _ = await said(watch)
    assert error is None
    (last,) = sent
    assert last["type"] == "http.response.body"
    assert last["more_body"] is False
    (event,) = [e for e in last["body"].split(b"\n\n") if e.startswith(b"data: ")]
    assert json.loads(event[6:]) == {
        "error": {
            "message": "the backend produced no first chunk in 20.0s (ceiling)",
            "type": "backend_saturated",
            "code": "ceiling",
        }
    }


@on_virtual_time
async def test_alone_a_whole_answer_not_begun_at_the_ceiling_is_raised_for_the_server():

    from tierchain.watch import Watch

    async def downstream(message: dict[str, Any]) -> None:
        pass

    watch = Watch(keeper(ceiling=20.0), None, None, window=0.0, stall=0.0, send=downstream)

    async def head(watch: Any) -> None:
        start = {"type": "http.response.start", "status": 200}
        await watch.send({**start, "headers": [(b"content-type", b"application/json")]})

    await run(watch, head)
    error, sent, _ = await said(watch)
    assert isinstance(error, BackendSaturated)
    assert str(error) == "the backend produced no first chunk in 20.0s (ceiling)"
    assert (error.waited, error.why) == (20.0, "ceiling")
    assert sent == []


@on_virtual_time
async def test_a_starved_stream_is_said_logged_traced_and_raised_as_a_saturation(caplog):
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tierchain.decode import SPANS
    from tierchain.verdicts import _starved

    class Decode:
        rate = 3.14159
        limit = 10.4567
        learned = True
        span = 2.0

    lines: list[dict[str, Any]] = []
    watch = watch_of(lines=lines)
    marks = Marks()
    watch.watchdog.suspects = marks
    await asyncio.sleep(7.0)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with (
        caplog.at_level(logging.WARNING, logger="tierchain"),
        provider.get_tracer("t").start_as_current_span("attempt"),
        pytest.raises(BackendSaturated) as raised,
    ):
        _starved(watch, Decode())  # type: ignore[arg-type]
    assert str(raised.value) == (
        f"backend 'tower' wrote 3.14 tokens/s over {SPANS} spans of 2s, under its limit of 10.46 "
        "(starved)"
    )
    assert (raised.value.waited, raised.value.why) == (7.0, "slow_decode")
    (line,) = [r for r in caplog.records if getattr(r, "event", None) == "dispatch.backend_starved"]
    assert line.levelno == logging.WARNING
    assert line.tierchain == {
        "route": "echo",
        "backend": "tower",
        "tokens_per_s": 3.14,
        "limit_tokens_per_s": 10.46,
        "learned": True,
        "span_s": 2.0,
    }
    (event,) = exporter.get_finished_spans()[0].events
    assert (event.name, dict(event.attributes or {})) == (
        "tierchain.backend_starved",
        {"tierchain.backend": "tower", "tokens_per_s": 3.14},
    )
    assert lines == [
        {
            "state": "backend_starved",
            "backend": "tower",
            "reason": "slow_decode",
            "tokens_per_s": 3.14,
            "limit_tokens_per_s": 10.46,
            "failing_over": True,
        }
    ]
    assert marks.made == [("echo", "tower", "slow_decode")]


@on_virtual_time
async def test_alone_a_stalled_stream_ends_with_its_own_error_event():

    from tierchain.watch import Watch

    async def downstream(message: dict[str, Any]) -> None:
        pass

    watch = Watch(keeper(), None, None, window=0.0, stall=3.0, send=downstream)

    async def stream(watch: Any) -> None:
        start = {"type": "http.response.start", "status": 200}
        await watch.send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await watch.send(
            {"type": "http.response.body", "body": b'data: {"a": 1}\n\n', "more_body": True}
        )
        watch.first_data()

    assert await run(watch, stream) == ("stalled", 3.0)
    error, sent, marks = await said(watch)
    assert error is None
    assert marks.made == []  # alone there is no attempt to mark
    (last,) = sent
    assert last["type"] == "http.response.body"
    assert last["more_body"] is False
    (event,) = [e for e in last["body"].split(b"\n\n") if e.startswith(b"data: ")]
    error_event = json.loads(event[6:])["error"]
    assert error_event["message"] == "the backend sent no data event for 3s"
    assert (error_event["type"], error_event["code"]) == ("upstream_error", "stalled")


@on_virtual_time
async def test_a_stream_under_a_decode_watch_cut_at_the_reserves_point_is_not_starved():
    import asyncio

    from tierchain.decode import DecodeWatch

    from .support import now

    watch = watch_of(
        deadline=now() + 30.0, reserve=25.0, watchdog=keeper(decode_rate=50.0), continuable=True
    )
    assert watch.req is not None
    assert watch.attempt is not None

    async def stream(watch: Any) -> None:
        await asyncio.sleep(1.0)
        commit(watch)

    assert await run(watch, stream) == ("reserve", 5.0)
    # (Failover asks the verdict while the attempt's decode watch still runs)
    decode = watch.watchdog.decode
    assert decode is not None
    watch.decoding = DecodeWatch(
        watch, decode, watch.attempt.backend, now(), watch.observer.data_events
    )
    error, _, marks = await said(watch)
    watch.decoding.cancel()
    assert isinstance(error, BackendUnavailable)
    assert (error.reason, error.gateway_fault) == ("reserve", True)
    assert marks.made == []


@on_virtual_time
async def test_a_pool_replicas_starved_line_names_its_pool():
    from tierchain import Backend, Pool
    from tierchain.verdicts import _starved

    class Decode:
        rate, limit, learned, span = 1.0, 10.0, False, 2.0

    (replica,) = Pool("towers", [Backend("tower-a", "http://127.0.0.1:9")]).backends
    lines: list[dict[str, Any]] = []
    watch = watch_of(tier=replica, lines=lines)
    watch.watchdog.suspects = Marks()
    with pytest.raises(BackendSaturated):
        _starved(watch, Decode())  # type: ignore[arg-type]
    (line,) = lines
    assert (line["state"], line["backend"], line["pool"]) == (
        "backend_starved",
        "tower-a",
        "towers",
    )


@on_virtual_time
async def test_a_held_answer_cut_after_its_first_bytes_produced_no_whole_answer():
    watch = watch_of(window=0.0, ceiling=20.0)

    async def first_bytes(watch: Any) -> None:
        watch.observer.start(200, [(b"content-type", b"application/json")])
        watch.observer.body(b'{"id": "chatcmpl-1", "choices": [')

    assert await run(watch, first_bytes) == ("ceiling", 20.0)
    error, _, _ = await said(watch)
    assert isinstance(error, BackendSaturated)
    assert str(error) == "backend 'tower' produced no whole answer in 20.0s (ceiling)"
