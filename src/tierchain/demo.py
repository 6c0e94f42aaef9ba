"""The demo the README runs: two fake upstreams, a gateway, a client, one story.

It starts, all on loopback, a local ``tower`` and a ``hosted`` tier (fake
OpenAI-compatible servers), the tierchain gateway in front of them, and a
client that sends streaming chat requests while the tower misbehaves. For each
request it prints which tiers were tried, what the caller was told while it
waited, and what answered. It exits by itself.

Needs the ``dev`` extra (uvicorn). ``python -m tierchain demo [--fast]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from . import _json
from ._runtime import clock
from ._types import Receive, Scope, Send
from .backend import Backend, Routes
from .breaker import Breaker
from .budget import Budget
from .failover import Failover
from .forwarder import Forwarder
from .heartbeats import Heartbeats
from .prefer import PreferBackend
from .store import MemoryStore
from .watchdog import SaturationWatchdog

__all__ = ["main", "run_demo"]


# -- a fake OpenAI-compatible upstream -------------------------------------------


async def _answer(send: Send, status: int, content_type: bytes, body: bytes) -> None:
    """A whole response in two writes."""
    headers = [(b"content-type", content_type)]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class FakeUpstream:
    """A fake LLM server. ``mode``: ``ok``, ``quiet`` (accepts, never answers), ``error``.

    ``GET /metrics`` answers in vLLM's shape: ``running`` are requests being
    answered, ``waiting`` the quiet ones (queued behind the other workload).
    """

    name: str
    mode: str = "ok"
    words: tuple[str, ...] = ("Hello", " from", " the", " {name}", " tier.")
    delay: float = 0.02
    requests: int = 0
    running: int = 0
    waiting: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    _release: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["method"] == "GET" and scope["path"] == "/metrics":
            body = (
                f'vllm:num_requests_running{{model_name="{self.name}"}} {self.running}\n'
                f'vllm:num_requests_waiting{{model_name="{self.name}"}} {self.waiting}\n'
            ).encode()
            await _answer(send, 200, b"text/plain; version=0.0.4", body)
            return
        self.requests += 1
        self.arrived.set()
        if self.mode == "error":
            body = b'{"error":{"message":"internal error","type":"server_error"}}'
            await _answer(send, 500, b"application/json", body)
            return
        if self.mode == "quiet":
            # Accept the work and go quiet, like a GPU taken by another workload.
            # Real servers answer 200 at once and ping while the request sits queued.
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            await send({"type": "http.response.body", "body": b": ping\n\n", "more_body": True})
            self.waiting += 1
            try:
                await self._release.wait()
            finally:
                self.waiting -= 1
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        self.running += 1
        try:
            await self._generate(send)
        finally:
            self.running -= 1

    async def _generate(self, send: Send) -> None:
        for word in self.words:
            await asyncio.sleep(self.delay)
            chunk = {
                "id": "chatcmpl-demo",
                "object": "chat.completion.chunk",
                "model": self.name,
                "choices": [{"index": 0, "delta": {"content": word.format(name=self.name)}}],
            }
            event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def release(self) -> None:
        """Let every quiet request end (as if the GPU came back)."""
        self._release.set()
        self._release = asyncio.Event()


class _Server:
    """A uvicorn server on a fixed loopback port that can be stopped and restarted."""

    def __init__(self, app: Any, port: int = 0) -> None:
        self.app = app
        self.port = port or _free_port()
        self._task: asyncio.Task[None] | None = None
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        config = uvicorn.Config(
            self.app, log_level="error", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._sock = sock
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        self._server.force_exit = True
        await self._task
        self._sock.close()
        self._task = None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- the gateway ------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """The demo's clock: real defaults are minutes; the story needs seconds."""

    slow_after: float
    saturation_cooldown: float
    heartbeat_interval: float
    commit_after: float
    budget: float


NORMAL = Timing(
    slow_after=1.0, saturation_cooldown=60.0, heartbeat_interval=0.3, commit_after=0.2, budget=20.0
)
FAST = Timing(
    slow_after=0.25,
    saturation_cooldown=60.0,
    heartbeat_interval=0.1,
    commit_after=0.05,
    budget=10.0,
)


