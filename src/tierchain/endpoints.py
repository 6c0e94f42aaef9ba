"""The endpoints clients and orchestrators call first, answered by the gateway itself.

OpenAI clients list the models before their first completion (Open WebUI and
LangChain do it at start-up), Ollama clients ask ``/api/tags`` the same question,
and an orchestrator asks whether the process is alive and whether it can serve.
:class:`Endpoints` answers those from the :class:`~tierchain.Routes` and the
breakers' store, never from a backend:

========================  ==================================================================
``GET /v1/models``        the routes in OpenAI's list shape, one ``model`` entry per route
``GET /v1/models/{id}``   one route; 404 with an OpenAI-style error for an unknown id
``GET /api/tags``         the routes in Ollama's list shape, one entry per route
``GET /api/ps``           Ollama's running-models shape: the routes that can be served now
                          (a backend whose breaker is not open)
``GET /healthz``          liveness: 200 whenever the process answers at all
``GET /readyz``           200 while every route has a backend whose breaker is not open,
                          else 503; the JSON names each backend's state
``GET /metrics``          Prometheus text exposition of the registry (with ``metrics_key``,
                          only for ``Authorization: Bearer <metrics_key>``; 401 otherwise)
========================  ==================================================================

``HEAD`` is answered like ``GET`` without a body; any other method on these
paths is a 405. ``/v1/models/`` (trailing slash) is the list too, so no
framework redirect is ever needed.

Use it in front of a gateway (``Endpoints(app, routes=...)``: anything else
goes on to ``app``), or alone as an ASGI app to mount (then anything else is a
404). Paths are matched after the ``root_path`` a mount sets, if the server put
it in front of ``path``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from ._checks import duration
from ._responses import send_json_error
from ._types import ASGIApp, Headers, Receive, Scope, Send
from .backend import Routes
from .masking import hide
from .store import Store
from .telemetry import log_event

__all__ = ["PATHS", "PROMPT_METRICS", "Endpoints"]

PATHS = ("/v1/models", "/api/tags", "/api/ps", "/healthz", "/readyz", "/metrics")
"""The paths answered (``/v1/models`` with its ``/{id}`` below it)."""

PROMPT_METRICS = (b"tierchain_pool_affinity",)
"""Metrics a caller's prompt can be guessed from: a caller that sends a guess and sees
``tierchain_pool_affinity_total{result="hit"}`` move learns that another caller sent that
prompt. ``/metrics`` serves them only with ``prompt_metrics`` (see :class:`Endpoints`)."""

_JSON = b"application/json"
_NO_STORE = (b"cache-control", b"no-store")
_ALLOW = b"GET, HEAD"
# Go's zero time.Time, as encoding/json writes it: Ollama's "no expiry known".
_ZERO_TIME = "0001-01-01T00:00:00Z"


class Endpoints:
    """Answer ``/v1/models`` (and ``/{id}``), ``/api/tags``, ``/api/ps``, ``/healthz``,
    ``/readyz`` and ``/metrics``.

    ``app`` receives every other request; without one, those get a 404 JSON error.
    ``routes`` are the models listed, and ``store`` the breakers' store ``/readyz`` reads.
    ``prompt_metrics``: whether ``/metrics`` serves :data:`PROMPT_METRICS`; None: only
    when ``metrics_key`` keeps ``/metrics`` to the operator (``build_stack`` also passes
    True when every caller has a key of its own, which partitions the affinity).

    Options: [Endpoints options](endpoints.md#options).
    """

    def __init__(
        self,
        app: ASGIApp | None = None,
        *,
        routes: Routes | Mapping[str, Any] | None = None,
        store: Store | None = None,
        owned_by: str = "tierchain",
        created: int | None = None,
        registry: CollectorRegistry | None = None,
        snapshot_timeout: float | timedelta = 1.0,
        metrics_key: str | None = None,
        prompt_metrics: bool | None = None,
    ) -> None:
        snapshot_timeout = duration("snapshot_timeout", snapshot_timeout)
        self._metrics_digest: bytes | None = None
        if metrics_key is not None:
            if not isinstance(metrics_key, str) or not re.fullmatch(
                r"[\x21-\x7e]{16,512}", metrics_key
            ):
                raise ValueError(
                    "metrics_key must be 16 to 512 printable ASCII characters, no spaces"
                )
            hide(metrics_key)
            self._metrics_digest = hashlib.sha256(metrics_key.encode()).digest()
        self.app = app
        self.routes: Mapping[str, Any] = routes if routes is not None else {}
        self.store = store
        self.owned_by = owned_by
        self.created = int(time.time()) if created is None else int(created)
        self.registry = REGISTRY if registry is None else registry
        self.snapshot_timeout = float(snapshot_timeout)
        self.prompt_metrics = metrics_key is not None if prompt_metrics is None else prompt_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if self.app is not None:
                return await self.app(scope, receive, send)
            if scope["type"] == "lifespan":
                return await _lifespan(receive, send)
            return None
        path = _local_path(scope)
        answer = self._answer_for(path)
        if answer is None:
            if self.app is not None:
                return await self.app(scope, receive, send)
            return await send_json_error(
                send,
                404,
                f"nothing is served at {_shown(path)}",
                "invalid_request_error",
                "not_found",
                headers=[_NO_STORE],
            )
        method = scope["method"]
        if method not in ("GET", "HEAD"):
            return await send_json_error(
                send,
                405,
                f"{_shown(path)} answers GET and HEAD, not {method}",
                "invalid_request_error",
                "method_not_allowed",
                headers=[(b"allow", _ALLOW), _NO_STORE],
            )
        if path == "/metrics" and not self._may_read_metrics(scope):
            return await send_json_error(
                send,
                401,
                "/metrics needs the metrics key: send it as Authorization: Bearer <key>",
                "authentication_error",
                "missing_metrics_key",
                headers=[(b"www-authenticate", b'Bearer realm="tierchain-metrics"'), _NO_STORE],
            )
        try:
            status, content_type, body, headers = await answer()
        except Exception as exc:  # a broken collector, say: an answer, never a 500
            log_event("endpoints.failed", logging.ERROR, path=_shown(path), error=repr(exc))
            return await send_json_error(
                send,
                503,
                f"{_shown(path)} could not be answered: {type(exc).__name__}",
                "server_error",
                "endpoint_failed",
                headers=[_NO_STORE],
            )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()),
                    _NO_STORE,
                    *headers,
                ],
            }
        )
        await send(
            {
                "type": "http.response.body",
                "body": b"" if method == "HEAD" else body,
                "more_body": False,
            }
        )

    def _may_read_metrics(self, scope: Scope) -> bool:
        if self._metrics_digest is None:
            return True
        presented = b""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                scheme, _, rest = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = rest.strip()
                    break
        digest = hashlib.sha256(presented).digest()
        return hmac.compare_digest(digest, self._metrics_digest)

    def _answer_for(self, path: str) -> Any:
        if path in ("/v1/models", "/v1/models/"):
            return self._list
        if path.startswith("/v1/models/"):
            model = path[len("/v1/models/") :]
            return lambda: self._one(model)
        if path == "/api/tags":
            return self._tags
        if path == "/api/ps":
            return self._ps
        if path == "/healthz":
            return self._health
        if path == "/readyz":
            return self._ready
        if path == "/metrics":
            return self._metrics
        return None

    # -- the answers ----------------------------------------------------------------

    def _entry(self, route: str) -> dict[str, Any]:
        return {"id": route, "object": "model", "created": self.created, "owned_by": self.owned_by}

    async def _list(self) -> tuple[int, bytes, bytes, Headers]:
        data = [self._entry(route) for route in self.routes]
        return 200, _JSON, _json({"object": "list", "data": data}), []

    async def _one(self, model: str) -> tuple[int, bytes, bytes, Headers]:
        if model in self.routes:
            return 200, _JSON, _json(self._entry(model)), []
        shown = model if len(model) <= 200 else model[:200] + "..."
        known = ", ".join(self.routes) or "none"
        body = {
            "error": {
                "message": f"The model {shown!r} does not exist; known models: {known}",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
        }
        return 404, _JSON, _json(body), []

    # Ollama's shapes: ListResponse and ProcessResponse in ollama/ollama api/types.go
    # (ListModelResponse: name, model, modified_at, size, digest, details;
    # ProcessModelResponse: name, model, size, digest, details, expires_at, size_vram;
    # ModelDetails: parent_model, format, family, families, parameter_size,
    # quantization_level). The gateway holds no weights: size 0, empty details, and
    # a digest that names the route (the SHA-256 of its name), stable across restarts.

    def _ollama_entry(self, route: str) -> dict[str, Any]:
        return {
            "name": route,
            "model": route,
            "size": 0,
            "digest": hashlib.sha256(route.encode()).hexdigest(),
            "details": {
                "parent_model": "",
                "format": "",
                "family": "",
                "families": None,
                "parameter_size": "",
                "quantization_level": "",
            },
        }

    async def _tags(self) -> tuple[int, bytes, bytes, Headers]:
        modified = datetime.fromtimestamp(self.created, UTC).isoformat().replace("+00:00", "Z")
        models = [{**self._ollama_entry(r), "modified_at": modified} for r in self.routes]
        return 200, _JSON, _json({"models": models}), []

    async def _ps(self) -> tuple[int, bytes, bytes, Headers]:
        states = await self._states()
        models = [
            {**self._ollama_entry(route), "expires_at": _ZERO_TIME, "size_vram": 0}
            for route, chain in self.routes.items()
            if any(states[route, b.name][0] != "open" for b in chain)
        ]
        return 200, _JSON, _json({"models": models}), []

    async def _states(self) -> dict[tuple[str, str], tuple[str, float | None]]:
        pairs = [(route, b.name) for route, chain in self.routes.items() for b in chain]
        states = await asyncio.gather(*(self._state(route, name) for route, name in pairs))
        return dict(zip(pairs, states, strict=True))

    async def _health(self) -> tuple[int, bytes, bytes, Headers]:
        return 200, _JSON, _json({"status": "ok"}), []

    async def _ready(self) -> tuple[int, bytes, bytes, Headers]:
        by_pair = await self._states()
        routes: dict[str, Any] = {}
        ready = True
        soonest: float | None = None
        for route, chain in self.routes.items():
            backends: list[dict[str, Any]] = []
            for backend in chain:
                state, retry_in = by_pair[route, backend.name]
                backends.append({"name": backend.name, "state": state, "retry_in_s": retry_in})
            route_ready = any(b["state"] != "open" for b in backends)
            if not route_ready:
                ready = False
                waits: list[float] = [b["retry_in_s"] for b in backends if b["retry_in_s"]]
                if soonest is not None:
                    waits.append(soonest)
                soonest = min(waits, default=None)
            routes[route] = {"ready": route_ready, "backends": backends}
        body = _json({"status": "ready" if ready else "not_ready", "routes": routes})
        if ready:
            return 200, _JSON, body, []
        headers: Headers = []
        if soonest is not None:
            headers.append((b"retry-after", str(max(1, math.ceil(soonest))).encode()))
        return 503, _JSON, body, headers

    async def _state(self, route: str, backend: str) -> tuple[str, float | None]:
        if self.store is None:
            return "unknown", None
        try:
            async with asyncio.timeout(self.snapshot_timeout):
                snap = await self.store.breaker_snapshot(route, backend)
        except Exception as exc:  # a readiness answer must not fail
            log_event(
                "endpoints.breaker_snapshot_failed",
                logging.WARNING,
                route=route,
                backend=backend,
                error=repr(exc),
            )
            return "unknown", None
        retry_in = None if snap.retry_in is None else round(max(0.0, snap.retry_in), 3)
        return snap.state, retry_in

    async def _metrics(self) -> tuple[int, bytes, bytes, Headers]:
        text = generate_latest(self.registry)
        if not self.prompt_metrics:
            text = _without(text, PROMPT_METRICS)
        return 200, CONTENT_TYPE_LATEST.encode(), text, []


def _without(text: bytes, names: tuple[bytes, ...]) -> bytes:
    """The exposition ``text`` less every line (samples, HELP and TYPE) of the ``names``."""
    if not any(name in text for name in names):
        return text
    heads = tuple(b"# HELP " + n for n in names) + tuple(b"# TYPE " + n for n in names)
    kept = [
        line for line in text.split(b"\n") if not (line.startswith(names) or line.startswith(heads))
    ]
    return b"\n".join(kept)


def _local_path(scope: Scope) -> str:
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        path = path[len(root) :]
    return path


def _shown(path: str) -> str:
    return repr(path if len(path) <= 200 else path[:200] + "...")


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
