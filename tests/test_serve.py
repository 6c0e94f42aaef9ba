"""``tierchain serve`` as a real process: logs, the identity line, draining on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from asgi_lifespan import LifespanManager

from tierchain import Forwarder, identity
from tierchain.config import from_env
from tierchain.logs import JsonFormatter, TextFormatter
from tierchain.serve import _TICK, Drain, _Server
from tierchain.stack import build_stack
from tierchain.telemetry import log_event

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    chunk_event,
    completion_body,
    now,
    on_virtual_time,
    openai_stream,
    parse_sse,
)

START_TIMEOUT = 20.0  # a fresh interpreter importing everything, on a busy 2-core machine


class Served:
    """A ``python -m tierchain serve`` process and the lines it writes to stderr."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line.decode().rstrip("\n"))
            self._changed.set()
        self._changed.set()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines if line.startswith("{")]

    async def until(self, test: Callable[[], Any], within: float) -> Any:
        async with asyncio.timeout(within):
            while not (found := test()):
                if self._reader.done():
                    raise AssertionError("the process ended:\n" + "\n".join(self.lines))
                self._changed.clear()
                await self._changed.wait()
            return found

    async def event(self, name: str, within: float = 5.0) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next((e for e in self.events() if e.get("event") == name), None)

        return await self.until(find, within)

    async def exit_status(self, within: float) -> int:
        async with asyncio.timeout(within):
            status = await self.proc.wait()
            await self._reader
        return status


@contextlib.asynccontextmanager
async def tierchain_serve(env: dict[str, str], *args: str) -> AsyncIterator[Served]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAIN_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tierchain",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *args,
        env={**clean, **env},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    served = Served(proc)
    try:
        yield served
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await served._reader


def routes_file(tmp_path: Path, url: str) -> str:
    path = tmp_path / "routes.toml"
    path.write_text(f'[[routes.echo.backends]]\nname = "tower"\nurl = "{url}"\n')
    return str(path)


class Held:
    """A backend that sends its first event, then holds the stream until released."""

    def __init__(self, *, never: bool = False) -> None:
        self.never = never
        self.release = asyncio.Event()
        self.events = openai_stream(["one", "two"])

    async def __call__(self, ex: Exchange) -> None:
        await ex.head()
        await ex.write(self.events[0])
        if self.never:
            await ex.wait_closed_by_peer()
            return
        await self.release.wait()
        for event in self.events[1:]:
            await ex.write(event)
        await ex.end()


async def read_first_event(lines: Any) -> bytes:
    seen = b""
    async for piece in lines:
        seen += piece
        if b"data: " in seen and seen.endswith(b"\n\n"):
            return seen
    raise AssertionError(f"the stream ended before its first event: {seen!r}")


async def test_a_stream_in_flight_finishes_after_sigterm_and_the_process_exits_0(tmp_path):
    held = Held()
    async with FakeBackend("tower", held) as tower:
        env = {
            "TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, tower.url),
            "TIERCHAIN_LOG_FORMAT": "json",
            "TIERCHAIN_DRAIN_TIMEOUT": "10",
        }
        async with tierchain_serve(env) as served, httpx.AsyncClient(timeout=5) as client:
            started = await served.event("tierchain.started", START_TIMEOUT)
            (address,) = (await served.event("serve.listening"))["addresses"]
            url = f"http://{address}"
            request = client.build_request(
                "POST", url + "/v1/chat/completions", content=chat_request()
            )
            response = await client.send(request, stream=True)
            pieces = response.aiter_raw()
            first = await read_first_event(pieces)
            served.proc.send_signal(signal.SIGTERM)
            draining = await served.event("serve.draining")
            # No new connection is taken while the stream drains.
            with pytest.raises(httpx.ConnectError):
                await client.get(url + "/healthz")
            assert served.proc.returncode is None
            held.release.set()
            rest = b"".join([piece async for piece in pieces])
            await response.aclose()
            status = await served.exit_status(5.0)
    body = first + rest
    assert status == 0, "\n".join(served.lines)
    assert body.endswith(b"data: [DONE]\n\n")
    assert chunk_event("two") in body
    assert started["routes"] == {"echo": [{"name": "tower", "url": tower.url, "may_hedge": True}]}
    assert started["settings"]["stack"][0] == "Heartbeats"
    assert draining["signal"] == "SIGTERM"
    assert draining["in_flight"] == 1
    assert "serve.request_cut" not in [e.get("event") for e in served.events()]
    # Every line is one JSON object; httpx's own request lines (full backend URLs) stay quiet.
    records = [json.loads(line) for line in served.lines]
    assert {r["logger"] for r in records} <= {"tierchain", "uvicorn.error"}
    events = [r.get("event") for r in records]
    assert events.index("tierchain.started") < events.index("serve.listening")


