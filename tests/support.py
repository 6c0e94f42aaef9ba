"""Test harness: real uvicorn servers on loopback and scripted fake LLM backends.

The fake backends speak HTTP/1.1 on a real socket and behave like real
OpenAI-compatible servers: chunked SSE with ``data:`` events, ``: ping``
comments while queued, events cut at awkward bytes, silence, resets. Time is
controlled with events, not sleeps: a script waits on ``asyncio.Event``s that
the test sets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import select
import socket
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Failover,
    Heartbeats,
    PreferBackend,
    Routes,
    SaturationWatchdog,
    current_attempt,
)
from tierchain.errors import BackendSaturated, BackendUnavailable
from tierchain.request import Attempt, TierRequest
from tierchain.testing import VirtualClock, virtual_time


class Recorder:
    """An app in front of ``inner`` that keeps, for each HTTP request, its
    TierRequest, the attempts its chain made and every state event it emitted."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.requests: list[TierRequest] = []
        self.attempts: list[list[Attempt]] = []
        self.events: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            req = TierRequest.of(scope)
            self.requests.append(req)
            mine: list[Attempt] = []
            self.attempts.append(mine)

            def note(event: dict[str, Any]) -> None:
                self.events.append(event)
                if event["state"] == "attempt" and req.attempt is not None:
                    mine.append(req.attempt)

            req.subscribe(note)
        await self.inner(scope, receive, send)


class RecordedGateway:
    """What a test's own gateway class shares: its stack behind a :class:`Recorder`
    (``requests``, ``attempts``, ``events``), and ``aclose`` for its forwarder and watchdog.
    A subclass builds ``forwarder``, ``watchdog`` and the stack, then calls ``_record``."""

    forwarder: Any
    watchdog: Any

    def _record(self, inner: Any) -> None:
        self.app = recorder = Recorder(inner)
        self.requests = recorder.requests
        self.attempts = recorder.attempts
        self.events = recorder.events

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()

    def states(self, name: str) -> list[dict[str, Any]]:
        """The state events named ``name``, every request's, in order."""
        return [e for e in self.events if e["state"] == name]


RULES_TIMEOUT = 30.0
"""Seconds: the timeout of a RedisStore whose rules are tested, not its outages."""


