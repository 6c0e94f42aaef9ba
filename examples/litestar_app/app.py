"""An LLM gateway on Litestar with the tierchain stack in front of its forwarder.

Run it from the repository root (point the routes at your backends)::

    TOWER_URL=http://127.0.0.1:11434 HOSTED_URL=https://api.example.com \\
        uvicorn --factory examples.litestar_app.app:from_env

Litestar lists middleware outermost first and builds the stack per route
handler, so 404 and 405 are answered before any middleware runs, and
middleware never sees the lifespan: the forwarder is closed in ``on_shutdown``.
For the same reason :class:`~tierchain.Endpoints` (``/v1/models``, ``/healthz``,
``/readyz``, ``/metrics``) wraps the Litestar app from outside: Litestar would
answer 404 to those paths before any middleware of its own ran.
"""

from __future__ import annotations

import os

import httpx
from litestar import Litestar, asgi
from litestar.middleware import DefineMiddleware
from litestar.types import Receive, Scope, Send

from tierchain import (
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
) -> Endpoints:
    """Build the gateway: ``/v1/*`` and ``/api/*`` POSTs go down each model's chain.

    The whole tierchain stack, in its fixed order (see the FastAPI example for
    the options). Litestar builds the middleware stack once per route handler,
    so everything that must be shared is made here and passed in: one store for
    every Breaker and PreferBackend, one probe client for every watchdog.
    """
    forwarder = Forwarder(connect_timeout=connect_timeout)
    store = store if store is not None else MemoryStore()
    probe_client = httpx.AsyncClient(timeout=None, trust_env=False)

    @asgi("/v1", is_mount=True, copy_scope=True)
    async def forward(scope: Scope, receive: Receive, send: Send) -> None:
        await forwarder(scope, receive, send)  # type: ignore[arg-type]

    @asgi("/api", is_mount=True, copy_scope=True)  # Ollama's native API
    async def forward_api(scope: Scope, receive: Receive, send: Send) -> None:
        await forwarder(scope, receive, send)  # type: ignore[arg-type]

    app = Litestar(
        route_handlers=[forward, forward_api],
        # Outermost first.
        middleware=[
            DefineMiddleware(Heartbeats, interval=heartbeat_interval, commit_after=commit_after),
            DefineMiddleware(Budget, default=budget),
            DefineMiddleware(PreferBackend, store=store),
            DefineMiddleware(
                Failover, routes=routes, paths=("/v1/", "/api/"), hedge_after=hedge_after
            ),
            DefineMiddleware(Breaker, store=store),
            DefineMiddleware(SaturationWatchdog, slow_after=slow_after, client=probe_client),
        ],
        # Middleware never sees Litestar's lifespan: close what it shares here.
        on_shutdown=[forwarder.aclose, probe_client.aclose],
    )
    # In front of Litestar's router; everything else (and the lifespan) goes on to it.
    return Endpoints(app, routes=routes, store=store)


def from_env() -> Endpoints:
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
