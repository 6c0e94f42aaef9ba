"""The audit's smaller findings (issue 33), each fixed at its root."""

from __future__ import annotations

from typing import Any

import httpx

from tierchain import Backend, Failover, Forwarder, Routes

from .support import FakeBackend, chat_request, completion_body, on_virtual_time, serve


@on_virtual_time
async def test_an_upstreams_x_tierchain_headers_never_reach_the_caller() -> None:
    async def spoofing(ex: Any) -> None:
        await ex.respond(
            200,
            completion_body("ok"),
            {"x-tierchain-backend": "hosted", "x-tierchain-attempts": "forged", "x-other": "kept"},
        )

    async def host_handler(scope: Any, receive: Any, send: Any) -> None:
        # A host's own handler that passes the upstream's headers on as they came.
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"x-tierchain-backend", b"forged"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": completion_body("ok")})

    async with FakeBackend("tower", spoofing) as tower:
        forwarder = Forwarder()
        lone = Forwarder(backend=Backend("tower", tower.url))
        routes = Routes({"echo": [Backend("tower", tower.url)]})
        async with (
            serve(Failover(forwarder, routes=routes)) as url,
            serve(Failover(host_handler, routes=routes)) as host,
            serve(lone) as alone,
            httpx.AsyncClient() as client,
        ):
            body = chat_request(stream=False)
            via = await client.post(url + "/v1/chat/completions", content=body)
            handled = await client.post(host + "/v1/chat/completions", content=body)
            bare = await client.post(alone + "/v1/chat/completions", content=body)
        await forwarder.aclose()
        await lone.aclose()
    assert via.headers.get_list("x-tierchain-backend") == ["tower"]
    assert via.headers.get_list("x-tierchain-attempts") == ["tower;outcome=ok"]
    assert via.headers["x-other"] == "kept"
    assert handled.headers.get_list("x-tierchain-backend") == ["tower"]
    assert "x-tierchain-backend" not in bare.headers


async def test_a_key_in_the_query_string_is_masked_in_the_access_log(tmp_path) -> None:
    import signal

    from .test_serve import START_TIMEOUT, tierchain_serve

    secret = "sk-gw-in-the-query-0123456789"
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    env = {
        "TIERCHAIN_ROUTES_FILE": str(routes),
        "TIERCHAIN_LOG_FORMAT": "json",
        "TIERCHAIN_ACCESS_LOG": "1",
        "TIERCHAIN_API_KEYS": secret,
        "TIERCHAIN_PORT": "0",
    }
    async with tierchain_serve(env) as served:
        listening = await served.event("serve.listening", within=START_TIMEOUT)
        (address,) = listening["addresses"]
        async with httpx.AsyncClient(base_url=f"http://{address}", timeout=5) as client:
            await client.get(f"/v1/models?key={secret}&limit=5")
            await client.get(f"/healthz?q={secret}")

        def logged() -> bool:
            return sum('"GET /' in line for line in served.lines) >= 2

        await served.until(logged, within=START_TIMEOUT)
        served.proc.send_signal(signal.SIGTERM)
        assert await served.exit_status(10.0) == 0
    access = [line for line in served.lines if '"GET /' in line]
    assert access
    assert not [line for line in served.lines if secret in line]
    assert any("/v1/models?key=***&limit=5" in line for line in access)


def test_two_virtual_time_blocks_closed_out_of_order_leave_the_real_clock_on() -> None:
    import time

    from tierchain._runtime import clock
    from tierchain.testing import virtual_time

    first, second = virtual_time(), virtual_time()
    one = first.__enter__()
    two = second.__enter__()
    first.__exit__(None, None, None)  # the outer block closes first
    assert clock.now is two.read  # the block still open keeps its clock
    assert clock.virtual() is two
    second.__exit__(None, None, None)
    assert clock.now is time.monotonic
    assert one is not two