class RedisRelay:
    """A loopback TCP relay to redis-server under which Redis answers at once on virtual time.

    redis-server is another process, and a virtual clock cannot wait for one: an idle loop
    jumps to its next timer after a few real milliseconds, so a busy machine's slow reply
    would reach the store after its timeout. The relay forwards each command, then blocks
    the loop until Redis's reply is readable (``RULES_TIMEOUT`` of real time at most): while
    the loop is blocked no timer fires and the virtual clock stands still, however long Redis
    takes. A reply is late only when a test says so: after ``hold_next()`` the reply to the
    next command is kept back (``held`` is set once Redis has run it and answered) until
    ``release()``, so the store waits for it on the virtual clock.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.held = asyncio.Event()
        self._released = asyncio.Event()
        self._hold_armed = False
        self._writers: list[asyncio.StreamWriter] = []
        self._pumps: set[asyncio.Task[None]] = set()

    def hold_next(self) -> None:
        self._hold_armed = True

    def release(self) -> None:
        self._released.set()

    async def __aenter__(self) -> RedisRelay:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()
        self.server.close()
        for writer in self._writers:
            writer.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await self.server.wait_closed()

    async def _commands(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, hold: list[bool]
    ) -> None:
        upstream = dst.get_extra_info("socket")
        try:
            while data := await src.read(65536):
                if self._hold_armed:
                    self._hold_armed, hold[0] = False, True
                dst.write(data)
                # Blocks the loop (and so the virtual clock) until Redis has answered.
                select.select([upstream.fileno()], [], [], RULES_TIMEOUT)
        finally:
            dst.close()

    async def _replies(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, hold: list[bool]
    ) -> None:
        try:
            while data := await src.read(65536):
                if hold[0]:
                    hold[0] = False
                    self.held.set()
                    await self._released.wait()
                dst.write(data)
        finally:
            dst.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]
        hold = [False]  # this connection's next reply is kept back
        pumps = [
            asyncio.ensure_future(self._commands(reader, up_writer, hold)),
            asyncio.ensure_future(self._replies(up_reader, writer, hold)),
        ]
        self._pumps.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._pumps.difference_update(pumps)


@contextlib.asynccontextmanager
async def redis_on_virtual_time(server: Any) -> AsyncIterator[Any]:
    """A RedisStore on the package's virtual clock, reaching ``server`` (the ``redis_server``
    fixture) through a :class:`RedisRelay`, so that no Redis reply, however late on a busy
    machine, lets the clock jump (with a few milliseconds' grace it did: a breaker's probe
    came a whole request late under ``stress-ng``). Closed on the way out."""
    from tierchain import RedisStore
    from tierchain._runtime import clock

    async with RedisRelay(server.port) as relay:
        store = RedisStore(relay.url, clock=clock.now, timeout=RULES_TIMEOUT)
        try:
            yield store
        finally:
            await store.aclose()


# -- virtual time -----------------------------------------------------------------


def on_virtual_time(test: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """Run an async test on a virtual clock (:func:`tierchain.testing.virtual_time`).

    The test's event loop and every tierchain layer read the same clock, which moves
    only while every coroutine waits: windows, gaps and budgets are exact however busy
    the machine is. Real sockets on loopback work as usual. Measure durations with
    ``asyncio.get_running_loop().time()``. For tests whose fixtures are not async.
    """

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        with virtual_time() as clock, asyncio.Runner(loop_factory=clock.new_event_loop) as runner:
            return runner.run(test(*args, **kwargs))

    return run


def now() -> float:
    """The running loop's clock (virtual in an :func:`on_virtual_time` test)."""
    return asyncio.get_running_loop().time()


def busy_for(seconds: float) -> None:
    """In an :func:`on_virtual_time` test: the loop is blocked this long (no timer can fire)."""
    from tierchain._runtime import clock

    virtual = clock.virtual()
    assert isinstance(virtual, VirtualClock), "busy_for is for on_virtual_time tests"
    virtual.advance(seconds)


async def until(check: Callable[[], Awaitable[bool]], what: str, limit: float = 30.0) -> None:
    """Wait (polling) until ``check()`` is true; fail after ``limit`` seconds: for what another
    process sees when it gets to it (a closed socket in ``redis-server``'s client list)."""
    give_up = now() + limit
    while not await check():
        if now() > give_up:
            raise AssertionError(f"still not {what} after {limit}s")
        await asyncio.sleep(0.02)


def load_script(path: Any, name: str) -> Any:
    """A script that is not a package module (``dev.py``, a ``bench/`` script, a docs
    extension) loaded as module ``name`` (also put in ``sys.modules``, which dataclasses in
    it need)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


async def fresh_post(url: str, **kwargs: Any) -> httpx.Response:
    """POST on a connection of its own, for a request whose duration is asserted on the
    virtual clock: no state of an earlier request's connection (a keep-alive close racing
    the next request) can add to it."""
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(url, **kwargs)


# -- a real uvicorn server -----------------------------------------------------


class PromptServer(uvicorn.Server):
    """uvicorn's Server, stopped the moment a test is done with it.

    uvicorn 0.55 looks at ``should_exit`` every 0.1 s (``Server.main_loop``), then sleeps
    0.1 s in ``Server.shutdown`` and looks at its connections and tasks every 0.1 s more:
    about 0.2 s of real waiting at the end of every test that runs a server, which was
    most of the suite's time. This overrides those two methods (public, undocumented;
    tests/test_dependency_internals.py holds them to it; docs/internals.md lists it with the
    other private parts): ``stop`` wakes the loop at once,
    and the shutdown waits for the same connections and tasks, in 2 ms steps, with
    uvicorn's own graceful timeout.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.told = asyncio.Event()

    def stop(self) -> None:
        self.should_exit = True
        self.told.set()

    async def main_loop(self) -> None:
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.told.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        loop = asyncio.get_running_loop()
        grace = self.config.timeout_graceful_shutdown
        give_up = loop.time() + (float("inf") if grace is None else grace)
        state = self.server_state
        while (state.connections or state.tasks) and not self.force_exit:
            if loop.time() >= give_up:
                for task in state.tasks:
                    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
                break
            await asyncio.sleep(0.002)
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()


