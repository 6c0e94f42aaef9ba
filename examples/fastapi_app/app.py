"""An LLM gateway on FastAPI with the tierchain stack in front of its forwarder.

Run it (two fake upstreams are not included here; point the routes at yours)::

    TOWER_URL=http://127.0.0.1:11434 HOSTED_URL=https://api.example.com \\
        uvicorn --factory examples.fastapi_app.app:from_env

FastAPI runs ``add_middleware`` calls in reverse: the last one added is the
outermost. So the calls below are written innermost first.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from tierchain import Backend, Failover, Forwarder, Routes


def create_app(routes: Routes, *, connect_timeout: float = 2.0) -> FastAPI:
    """Build the gateway: ``/v1/*`` POSTs go down each model's chain of backends."""
    forwarder = Forwarder(connect_timeout=connect_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with forwarder:  # closes the shared upstream client on shutdown
            yield

    app = FastAPI(title="tierchain example gateway", lifespan=lifespan)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": name, "object": "model"} for name in routes]}

    # The forwarding handler: every attempt goes to current_attempt(scope).backend.
    app.mount("/v1", forwarder)

    # Innermost first (FastAPI: last added is outermost).
    app.add_middleware(Failover, routes=routes, paths=("/v1/",))
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