def test_a_route_name_with_a_line_separator_stays_on_its_log_line(caplog) -> None:
    import io
    import logging

    from tierchain.identity import write_identity
    from tierchain.logs import JsonFormatter, TextFormatter
    from tierchain.telemetry import log_event

    name = "echo\u2028forged line\u2029\x85\x1b[31m"
    routes = Routes({name: [Backend("tower", "http://127.0.0.1:9")]})
    out = io.StringIO()
    handlers = []
    for formatter in (TextFormatter(), JsonFormatter(), logging.Formatter()):
        handler = logging.StreamHandler(out)
        handler.setFormatter(formatter)
        handlers.append(handler)
    tierchain_logger = logging.getLogger("tierchain")
    for handler in handlers:
        tierchain_logger.addHandler(handler)
    old_level = tierchain_logger.level
    tierchain_logger.setLevel(logging.DEBUG)
    try:
        write_identity(routes=routes)
        log_event("request.route_refused", logging.DEBUG, route=name)
    finally:
        tierchain_logger.setLevel(old_level)
        for handler in handlers:
            tierchain_logger.removeHandler(handler)
    written = out.getvalue()
    assert written.count("\n") == 6  # two events, three formatters: one line each
    assert len(written.splitlines()) == 6  # (splitlines also breaks at U+2028, NEL, ...)
    for raw in ("\u2028", "\u2029", "\x85", "\x1b"):
        assert raw not in written
    assert "echo\\u2028forged line" in written


def _anthropic_observer() -> Any:
    from tierchain.observer import Observer
    from tierchain.wire import ANTHROPIC

    observer = Observer(wire=ANTHROPIC)
    observer.start(200, [(b"content-type", b"text/event-stream")])
    return observer


def test_an_anthropic_stream_ending_message_stop_then_ping_is_whole_however_it_is_split() -> None:
    from .wire_fakes import _event, anthropic_stream

    # A ping after message_stop: Anthropic sends pings at any time in a stream
    # (docs.anthropic.com, "Streaming Messages": "Ping events").
    raw = b"".join(anthropic_stream(["Hel", "lo"])) + _event("ping", {"type": "ping"})
    tail = len(_event("message_stop", {"type": "message_stop"})) + len(
        _event("ping", {"type": "ping"})
    )
    verdicts = set()
    whole_before_end = set()
    for cut in range(len(raw) - tail - 1, len(raw) + 1):
        observer = _anthropic_observer()
        observer.body(raw[:cut])
        observer.body(raw[cut:])
        whole_before_end.add(observer.reached_end())
        observer.end()
        verdicts.add(observer.verdict())
    assert verdicts == {"ok"}
    assert whole_before_end == {True}


def test_an_anthropic_stream_without_message_stop_is_still_truncated() -> None:
    from .wire_fakes import _event, anthropic_stream

    raw = b"".join(anthropic_stream(["Hel", "lo"])[:-1]) + _event("ping", {"type": "ping"})
    observer = _anthropic_observer()
    observer.body(raw)
    assert not observer.reached_end()
    observer.end()
    assert observer.verdict() == "truncated"


@on_virtual_time
async def test_an_ollama_stream_whose_done_line_arrived_gets_nothing_appended_when_it_breaks():
    from .wire_fakes import ollama_chat_lines, sends

    lines = ollama_chat_lines(["Hel", "lo"])
    ndjson = {"content-type": "application/x-ndjson"}
    async with FakeBackend("tower", sends(lines, headers=ndjson, then="reset")) as tower:
        forwarder = Forwarder()
        app = Failover(forwarder, routes=Routes({"echo": [Backend("tower", tower.url)]}))
        async with serve(app) as url, httpx.AsyncClient() as client:
            body = b'{"model":"echo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
            response = await client.post(url + "/api/chat", content=body)
        await forwarder.aclose()
    assert response.status_code == 200
    assert response.content == b"".join(lines)  # no {"error": ...} line after "done": true


def _cpu_to_feed_one_event_a_byte_at_a_time(size: int, framing: bytes) -> float:
    import time

    from tierchain.observer import Observer
    from tierchain.wire import OLLAMA

    if framing == b"text/event-stream":
        event = b"data: " + b"x" * size + b"\n\n"
        observer = Observer()
    else:
        event = b'{"x":"' + b"x" * size + b'"}\n'
        observer = Observer(wire=OLLAMA)
    observer.max_event = 2 * size
    observer.start(200, [(b"content-type", framing)])
    pieces = [event[i : i + 1] for i in range(len(event))]
    t0 = time.process_time()
    out = b"".join(observer.body(piece) for piece in pieces)
    took = time.process_time() - t0
    assert out == event
    return took


def test_an_event_fed_a_byte_at_a_time_costs_linear_time_not_quadratic() -> None:
    # A ratio of CPU times, not a bound: four times the bytes cost about four times the
    # work when linear, sixteen when every byte copies what is held (1 MB took 29 s).
    for framing in (b"text/event-stream", b"application/x-ndjson"):
        small = min(_cpu_to_feed_one_event_a_byte_at_a_time(64 * 1024, framing) for _ in range(3))
        large = min(_cpu_to_feed_one_event_a_byte_at_a_time(256 * 1024, framing) for _ in range(2))
        assert large / small < 8, (framing, small, large)