@contextlib.asynccontextmanager
async def serve(app: Any, *, lifespan: str = "off", http: Any = "h11") -> AsyncIterator[str]:
    """Run ``app`` on uvicorn on 127.0.0.1 (a free port); yield its base URL.

    ``http`` is uvicorn's HTTP protocol: ``h11`` unless a test asks for
    ``httptools`` (uvicorn's ``auto`` picks httptools whenever it is installed).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan=lifespan,
        http=http,
        log_level="warning",
        timeout_graceful_shutdown=2,
        access_log=False,
    )
    server = PromptServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.005)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        await task
        sock.close()


# -- OpenAI-compatible stream builders -----------------------------------------


def chunk_event(content: str, *, model: str = "m", idx: int = 0, id: str = "chatcmpl-1") -> bytes:
    """One OpenAI ``chat.completion.chunk`` SSE event."""
    payload = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": idx, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def openai_stream(pieces: Iterable[str], *, model: str = "m") -> list[bytes]:
    """The events of a whole streamed completion, ``[DONE]`` included."""
    events = [chunk_event(p, model=model) for p in pieces]
    done = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    events.append(b"data: " + json.dumps(done).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def completion_body(text: str, *, model: str = "m") -> bytes:
    """A non-streaming ``chat.completion`` JSON body."""
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1700000000,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()


def chat_request(model: str = "echo", *, stream: bool = True, content: str = "hi") -> bytes:
    return json.dumps(
        {"model": model, "stream": stream, "messages": [{"role": "user", "content": content}]}
    ).encode()


# -- the fake backend ------------------------------------------------------------


@dataclass
class Received:
    """One request as the fake backend received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    head: bytes = b""  # the request head as it came, every header line (repeats too)


