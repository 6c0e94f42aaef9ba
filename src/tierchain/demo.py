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
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ._types import Receive, Scope, Send
from .backend import Backend, Routes
from .failover import Failover
from .forwarder import Forwarder

__all__ = ["main", "run_demo"]


# -- a fake OpenAI-compatible upstream -------------------------------------------


@dataclass
class FakeUpstream:
    """A fake LLM server. ``mode``: ``ok``, ``quiet`` (accepts, never answers), ``error``."""

    name: str
    mode: str = "ok"
    words: tuple[str, ...] = ("Hello", " from", " the", " {name}", " tier.")
    delay: float = 0.02
    requests: int = 0
    _release: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.requests += 1
        if self.mode == "error":
            body = b'{"error":{"message":"internal error","type":"server_error"}}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
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
            await self._release.wait()
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
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

        sock = socket.socket()
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


def build_gateway(routes: Routes, forwarder: Forwarder, *, fast: bool) -> Any:
    """The tierchain stack in the brief's order, around the Forwarder."""
    return Failover(forwarder, routes=routes)


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


async def ask(client: httpx.AsyncClient, url: str, prompt: str) -> Outcome:
    """Send one streaming chat request; collect heartbeats and content as they arrive."""
    body = {"model": "echo", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    t0 = time.monotonic()
    heartbeats: list[dict[str, Any]] = []
    text: list[str] = []
    error = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            raw = await response.aread()
            error = raw.decode(errors="replace")
        else:
            async for line in response.aiter_lines():
                if line.startswith(":"):
                    with contextlib.suppress(ValueError):
                        heartbeats.append(json.loads(line[1:]))
                elif line.startswith("data:"):
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        continue
                    data = json.loads(payload)
                    if "error" in data:
                        error = data["error"].get("message")
                    else:
                        for choice in data.get("choices", []):
                            text.append(choice.get("delta", {}).get("content") or "")
        trail = response.headers.get("x-tierchain-attempts", "")
        return Outcome(
            response.status_code, trail, "".join(text), heartbeats, time.monotonic() - t0, error
        )


def describe(n: int, title: str, outcome: Outcome, color: bool) -> str:
    def c(code: str, s: str) -> str:
        return f"{code}{s}{RESET}" if color else s

    lines = [c(BOLD, f"request {n}: {title}")]
    for beat in outcome.heartbeats:
        fields = ", ".join(f"{k}={v}" for k, v in beat.items() if k != "state")
        lines.append(c(DIM, f"    : {beat.get('state')}  {fields}"))
    if outcome.trail:
        tried = []
        for part in outcome.trail.split(", "):
            name, _, result = part.partition(";outcome=")
            mark = c(GREEN, "ok") if result == "ok" else c(RED, result)
            tried.append(f"{name} ({mark})")
        lines.append("    tiers tried: " + " -> ".join(tried))
    if outcome.error:
        lines.append("    " + c(RED, f"error {outcome.status}: {outcome.error}"))
    else:
        lines.append("    answer: " + c(GREEN, repr(outcome.text)))
    lines.append(f"    took {outcome.seconds * 1000:.0f} ms")
    return "\n".join(lines)


# -- the story --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _world(fast: bool) -> AsyncIterator[tuple[FakeUpstream, _Server, str]]:
    tower = FakeUpstream("tower", delay=0.005 if fast else 0.03)
    hosted = FakeUpstream("hosted", delay=0.005 if fast else 0.03)
    tower_server, hosted_server = _Server(tower), _Server(hosted)
    await tower_server.start()
    await hosted_server.start()
    routes = Routes(
        {
            "echo": [
                Backend(name="tower", url=tower_server.url, regime="local"),
                Backend(name="hosted", url=hosted_server.url, regime="hosted"),
            ]
        }
    )
    forwarder = Forwarder(connect_timeout=2.0)
    gateway = _Server(build_gateway(routes, forwarder, fast=fast))
    await gateway.start()
    try:
        yield tower, tower_server, gateway.url
    finally:
        tower.release()
        await gateway.stop()
        await forwarder.aclose()
        await tower_server.stop()
        await hosted_server.stop()


async def run_demo(
    *, fast: bool = False, color: bool | None = None, out: Callable[[str], None] = print
) -> list[Outcome]:
    """Run the story; return each request's outcome (the tests read them)."""
    if color is None:
        color = sys.stdout.isatty()
    outcomes: list[Outcome] = []
    async with _world(fast) as (tower, tower_server, url), httpx.AsyncClient(timeout=30) as client:
        n = 0

        async def step(title: str) -> Outcome:
            nonlocal n
            n += 1
            outcome = await ask(client, url, f"turn {n}")
            outcomes.append(outcome)
            out(describe(n, title, outcome, color))
            return outcome

        out(f"gateway on {url}; routes: echo -> tower (local), hosted (hosted)\n")
        await step("the tower is healthy")
        await tower_server.stop()
        await step("the tower is down: the connection is refused, the hosted tier answers")
        tower.mode = "error"
        await tower_server.start()
        await step("the tower is back but answers 500: fail over before a byte was sent")
        tower.mode = "ok"
        await step("the tower recovered")
    return outcomes


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