async def test_the_drain_deadline_cuts_a_stream_that_does_not_finish(tmp_path):
    held = Held(never=True)
    async with FakeBackend("tower", held) as tower:
        env = {
            "TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, tower.url),
            "TIERCHAIN_LOG_FORMAT": "json",
            "TIERCHAIN_DRAIN_TIMEOUT": "300ms",
        }
        async with tierchain_serve(env) as served, httpx.AsyncClient(timeout=5) as client:
            (address,) = (await served.event("serve.listening", START_TIMEOUT))["addresses"]
            request = client.build_request(
                "POST", f"http://{address}/v1/chat/completions", content=chat_request()
            )
            response = await client.send(request, stream=True)
            pieces = response.aiter_raw()
            await read_first_event(pieces)
            served.proc.send_signal(signal.SIGTERM)
            status = await served.exit_status(5.0)
            rest = b"".join([piece async for piece in pieces])
            await response.aclose()
            async with asyncio.timeout(2):
                await tower.connection_closed.wait()  # the upstream stream was let go
    assert status == 0, "\n".join(served.lines)
    # The caller's stream ends with an error event it can parse, after the last whole event.
    assert rest.startswith(b"data: ")
    data = [json.loads(e["data"]) for e in parse_sse(rest) if e["data"]]
    assert [d["error"]["code"] for d in data] == ["shutting_down"], rest
    assert rest.endswith(b"\n\n")
    draining = await served.event("serve.draining")
    assert draining["in_flight"] == 1
    cut = await served.event("serve.request_cut")
    assert (cut["started"], cut["stream"]) == (True, True)
    # (A process of its own, on the real clock: the cut above is the deadline's, so only
    # the deadline itself bounds the time.)
    assert (await served.event("serve.stopped"))["took_s"] >= 0.3