async def _aclose_all(app: Any) -> None:
    """Close what the stack's layers own (status pollers, lease renewal)."""
    while app is not None:
        if isinstance(app, SaturationWatchdog):
            await app.aclose()
        elif isinstance(app, Failover):
            await app.admission.aclose()
        app = getattr(app, "app", None)


def build_gateway(routes: Routes, forwarder: Forwarder, timing: Timing) -> Any:
    """The whole tierchain stack in its fixed order, around the Forwarder."""
    store = MemoryStore()
    # A status answer late by a second (not the default quarter) before it counts as a
    # starved tower: the demo's fake tower shares one busy machine with everything else.
    # The story is the Breaker's (two saturations open it): no suspect mark spares the
    # second caller here (docs/watchdog.md, "One verdict spares the next caller").
    app: Any = SaturationWatchdog(
        forwarder, slow_after=timing.slow_after, status_late=1.0, suspect_for=0
    )
    app = Breaker(app, store=store, saturation_cooldown=timing.saturation_cooldown)
    app = Failover(app, routes=routes)
    app = PreferBackend(app, store=store)
    app = Budget(app, default=timing.budget)
    return Heartbeats(app, interval=timing.heartbeat_interval, commit_after=timing.commit_after)


# -- the client -------------------------------------------------------------------

DIM, BOLD, GREEN, RED, YELLOW, RESET = (
    "\033[2m",
    "\033[1m",
    "\033[32m",
    "\033[31m",
    "\033[33m",
    "\033[0m",
)


@dataclass
class Outcome:
    status: int
    trail: str
    text: str
    heartbeats: list[dict[str, Any]]
    seconds: float
    error: str | None = None


async def ask(
    client: httpx.AsyncClient, url: str, prompt: str, headers: dict[str, str] | None = None
) -> Outcome:
    """Send one streaming chat request; collect heartbeats and content as they arrive."""
    body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    t0 = clock.now()
    heartbeats: list[dict[str, Any]] = []
    text: list[str] = []
    error = None
    async with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            raw = await response.aread()
            error = raw.decode(errors="replace")
        else:
            async for line in response.aiter_lines():
                if line.startswith(":"):
                    with contextlib.suppress(ValueError):
                        heartbeats.append(_json.loads(line[1:]))
                elif line.startswith("data:"):
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        continue
                    data = _json.loads(payload)
                    if "error" in data:
                        error = data["error"].get("message")
                        heartbeats.append({"state": "error event", **data["error"]})
                    else:
                        for choice in data.get("choices", []):
                            text.append(choice.get("delta", {}).get("content") or "")
        trail = response.headers.get("x-tierchain-attempts", "")
        return Outcome(
            response.status_code, trail, "".join(text), heartbeats, clock.now() - t0, error
        )


def trail_of(outcome: Outcome) -> list[tuple[str, str]]:
    """(backend, outcome) per attempt: from the trail header, else from the heartbeats.

    The header is lost when Heartbeats had to commit the response before the
    answer came (it had to start the stream to say anything); the state lines
    carry the same story.
    """
    if outcome.trail:
        return [
            (name, result)
            for name, _, result in (p.partition(";outcome=") for p in outcome.trail.split(", "))
        ]
    trail: list[tuple[str, str]] = []
    ends = {
        "backend_failed": None,
        "backend_saturated": "saturated",
        "backend_skipped": "skipped",
        "backend_busy": "busy",
    }
    previous: dict[str, Any] | None = None
    for beat in outcome.heartbeats:
        if beat == previous:
            continue  # a keepalive repeats the current state line
        previous = beat
        state = beat.get("state")
        if state in ends:
            trail.append((str(beat.get("backend")), ends[state] or str(beat.get("reason"))))
        elif state == "generating" and trail[-1:] != [(str(beat.get("backend")), "ok")]:
            trail.append((str(beat.get("backend")), "ok"))  # keepalives repeat it
    return trail