class Exchange:
    """One request/response on a fake backend connection, for a script to drive."""

    def __init__(
        self, request: Received, writer: asyncio.StreamWriter, reader: asyncio.StreamReader
    ) -> None:
        self.request = request
        self._writer = writer
        self._reader = reader
        self.chunked = False
        self.finished = False

    async def head(
        self, status: int = 200, headers: dict[str, str] | None = None, *, sse: bool = True
    ) -> None:
        """Send the status line and headers; the body follows chunked."""
        lines = [f"HTTP/1.1 {status} X"]
        hdrs = {"content-type": "text/event-stream" if sse else "application/json"}
        hdrs.update(headers or {})
        hdrs["transfer-encoding"] = "chunked"
        lines += [f"{k}: {v}" for k, v in hdrs.items()]
        self._writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.chunked = True
        await self._writer.drain()

    async def write(self, data: bytes) -> None:
        """Send ``data`` as one chunk of the body (as its own TCP write)."""
        if data:
            self._writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await self._writer.drain()

    async def end(self) -> None:
        """Finish the body."""
        self._writer.write(b"0\r\n\r\n")
        await self._writer.drain()
        self.finished = True

    async def respond(
        self, status: int, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        """A whole response with content-length."""
        hdrs = {"content-type": "application/json", "content-length": str(len(body))}
        hdrs.update(headers or {})
        head = [f"HTTP/1.1 {status} X", *(f"{k}: {v}" for k, v in hdrs.items())]
        self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await self._writer.drain()
        self.finished = True

    async def close(self) -> None:
        """Close the connection cleanly (FIN) without ending the body: no final chunk."""
        await self._writer.drain()
        self._writer.close()
        self.finished = True

    async def trickle(self, data: bytes, *, step: int = 1) -> None:
        """Send ``data`` ``step`` bytes at a time, each as its own chunk and TCP write."""
        for i in range(0, len(data), step):
            await self.write(data[i : i + step])
            await asyncio.sleep(0)

    async def reset(self) -> None:
        """Abort the connection with a TCP reset."""
        sock = self._writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self._writer.transport.abort()
        self.finished = True

    async def wait_closed_by_peer(self) -> None:
        """Wait until the gateway closes this connection (reads until EOF)."""
        with contextlib.suppress(ConnectionError):
            while await self._reader.read(65536):
                pass


Script = Callable[[Exchange], Awaitable[None]]


def streams(pieces: Iterable[str], *, model: str = "m") -> Script:
    """A script answering a normal OpenAI stream."""
    events = openai_stream(list(pieces), model=model)

    async def script(ex: Exchange) -> None:
        await ex.head()
        for event in events:
            await ex.write(event)
        await ex.end()

    return script


def fault(kind: str, pieces: Iterable[str] = ("one", "two", "three"), *, after: int = 2) -> Script:
    """A backend that fails in one of the ways a socket can, after ``after`` events.

    ``kind``: ``reset`` (TCP RST), ``close`` (FIN with no final chunk), ``stall``
    (silence until the gateway hangs up), ``no_done`` (a clean end without
    ``[DONE]`` or a ``finish_reason``), ``garbage`` (an event stream of bytes with
    no event in it), ``comments`` (pings only, then a clean end),
    ``content_length`` (the whole valid stream framed by Content-Length),
    ``trickle`` (the whole valid stream one byte per chunk), ``half_event``
    (``after`` events, half of the next, then a reset).
    """
    events = openai_stream(list(pieces))
    head = b"".join(events[:after])

    async def script(ex: Exchange) -> None:
        if kind == "content_length":
            await ex.respond(200, b"".join(events), {"content-type": "text/event-stream"})
            return
        await ex.head()
        if kind == "trickle":
            await ex.trickle(b"".join(events))
            await ex.end()
            return
        if kind == "garbage":
            await ex.write(b"\x00\x9f<html>not an event stream at all")
            await ex.end()
            return
        if kind == "comments":
            await ex.write(b": ping\n\n: ping\n\n")
            await ex.end()
            return
        await ex.write(head)
        if kind == "reset":
            await ex.reset()
        elif kind == "half_event":
            await ex.write(events[after][:30])
            await ex.reset()
        elif kind == "close":
            await ex.close()
        elif kind == "stall":
            await ex.wait_closed_by_peer()
            ex.finished = True
        elif kind == "no_done":
            await ex.end()
        else:
            raise ValueError(kind)

    return script


def answers(status: int, body: bytes = b'{"error":{"message":"x"}}', **headers: str) -> Script:
    async def script(ex: Exchange) -> None:
        await ex.respond(status, body, headers)

    return script


def once_then(first: Script) -> Script:
    """A backend whose first request gets ``first``; every later one a stream (``again``)."""
    seen = [0]

    async def script(ex: Exchange) -> None:
        seen[0] += 1
        if seen[0] == 1:
            await first(ex)
        else:
            await streams(["again"])(ex)

    return script


class SaturateAfter:
    """Stand-in for SaturationWatchdog: no first chunk within ``window`` -> BackendSaturated."""

    def __init__(self, app: Any, window: float) -> None:
        self.app = app
        self.window = window

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with asyncio.timeout(self.window):
                await self.app(scope, receive, send)
        except TimeoutError:
            raise BackendSaturated("no first chunk", waited=self.window) from None


@dataclass
class FakeBackend:
    """An OpenAI-compatible upstream on a real loopback socket.

    ``script`` decides how each request is answered; swap it at any time.
    ``requests`` records what arrived; ``open_connections`` counts live ones.
    """

    name: str = "tower"
    script: Script = field(default_factory=lambda: streams(["Hel", "lo"]))
    requests: list[Received] = field(default_factory=list)
    open_connections: int = 0
    connection_closed: asyncio.Event = field(default_factory=asyncio.Event)
    _server: asyncio.Server | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    _handlers: set[asyncio.Task[None]] = field(default_factory=set)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeBackend:
        # A head of up to 1 MiB (the default 64 KiB would refuse a request of many headers).
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, limit=2**20)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop listening (later connections are refused) and drop open connections."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        # Let every connection handler see its connection end, so no task is left
        # pending for the event loop to cancel at close.
        handlers = [t for t in self._handlers if t is not asyncio.current_task()]
        if handlers:
            await asyncio.wait(handlers, timeout=1)

    async def __aenter__(self) -> FakeBackend:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        self.open_connections += 1
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0"))
                body = await reader.readexactly(length) if length else b""
                received = Received(method, path, headers, body, head)
                self.requests.append(received)
                ex = Exchange(received, writer, reader)
                try:
                    await self.script(ex)
                except (ConnectionError, asyncio.IncompleteReadError):
                    return
                if not ex.finished or writer.transport.is_closing():
                    return
        finally:
            self._writers.discard(writer)
            self.open_connections -= 1
            self.connection_closed.set()
            writer.transport.abort()


