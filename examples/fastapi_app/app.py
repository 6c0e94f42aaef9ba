"""An LLM gateway on FastAPI with the tierchain stack in front of its forwarder.

Run it (two fake upstreams are not included here; point the routes at yours)::

    TOWER_URL=http://127.0.0.1:11434 HOSTED_URL=https://api.example.com \\
        uvicorn --factory examples.fastapi_app.app:from_env

FastAPI runs ``add_middleware`` calls in reverse: the last one added is the
outermost. So the calls below are written innermost first.

``GET /demo/events`` serves a small page whose EventSource streams a completion
through the whole stack (``GET /v1/stream?model=echo&prompt=...``, which
:class:`StreamQuery` turns into the equivalent streaming chat POST).
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from tierchain import (
    Admin,
    Backend,
    Breaker,
    Budget,
    Endpoints,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    PreferBackend,
    RedisStore,
    Routes,
    SaturationWatchdog,
)

DEMO_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>tierchain: a stream in the browser</title>
<style>
body { font: 15px/1.4 system-ui, sans-serif; margin: 2em; max-width: 50em; }
#text { white-space: pre-wrap; border: 1px solid #bbb; padding: .5em; min-height: 2em; }
#events li { font-family: monospace; font-size: 12px; word-break: break-all; }
</style>
</head>
<body>
<h1>tierchain stream</h1>
<p>Status: <span id="status">connecting</span></p>
<p id="text"></p>
<p>Data events, exactly as received (heartbeat comments never reach <code>onmessage</code>):</p>
<ol id="events"></ol>
<script>
const query = new URLSearchParams(location.search);
const params = new URLSearchParams({
  model: query.get("model") || "echo",
  prompt: query.get("prompt") || "Say hello",
});
const source = new EventSource("/v1/stream?" + params);
const status = document.getElementById("status");
const text = document.getElementById("text");
const events = document.getElementById("events");
function finish(word) { source.close(); status.textContent = word; }
source.onopen = () => { status.textContent = "open"; };
source.onmessage = (e) => {
  const item = document.createElement("li");
  item.textContent = e.data;
  events.append(item);
  if (e.data === "[DONE]") { finish("done"); return; }
  let message = null;
  try { message = JSON.parse(e.data); } catch (err) { return; }
  if (message && message.error) { finish("error: " + message.error.message); return; }
  const delta = message && message.choices && message.choices[0] && message.choices[0].delta;
  if (delta && delta.content) { text.textContent += delta.content; }
};
source.onerror = () => { if (source.readyState !== EventSource.CLOSED) { finish("closed"); } };
</script>
</body>
</html>
"""


class StreamQuery:
    """Turn ``GET <path>?model=...&prompt=...`` into the streaming chat POST it stands for.

    EventSource can only GET; this shim (example code, not library code) lets a
    browser page stream a completion through the same stack as any client.
    """

    def __init__(
        self, app: Any, *, path: str = "/v1/stream", target: str = "/v1/chat/completions"
    ) -> None:
        self.app = app
        self.path = path
        self.target = target

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        body = json.dumps(
            {
                "model": query.get("model", ["echo"])[0],
                "stream": True,
                "messages": [{"role": "user", "content": query.get("prompt", ["hi"])[0]}],
            }
        ).encode()
        headers = [
            (k, v) for k, v in scope["headers"] if k not in (b"content-length", b"content-type")
        ]
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        post = {
            **scope,
            "method": "POST",
            "path": self.target,
            "raw_path": self.target.encode(),
            "query_string": b"",
            "headers": headers,
        }
        replaced = False

        async def replay() -> Any:
            nonlocal replaced
            if replaced:
                return await receive()
            replaced = True
            message = await receive()  # the GET's own empty body, stood in for by ours
            if message["type"] != "http.request":
                return message
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(post, replay, send)


def create_app(
    routes: Routes,
    *,
    connect_timeout: float = 2.0,
    heartbeat_interval: float = 10.0,
    commit_after: float = 1.0,
    slow_after: float = 0.0,
    budget: float | None = None,
    hedge_after: float | None = 5.0,
    store: MemoryStore | RedisStore | None = None,
    admin_token: str | None = None,
) -> FastAPI:
    """Build the gateway: ``/v1/*`` and ``/api/*`` POSTs go down each model's chain.

    The whole tierchain stack, in its fixed order. ``heartbeat_interval`` and
    ``commit_after`` are Heartbeats' options (docs/heartbeats.md), ``slow_after``
    the SaturationWatchdog's window (0: off), ``budget`` Budget's default in
    seconds, ``hedge_after`` Failover's hedging of a quiet local tier (5 s, as
    ``tierchain serve``; None: off). One ``store`` (in memory unless given) holds
    the breakers and the operator pins; with ``admin_token`` the operator page is at
    ``/admin/tierchain``.
    """
    forwarder = Forwarder(connect_timeout=connect_timeout)
    store = store if store is not None else MemoryStore()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with forwarder:  # closes the shared upstream client on shutdown
            yield

    app = FastAPI(title="tierchain example gateway", lifespan=lifespan)

    @app.get("/demo/events", response_class=HTMLResponse)
    async def demo_events() -> str:
        return DEMO_PAGE

    if admin_token is not None:
        app.mount("/admin/tierchain", Admin(routes=routes, store=store, token=admin_token))

    # The forwarding handler: every attempt goes to current_attempt(scope).backend.
    # /v1: OpenAI chat and Responses, Anthropic Messages; /api: Ollama's native API.
    app.mount("/v1", forwarder)
    app.mount("/api", forwarder)

    # Innermost first (FastAPI: the last one added is the outermost).
    app.add_middleware(SaturationWatchdog, slow_after=slow_after)
    app.add_middleware(Breaker, store=store)
    app.add_middleware(Failover, routes=routes, paths=("/v1/", "/api/"), hedge_after=hedge_after)
    app.add_middleware(StreamQuery)  # GET /v1/stream -> streaming POST, for EventSource
    app.add_middleware(PreferBackend, store=store)
    app.add_middleware(Budget, default=budget)
    # Turns the state events of every layer inside into SSE comment lines.
    app.add_middleware(Heartbeats, interval=heartbeat_interval, commit_after=commit_after)
    # Outermost, in front of the router: /v1/models, /healthz, /readyz and /metrics.
    app.add_middleware(Endpoints, routes=routes, store=store)
    return app


def from_env() -> FastAPI:
    """Two tiers from TOWER_URL and HOSTED_URL, both serving the logical model 'echo'."""
    tower = os.environ.get("TOWER_URL", "http://127.0.0.1:11434")
    hosted = os.environ.get("HOSTED_URL", "http://127.0.0.1:8001")
    return create_app(
        Routes(
            {
                "echo": [
                    Backend(name="tower", url=tower, regime="local"),
                    Backend(name="hosted", url=hosted, regime="hosted"),
                ]
            }
        )
    )