async def test_text_logs_are_one_line_per_event_and_sigint_stops_it(tmp_path):
    env = {"TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, "http://127.0.0.1:9")}
    async with tierchain_serve(env) as served:
        line = await served.until(
            lambda: next((x for x in served.lines if " serve.listening " in x), None),
            START_TIMEOUT,
        )
        served.proc.send_signal(signal.SIGINT)
        status = await served.exit_status(5.0)
    assert status == 0, "\n".join(served.lines)
    assert " INFO    tierchain serve.listening addresses=" in line
    identity = next(x for x in served.lines if " tierchain.started " in x)
    assert identity.split()[2] == "tierchain"
    assert '"url": "http://127.0.0.1:9"' in identity


async def test_a_configuration_problem_exits_2_naming_the_variable(tmp_path):
    env = {"TIERCHAIN_DRAIN_TIMEOUT": "soon"}
    async with tierchain_serve(env) as served:
        status = await served.exit_status(START_TIMEOUT)
    assert status == 2
    text = "\n".join(served.lines)
    assert "TIERCHAIN_DRAIN_TIMEOUT='soon': expected seconds" in text


def test_the_formatters_keep_a_traceback_on_the_event_line(caplog):
    caplog.set_level(logging.INFO, logger="tierchain")
    log_event("serve.listening", logging.INFO, addresses=["127.0.0.1:1"], note="two\nlines")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("tierchain").exception("plain message")
    event, failure = caplog.records[-2:]
    text = TextFormatter().format(event)
    assert "\n" not in text
    assert text.endswith('serve.listening addresses=["127.0.0.1:1"] note="two\\nlines"')
    as_json = json.loads(JsonFormatter().format(event))
    assert as_json["event"] == "serve.listening"
    assert as_json["note"] == "two\nlines"
    assert "\n" not in TextFormatter().format(failure)
    assert "ValueError: boom" in json.loads(JsonFormatter().format(failure))["exc"]


def plain_uvicorn_setup(tmp_path: Path, *, gunicorn: bool = False) -> dict[str, str]:
    """docs/operations.md's logging.json (and gunicorn.conf.py) and the quick start's gateway."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    (config,) = re.findall(r"```json\n(.*?)```", page, re.S)
    (tmp_path / "logging.json").write_text(config)
    if gunicorn:
        blocks = re.findall(r"```python\n(.*?)```", page, re.S)
        (conf,) = [b for b in blocks if "gunicorn" in b]
        (tmp_path / "gunicorn.conf.py").write_text(conf)
    (tmp_path / "gateway.py").write_text(
        "from tierchain.config import from_env\n"
        "from tierchain.stack import build_stack\n\n"
        "def app():\n"
        "    return build_stack(None, from_env())\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TIERCHAIN_")}
    clean["TIERCHAIN_ROUTES_FILE"] = routes_file(tmp_path, "http://127.0.0.1:9")
    clean["HOME"] = str(tmp_path)  # gunicorn keeps a control socket under $HOME
    return clean


async def test_the_documented_log_config_shows_the_identity_line_under_plain_uvicorn(tmp_path):
    clean = plain_uvicorn_setup(tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        "gateway:app",
        "--app-dir",
        str(tmp_path),
        "--log-config",
        str(tmp_path / "logging.json"),
        "--port",
        "0",
        env=clean,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    served = Served(proc)
    try:
        started = await served.event("tierchain.started", START_TIMEOUT)
    finally:
        proc.send_signal(signal.SIGINT)
        await served.exit_status(5.0)
    assert started["logger"] == "tierchain"
    assert started["routes"] == {
        "echo": [{"name": "tower", "url": "http://127.0.0.1:9", "may_hedge": True}]
    }


# -- in process: Drain and the served stack's lifespan -------------------------------------


def http_scope(path: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "headers": []}


async def never_receive() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def drained(app: Any, deadline: float) -> tuple[Drain, list[dict[str, Any]]]:
    """Run one request through Drain(app), start the drain once it runs; return what was sent."""
    drain = Drain(app)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    task = asyncio.create_task(drain(http_scope(), never_receive, send))
    for _ in range(100):
        if drain.in_flight:
            break
        await asyncio.sleep(0)
    assert drain.in_flight == 1
    drain.start(deadline)
    async with asyncio.timeout(2):
        await task
    assert drain.in_flight == 0
    return drain, sent


async def test_drain_answers_503_for_a_request_not_yet_answered_at_the_deadline():
    async def waits(scope, receive, send):
        await asyncio.Event().wait()

    _, sent = await drained(waits, 0.05)
    start, body = sent
    assert start["status"] == 503
    assert (b"connection", b"close") in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == "shutting_down"


async def test_drain_ends_a_started_stream_with_an_error_event_after_its_last_event():
    event = chunk_event("one")

    async def streams_then_waits(scope, receive, send):
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": event, "more_body": True})
        await asyncio.Event().wait()

    _, sent = await drained(streams_then_waits, 0.05)
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies[0] == event
    assert bodies[1].startswith(b'data: {"error":')
    assert b'"code":"shutting_down"' in bodies[1]
    assert sent[-1]["more_body"] is False


async def test_drain_leaves_the_apps_own_timeout_alone_and_finished_requests_untouched():
    async def times_out(scope, receive, send):
        raise TimeoutError("the app's own")

    drain = Drain(times_out)
    drain.start(30)
    sent = []

    async def record(message):
        sent.append(message)

    await drain(http_scope(), never_receive, record)
    # Not the drain's cut (503 shutting_down): the app's own failure, a 500 of its own.
    assert sent[0]["status"] == 500
    assert b"shutting_down" not in sent[1]["body"]


def ticking_server() -> tuple[_Server, list[tuple[float, int]]]:
    """tierchain serve's uvicorn server, with its ``on_tick`` calls recorded (time, counter)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    server = _Server(config, drain=Drain(app), drain_timeout=1.0)
    ticks: list[tuple[float, int]] = []
    on_tick = server.on_tick

    async def recorded(counter: int) -> bool:
        ticks.append((now(), counter))
        return await on_tick(counter)

    server.on_tick = recorded  # type: ignore[method-assign]
    return server, ticks


@on_virtual_time
async def test_the_served_server_wakes_once_a_second_for_its_own_checks():
    # uvicorn's own main loop wakes ten times a second, most of what an idle gateway holding
    # parked streams costs; tierchain serve's once a second, each wake refreshing the Date
    # header as uvicorn's does every tenth.
    server, ticks = ticking_server()
    task = asyncio.create_task(server.main_loop())
    start = now()
    await asyncio.sleep(10 * _TICK + _TICK / 2)
    assert [round(t - start, 6) for t, _ in ticks] == [i * _TICK for i in range(11)]
    assert all(counter % 10 == 0 for _, counter in ticks)
    assert server.server_state.default_headers[0][0] == b"date"
    server.should_exit = True
    await task


@on_virtual_time
async def test_a_stop_wakes_the_served_server_at_once_not_at_its_next_check():
    # A signal (uvicorn's handle_exit, as the signal handler calls it) and a plain
    # should_exit (the lifespan, an embedding program) both end the loop when they come.
    for stop in ("signal", "should_exit"):
        server, ticks = ticking_server()
        task = asyncio.create_task(server.main_loop())
        await asyncio.sleep(_TICK * 2.5)
        loop = asyncio.get_running_loop()
        asked = now() + _TICK / 4
        if stop == "signal":
            loop.call_at(asked, server.handle_exit, signal.SIGTERM, None)
        else:
            loop.call_at(asked, setattr, server, "should_exit", True)
        await task
        assert now() == asked, stop
        assert ticks[-1][0] == asked, stop  # the check that ends it comes with the stop
        assert len(ticks) == 4, stop  # (at 0, 1 and 2 s, then the stop's)
        assert server.should_exit is True
        # (the signal's name is what serve.draining logs)
        assert server.signal_name == ("SIGTERM" if stop == "signal" else None), stop


async def test_the_served_stack_starts_and_stops_through_drain(tmp_path, monkeypatch, caplog):
    # Lifespan goes through Drain to the stack: the identity line at start-up, the
    # Forwarder closing its upstream connections at shut-down.
    caplog.set_level(logging.INFO, logger="tierchain")
    monkeypatch.setattr(identity, "PROCESS_ONCE", identity.Once())

    async def answer(ex: Exchange) -> None:
        await ex.respond(200, completion_body("hello"))

    async with FakeBackend("tower", answer) as tower:
        settings = from_env({"TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, tower.url)})
        app = build_stack(None, settings)
        forwarder = app
        while not isinstance(forwarder, Forwarder):
            forwarder = forwarder.app
        async with LifespanManager(Drain(app)) as manager:
            events = [getattr(r, "event", None) for r in caplog.records]
            assert events.count("tierchain.started") == 1
            transport = httpx.ASGITransport(app=manager.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                response = await client.post(
                    "/v1/chat/completions", content=chat_request(stream=False)
                )
            assert response.status_code == 200
            assert forwarder._client is not None
        assert forwarder._client is None
        async with asyncio.timeout(1):
            await tower.connection_closed.wait()


async def test_a_port_already_taken_is_one_clear_error_and_no_started_line(tmp_path):
    env = {
        "TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, "http://127.0.0.1:9"),
        "TIERCHAIN_LOG_FORMAT": "json",
    }
    with socket.socket() as taken:  # a real socket, listening, held by the test
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        async with tierchain_serve(env, "--port", port) as served:  # the last --port wins
            status = await served.exit_status(START_TIMEOUT)
    assert status == 1, "\n".join(served.lines)
    (line,) = served.lines  # nothing else: no identity line for a gateway that never ran
    event = json.loads(line)
    assert (event["event"], event["level"]) == ("serve.bind_failed", "ERROR")
    assert event["address"] == f"127.0.0.1:{port}"
    assert "address already in use" in event["error"].lower()


async def test_the_identity_line_comes_once_the_socket_is_bound(tmp_path):
    env = {
        "TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, "http://127.0.0.1:9"),
        "TIERCHAIN_LOG_FORMAT": "json",
    }
    async with tierchain_serve(env) as served:
        listening = await served.event("serve.listening", within=START_TIMEOUT)
        names = [e.get("event") for e in served.events() if e.get("logger") == "tierchain"]
        (address,) = listening["addresses"]
        host, port = address.rsplit(":", 1)
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=5) as client:
            health = await client.get("/healthz")
        served.proc.send_signal(signal.SIGTERM)
        assert await served.exit_status(10.0) == 0
    assert names[:2] == ["tierchain.started", "serve.listening"]
    assert health.status_code == 200


async def test_serve_logs_the_configuration_warnings_check_config_prints(tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text('[[routes.echo.backends]]\nname = "proxy"\nurl = "http://127.0.0.1:9/v1"\n')
    env = {"TIERCHAIN_ROUTES_FILE": str(path), "TIERCHAIN_LOG_FORMAT": "json"}
    async with tierchain_serve(env) as served:
        warning = await served.event("serve.config_warning", within=START_TIMEOUT)
        await served.event("serve.listening", within=START_TIMEOUT)
        served.proc.send_signal(signal.SIGTERM)
        assert await served.exit_status(10.0) == 0
    assert warning["level"] == "WARNING"
    assert "routes.echo.backends[0].url='http://127.0.0.1:9/v1'" in warning["warning"]


async def test_the_documented_gunicorn_config_shows_each_workers_identity_line(tmp_path):
    clean = plain_uvicorn_setup(tmp_path, gunicorn=True)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        "gunicorn.conf.py",
        "-b",
        "127.0.0.1:0",
        "-w",
        "2",
        "gateway:app()",
        cwd=tmp_path,
        env=clean,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    served = Served(proc)
    try:
        await served.until(lambda: len(started_lines(served)) == 2, START_TIMEOUT)
    finally:
        proc.send_signal(signal.SIGTERM)
        await served.exit_status(10.0)
    pids = {event["pid"] for event in started_lines(served)}
    assert len(pids) == 2  # one line per worker process


def started_lines(served: Served) -> list[dict[str, Any]]:
    return [e for e in served.events() if e.get("event") == "tierchain.started"]


async def test_serve_carries_ollamas_api_beside_v1(tmp_path):
    import ollama

    # Ollama's non-streaming /api/chat answer as its docs/api.md shows it, served as
    # application/json; charset=utf-8 like its Go server.
    answer = (
        b'{"model":"echo","created_at":"2023-12-12T14:13:43.416799Z","message":'
        b'{"role":"assistant","content":"hi from the tower"},"done_reason":"stop","done":true}'
    )

    async def tower_answers(ex: Exchange) -> None:
        await ex.respond(200, answer, {"content-type": "application/json; charset=utf-8"})

    async with FakeBackend("tower", tower_answers) as tower:
        env = {
            "TIERCHAIN_ROUTES_FILE": routes_file(tmp_path, tower.url),
            "TIERCHAIN_LOG_FORMAT": "json",
        }
        async with tierchain_serve(env) as served:
            listening = await served.event("serve.listening", within=START_TIMEOUT)
            client = ollama.AsyncClient(host="http://" + listening["addresses"][0])
            try:
                tags = await client.list()
                chat = await client.chat(
                    model="echo", messages=[{"role": "user", "content": "hi"}], stream=False
                )
            finally:
                await client.close()
            served.proc.send_signal(signal.SIGTERM)
            assert await served.exit_status(10.0) == 0
    assert [m.model for m in tags.models] == ["echo"]
    assert chat.message.content == "hi from the tower"
    assert [(r.method, r.path) for r in tower.requests] == [("POST", "/api/chat")]