def refused_url() -> str:
    """A loopback URL on which nothing listens: connecting is refused at once."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def parse_sse(raw: bytes) -> list[dict[str, Any]]:
    """Split a raw SSE body into events: {"comments": [...], "data": str|None}."""
    text = raw.decode().replace("\r\n", "\n").replace("\r", "\n")
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        comments = [ln[1:].strip() for ln in block.split("\n") if ln.startswith(":")]
        data = [ln[5:].lstrip() for ln in block.split("\n") if ln.startswith("data:")]
        events.append({"comments": comments, "data": "\n".join(data) if data else None})
    return events


# -- the whole stack in process ------------------------------------------------
# (No sockets: for what the layers themselves keep, on any event loop.)

_ROUTES = Routes(
    {"m": [Backend("tower", "http://127.0.0.1:9"), Backend("hosted", "http://127.0.0.1:9")]}
)
_BODY = b'{"model": "m", "stream": true}'


def whole_stack(app: Any) -> Any:
    """Every layer around ``app`` in the README's order, tower then hosted."""
    app = SaturationWatchdog(app, slow_after=30.0)
    app = Breaker(app, failure_threshold=10**6)
    app = Failover(app, routes=_ROUTES)
    app = PreferBackend(app)
    app = Budget(app, default=60.0)
    return Heartbeats(app, interval=10.0)


def answering(tower: str) -> Any:
    """A backend handler: hosted streams one event and [DONE]; the tower does ``tower``."""

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        if current_attempt(scope).backend.name == "tower":
            if tower == "raises":
                raise BackendUnavailable("connection refused", reason="connect_refused")
            if tower == "503":
                await send({"type": "http.response.start", "status": 503, "headers": []})
                await send({"type": "http.response.body", "body": b'{"error": "busy"}'})
                return
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return handler


def chat_scope() -> dict[str, Any]:
    """An HTTP scope for ``POST /v1/chat/completions`` with a JSON body, as a server sends it."""
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
    }


async def one_request(app: Any, scope: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One streaming chat request through ``app`` in memory (in ``scope``, if given, to
    read the request's state after it); what it sent back."""
    sent: list[dict[str, Any]] = []
    messages = iter([{"type": "http.request", "body": _BODY, "more_body": False}])
    over = asyncio.Event()

    async def receive() -> dict[str, Any]:
        message = next(messages, None)
        if message is None:  # as a server does: nothing more until the caller leaves
            await over.wait()
            return {"type": "http.disconnect"}
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(chat_scope() if scope is None else scope, receive, send)
    over.set()
    await asyncio.sleep(0)  # the loop's turn between requests, as a server gives it
    return sent