@on_virtual_time
async def test_a_burst_of_requests_sends_at_most_one_status_get_at_a_time_per_url() -> None:
    import asyncio

    from tierchain import Breaker, SaturationWatchdog

    from .support import refused_url, streams

    gets_in_flight = 0
    most = 0
    gets = 0

    async def tower(ex: Any) -> None:
        nonlocal gets_in_flight, most, gets
        if ex.request.path == "/status":
            gets += 1
            gets_in_flight += 1
            most = max(most, gets_in_flight)
            try:
                await asyncio.sleep(0.05)  # a status page that takes a moment to answer
                # The gate shape: nothing generating, so the backend has room.
                await ex.respond(200, b'{"active_generation_count": 0}')
            finally:
                gets_in_flight -= 1
            return
        await streams(["ok"])(ex)

    async with FakeBackend("tower", tower) as t:
        forwarder = Forwarder()
        watchdog = SaturationWatchdog(forwarder, slow_after=5.0, status_interval=0.05)
        chain = [
            Backend("tower", t.url, status_url=t.url + "/status"),
            Backend("hosted", refused_url()),
        ]
        app = Failover(Breaker(watchdog), routes=Routes({"echo": chain}))
        async with serve(app) as url, httpx.AsyncClient(timeout=30) as client:
            burst = [
                client.post(url + "/v1/chat/completions", content=chat_request()) for _ in range(60)
            ]
            answers = await asyncio.gather(*burst)
        await forwarder.aclose()
        await watchdog.aclose()
    assert {r.status_code for r in answers} == {200}
    assert most == 1  # one GET of the status URL in flight at a time, whoever asked
    assert 1 <= gets < 60


async def test_an_unexpected_exception_in_the_app_is_a_tierchain_event_not_a_server_traceback(
    caplog,
) -> None:
    import logging

    from tierchain.errors import CallerStalled
    from tierchain.logs import DropLoggedErrors
    from tierchain.serve import Drain

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/after-start":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
            raise RuntimeError("broke mid-answer")
        if scope["path"] == "/stalled":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise CallerStalled("the caller took no data for 1s (send_timeout)")
        raise RuntimeError("broke before answering")

    caplog.set_level(logging.INFO)
    server_log = logging.getLogger("uvicorn.error")
    dropped = DropLoggedErrors()  # as tierchain serve's logging configuration sets it
    server_log.addFilter(dropped)
    try:
        async with serve(Drain(broken)) as url, httpx.AsyncClient() as client:
            before = await client.post(url + "/api/chat", content=b"{}")
            for path in ("/after-start", "/stalled"):
                try:
                    await client.get(url + path)
                except httpx.HTTPError:
                    pass  # the connection dropped: the only end a started answer has
    finally:
        server_log.removeFilter(dropped)
    assert before.status_code == 500
    assert before.json() == {"error": "the gateway failed to answer this request"}  # /api/*
    events = [r for r in caplog.records if getattr(r, "event", None) == "serve.app_error"]
    assert [r.tierchain["path"] for r in events] == ["/api/chat", "/after-start"]
    assert all("RuntimeError" in r.tierchain["traceback"] for r in events)
    assert not [r for r in caplog.records if r.name.startswith("uvicorn") and r.exc_info]


@on_virtual_time
async def test_the_gateways_own_errors_on_ollama_paths_come_in_ollamas_shape() -> None:
    from .support import refused_url

    forwarder = Forwarder()
    app = Failover(forwarder, routes=Routes({"echo": [Backend("tower", refused_url())]}))
    body = b'{"model":"echo","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    async with serve(app) as url, httpx.AsyncClient() as client:
        failed = await client.post(url + "/api/chat", content=body)
        unknown = await client.post(url + "/api/chat", content=body.replace(b"echo", b"nope"))
        openai = await client.post(url + "/v1/chat/completions", content=chat_request())
    await forwarder.aclose()
    assert failed.status_code == 502
    assert isinstance(failed.json()["error"], str)  # Ollama's {"error": "..."}
    assert unknown.status_code == 404
    assert isinstance(unknown.json()["error"], str)
    assert openai.json()["error"]["type"] == "all_backends_failed"  # OpenAI's, elsewhere