def describe(n: int, title: str, outcome: Outcome, color: bool) -> str:
    def c(code: str, s: str) -> str:
        return f"{code}{s}{RESET}" if color else s

    lines: list[str] = []
    previous = None
    for beat in outcome.heartbeats:
        if beat == previous:
            lines[-1] = lines[-1].rstrip(")").rstrip() + " +keepalive)"
            if "(" not in lines[-1]:
                lines[-1] = lines[-1].replace(" +keepalive)", "  (+keepalive)")
            continue
        previous = beat
        fields = ", ".join(f"{k}={v}" for k, v in beat.items() if k != "state")
        lines.append(c(DIM, f"    : {beat.get('state')}  {fields}"))
    tried = []
    for name, result in trail_of(outcome):
        mark = c(GREEN, "ok") if result == "ok" else c(RED, result)
        tried.append(f"{name} ({mark})")
    if tried:
        lines.append("    tiers tried: " + " -> ".join(tried))
    if outcome.error:
        lines.append("    " + c(RED, f"error {outcome.status}: {outcome.error}"))
    else:
        lines.append("    answer: " + c(GREEN, repr(outcome.text)))
    lines.append(f"    took {outcome.seconds * 1000:.0f} ms")
    return "\n".join(lines)


# -- the story --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _world(timing: Timing, fast: bool) -> AsyncIterator[tuple[FakeUpstream, _Server, str]]:
    tower = FakeUpstream("tower", delay=0.005 if fast else 0.03)
    hosted = FakeUpstream("hosted", delay=0.005 if fast else 0.03)
    tower_server, hosted_server = _Server(tower), _Server(hosted)
    await tower_server.start()
    await hosted_server.start()
    routes = Routes(
        {
            "echo": [
                Backend(
                    name="tower",
                    url=tower_server.url,
                    regime="local",
                    status_url=tower_server.url + "/metrics",
                    max_in_flight=1,
                ),
                Backend(name="hosted", url=hosted_server.url, regime="hosted"),
            ]
        }
    )
    forwarder = Forwarder(connect_timeout=2.0)
    stack = build_gateway(routes, forwarder, timing)
    gateway = _Server(stack)
    await gateway.start()
    try:
        yield tower, tower_server, gateway.url
    finally:
        tower.release()
        await gateway.stop()
        await _aclose_all(stack)
        await forwarder.aclose()
        await tower_server.stop()
        await hosted_server.stop()


async def run_demo(
    *, fast: bool = False, color: bool | None = None, out: Callable[[str], None] = print
) -> list[Outcome]:
    """Run the story; return each request's outcome (the tests read them)."""
    if color is None:
        color = sys.stdout.isatty()
    timing = FAST if fast else NORMAL
    outcomes: list[Outcome] = []
    # Show tierchain's own warnings (saturations, breaker transitions) in the story.
    handler = _OutHandler(out, color)
    logger = logging.getLogger("tierchain")
    level = logger.level
    logger.setLevel(logging.INFO)  # breaker transitions (half-open, closed) are INFO
    logger.addHandler(handler)
    try:
        await _story(timing, fast, color, out, outcomes)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return outcomes


# A log line's own words, said plainly the first time each appears in the story.
_STATUS_SAID = {
    "queued": "its status says requests are waiting in its queue, so ours is one of them "
    "(the counters that move are someone else's)",
    "working": "its status says it is working on our request",
    "no_progress": "its status says it is busy, but nothing has moved for a while",
    "idle": "its status says it is doing nothing, so nobody is working on our request",
    "too_slow": "its status says it is working, but far too slowly to answer in the time left",
    "unknown": "its status could not be read",
}


def _explained(fields: dict[str, Any], said: set[str]) -> list[str]:
    """Plain words for the fields of a log line that a reader would not know."""
    lines: list[str] = []
    verdict = fields.get("verdict")
    if isinstance(verdict, str) and f"verdict={verdict}" not in said:
        said.add(f"verdict={verdict}")
        plain = _STATUS_SAID.get(verdict, "what the backend's status said")
        lines.append(
            f'verdict="{verdict}": before giving up on the tower, the gateway asked its status '
            f"URL: {plain}"
        )
    if fields.get("reserve_s") is not None and "reserve_s" not in said:
        said.add("reserve_s")
        lines.append(
            f"reserve_s={fields['reserve_s']}: the seconds of the request's budget kept back "
            "for the later tiers (hosted), so the tower was given up in time for them"
        )
    return lines


