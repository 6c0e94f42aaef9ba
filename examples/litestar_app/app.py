"""An LLM gateway on Litestar with the tierchain stack in front of its forwarder.

Litestar lists middleware outermost first and builds the stack per route
handler, so 404 and 405 are answered before any middleware runs, and
middleware never sees the lifespan: the forwarder is closed in ``on_shutdown``.
"""

from __future__ import annotations

import os

from litestar import Litestar, asgi, get
from litestar.middleware import DefineMiddleware
from litestar.types import Receive, Scope, Send

from tierchain import Backend, Failover, Forwarder, Heartbeats, Routes


def create_app(
    routes: Routes,
    *,
    connect_timeout: float = 2.0,
    heartbeat_interval: float = 10.0,
    commit_after: float = 1.0,
) -> Litestar:
    """Build the gateway: ``/v1/*`` POSTs go down each model's chain of backends.

    ``heartbeat_interval`` and ``commit_after`` are Heartbeats' ``interval`` and
    ``commit_after`` (see docs/heartbeats.md).
    """
    forwarder = Forwarder(connect_timeout=connect_timeout)

    @asgi("/v1", is_mount=True, copy_scope=True)
    async def forward(scope: Scope, receive: Receive, send: Send) -> None:
        await forwarder(scope, receive, send)  # type: ignore[arg-type]

    @get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return Litestar(
        route_handlers=[forward, healthz],
        # Outermost first.
        middleware=[
            DefineMiddleware(Heartbeats, interval=heartbeat_interval, commit_after=commit_after),
            DefineMiddleware(Failover, routes=routes, paths=("/v1/",)),
        ],
        on_shutdown=[forwarder.aclose],
    )


def from_env() -> Litestar:
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