class _OutHandler(logging.Handler):
    def __init__(self, out: Callable[[str], None], color: bool) -> None:
        super().__init__(logging.INFO)
        self.out, self.color = out, color
        self.said: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "event", "")
        if record.levelno < logging.WARNING and not event.startswith("breaker."):
            return
        text = f"    log: {record.getMessage()}"
        self.out(f"{DIM}{text}{RESET}" if self.color else text)
        for line in _explained(getattr(record, "tierchain", {}), self.said):
            note = f"         ({line})"
            self.out(f"{DIM}{note}{RESET}" if self.color else note)


async def _story(
    timing: Timing,
    fast: bool,
    color: bool,
    out: Callable[[str], None],
    outcomes: list[Outcome],
) -> None:
    async with (
        _world(timing, fast) as (tower, tower_server, url),
        httpx.AsyncClient(timeout=30) as client,
    ):
        n = 0

        async def step(title: str, headers: dict[str, str] | None = None) -> Outcome:
            nonlocal n
            n += 1
            out(f"{BOLD}request {n}: {title}{RESET}" if color else f"request {n}: {title}")
            outcome = await ask(client, url, f"turn {n}", headers)
            outcomes.append(outcome)
            out(describe(n, title, outcome, color) + "\n")
            return outcome

        out(
            f"gateway on {url}; route echo -> tower (local), hosted (hosted)\n"
            f"stack: Heartbeats > Budget > PreferBackend > Failover > Breaker > "
            f"SaturationWatchdog(slow_after={timing.slow_after}s) > Forwarder\n"
            f"tower: max_in_flight=1, status_url=/metrics (vLLM shape), polled while traffic "
            f"flows\n"
        )
        await step("the tower is healthy")
        await tower_server.stop()
        await step("the tower is down: refused in milliseconds, the hosted tier answers")
        tower.mode = "error"
        await tower_server.start()
        await step("the tower answers 500: one more try, then failover before a byte was sent")
        tower.mode = "ok"
        await step("the tower recovered")
        await step(
            "the caller prefers the hosted tier (X-Prefer-Backend: hosted)",
            {"X-Prefer-Backend": "hosted"},
        )
        tower.mode = "quiet"
        await step(
            f"a game takes the GPU: the tower accepts and goes quiet; "
            f"after {timing.slow_after}s it counts as saturated"
        )
        await step("still quiet: the second saturation opens the tower's breaker")
        await step("the breaker is open: the tower is skipped without a wait")
        tower.mode = "ok"
        tower.release()
        await asyncio.sleep(0.3)  # a few status polls see the tower idle
        await step(
            f"the game ended: the tower's status says idle, so the breaker half-opens now "
            f"(not after its {timing.saturation_cooldown:.0f}s cooldown) and one probe goes"
        )
        tower.words = ("A", " long", " answer", " from", " the", " {name}", " tier.")
        tower.delay = 0.1 if fast else 0.3
        tower.arrived.clear()
        first = asyncio.create_task(ask(client, url, "a long one"))
        await asyncio.wait_for(tower.arrived.wait(), 5)
        await step(
            "a long answer is streaming from the tower (max_in_flight=1): the next caller "
            "skips it at once as busy"
        )
        outcomes.append(await first)
        out("    (the long answer: " + repr(outcomes[-1].text) + ", from the tower)\n")


def main(argv: list[str] | None = None) -> int:
    """``tierchain demo``: run the story and exit."""
    parser = argparse.ArgumentParser(prog="tierchain demo", description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="shorter waits (used by the tests)")
    parser.add_argument("--no-color", action="store_true", help="plain output")
    args = parser.parse_args(argv)
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("the demo needs uvicorn: pip install 'tierchain[dev]'", file=sys.stderr)
        return 2
    asyncio.run(run_demo(fast=args.fast, color=False if args.no_color else None))
    return 0
