"""The endpoints clients call first: answered by the gateway, never forwarded, never a 500."""

from __future__ import annotations

import logging
import re
import sys
import types
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter

from examples.fastapi_app import create_app as fastapi_app
from examples.litestar_app import create_app as litestar_app
from tierchain import Backend, Endpoints, Forwarder, MemoryStore, Routes
from tierchain.config import from_env
from tierchain.stack import build_stack
from tierchain.store import BreakerPolicy

from .support import FakeBackend, serve, streams

ROOT = Path(__file__).resolve().parent.parent
OPEN_AFTER_ONE = BreakerPolicy(
    failure_threshold=1,
    failure_cooldown=30.0,
    saturation_threshold=1,
    saturation_cooldown=30.0,
    retry_after_cap=30.0,
    probe_lease=30.0,
)


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def run_block(code: str, path: Path) -> dict[str, Any]:
    """Run a documentation code block as a module of its own (Litestar resolves hints by it)."""
    module = types.ModuleType(f"doc_block_{abs(hash(code))}")
    sys.modules[module.__name__] = module
    exec(compile(code, str(path), "exec"), module.__dict__)
    return module.__dict__


def readme_gateway(routes: Routes) -> Any:
    namespace = run_block(python_blocks(ROOT / "README.md")[0], ROOT / "README.md")
    return namespace["app"]


def config_gateway(routes: Routes, tmp_path: Path) -> Any:
    lines = []
    for route, chain in routes.items():
        for b in chain:
            lines.append(f'[[routes."{route}".backends]]\nname = "{b.name}"\nurl = "{b.url}"\n')
    path = tmp_path / "routes.toml"
    path.write_text("\n".join(lines))
    return build_stack(None, from_env({"TIERCHAIN_ROUTES_FILE": str(path)}), identity=False)


GATEWAYS = ["build_stack", "readme", "fastapi_example", "litestar_example"]


def gateway(kind: str, routes: Routes, tmp_path: Path) -> Any:
    if kind == "build_stack":
        return config_gateway(routes, tmp_path)
    if kind == "readme":
        return readme_gateway(routes)
    if kind == "fastapi_example":
        return fastapi_app(routes)
    return litestar_app(routes)


@pytest.mark.parametrize("kind", GATEWAYS)
async def test_the_openai_sdk_lists_and_retrieves_the_models_of_every_gateway(kind, tmp_path):
    async with FakeBackend("tower", streams(["hi"])) as tower:
        # The README's routes are its own ("echo"); the others get ours.
        routes = Routes({"echo": [Backend("tower", tower.url)]})
        app = gateway(kind, routes, tmp_path)
        async with (
            serve(app, lifespan="on") as url,
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client,
            httpx.AsyncClient(base_url=url, timeout=5) as http,
        ):
            listed = await client.models.list()
            one = await client.models.retrieve("echo")
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("no-such-model")
            health = await http.get("/healthz")
            ready = await http.get("/readyz")
            metrics = await http.get("/metrics")
            unrouted = await http.get("/v1/files")
    assert [m.id for m in listed.data] == ["echo"]
    assert listed.data[0].object == "model"
    assert (one.id, one.object, one.owned_by) == ("echo", "model", "tierchain")
    assert isinstance(one.created, int)
    assert missing.value.status_code == 404
    assert missing.value.code == "model_not_found"
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    assert ready.status_code == 200
    assert ready.json()["routes"]["echo"]["ready"] is True
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "# TYPE tierchain_attempts_total counter" in metrics.text
    assert unrouted.status_code == 404
    assert unrouted.json()["error"]["code"] == "not_found"
    assert "Traceback" not in unrouted.text
    assert tower.requests == []  # none of it was forwarded


@pytest.mark.parametrize("kind", GATEWAYS)
async def test_the_ollama_client_lists_the_routes_of_every_gateway_from_api_tags(kind, tmp_path):
    async with FakeBackend("tower", streams(["hi"])) as tower:
        routes = Routes({"echo": [Backend("tower", tower.url)]})
        app = gateway(kind, routes, tmp_path)
        async with serve(app, lifespan="on") as url:
            client = ollama.AsyncClient(host=url)
            try:
                listed = await client.list()
                running = await client.ps()
            finally:
                await client.close()
            async with httpx.AsyncClient(base_url=url, timeout=5) as http:
                raw = await http.get("/api/tags")
    assert [m.model for m in listed.models] == ["echo"]
    assert [m.model for m in running.models] == ["echo"]  # its one backend is not open
    (entry,) = raw.json()["models"]
    # Every key of Ollama's ListModelResponse (ollama/ollama api/types.go), no more.
    assert set(entry) == {"name", "model", "modified_at", "size", "digest", "details"}
    assert entry["name"] == "echo"
    assert re.fullmatch(r"[0-9a-f]{64}", entry["digest"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", entry["modified_at"])
    assert listed.models[0].modified_at is not None
    assert raw.headers["cache-control"] == "no-store"
    assert tower.requests == []  # answered by the gateway, never forwarded


async def test_api_ps_lists_only_the_routes_that_can_be_served_now(breaker_store):
    store = breaker_store
    routes = Routes(
        {
            "echo": [
                Backend("tower", "http://127.0.0.1:9"),
                Backend("hosted", "http://127.0.0.1:9"),
            ],
            "solo": [Backend("tower", "http://127.0.0.1:9")],
        }
    )
    async with serve(Endpoints(routes=routes, store=store)) as url:
        client = ollama.AsyncClient(host=url)
        try:
            before = await client.ps()
            await store.breaker_record("solo", "tower", OPEN_AFTER_ONE, "failure", gen=0)
            await store.breaker_record("echo", "tower", OPEN_AFTER_ONE, "failure", gen=0)
            after = await client.ps()
            tags = await client.list()
        finally:
            await client.close()
        async with httpx.AsyncClient(base_url=url, timeout=5) as http:
            raw = (await http.get("/api/ps")).json()
    assert [m.model for m in before.models] == ["echo", "solo"]
    assert [m.model for m in after.models] == ["echo"]  # solo's only backend is open
    assert [m.model for m in tags.models] == ["echo", "solo"]  # /api/tags lists every route
    (entry,) = raw["models"]
    # Every key of Ollama's ProcessModelResponse (ollama/ollama api/types.go).
    assert set(entry) == {
        "name", "model", "size", "digest", "details", "expires_at", "size_vram",
    }  # fmt: skip
    assert (entry["size"], entry["size_vram"]) == (0, 0)


async def test_readiness_turns_503_when_every_backend_of_a_route_is_open(
    breaker_store, manual_clock
):
    store = breaker_store
    routes = Routes(
        {
            "echo": [
                Backend("tower", "http://127.0.0.1:9"),
                Backend("hosted", "http://127.0.0.1:9"),
            ],
            "solo": [Backend("tower", "http://127.0.0.1:9")],
        }
    )
    app = Endpoints(routes=routes, store=store)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        await store.breaker_record("echo", "tower", OPEN_AFTER_ONE, "failure", gen=0)
        one_open = await client.get("/readyz")
        await store.breaker_record("solo", "tower", OPEN_AFTER_ONE, "failure", gen=0)
        all_open = await client.get("/readyz")
        manual_clock.advance(31)  # the cooldown is over: a probe may go
        half_open = await client.get("/readyz")
    assert one_open.status_code == 200
    echo = one_open.json()["routes"]["echo"]
    assert [(b["name"], b["state"]) for b in echo["backends"]] == [
        ("tower", "open"),
        ("hosted", "closed"),
    ]
    assert all_open.status_code == 503
    body = all_open.json()
    assert body["status"] == "not_ready"
    assert body["routes"]["solo"] == {
        "ready": False,
        "backends": [{"name": "tower", "state": "open", "retry_in_s": 30.0}],
    }
    assert body["routes"]["echo"]["ready"] is True
    assert all_open.headers["retry-after"] == "30"
    assert all_open.headers["cache-control"] == "no-store"
    assert half_open.status_code == 200
    assert half_open.json()["routes"]["solo"]["backends"][0]["state"] == "half_open"


class BrokenStore(MemoryStore):
    async def breaker_snapshot(self, route: str, backend: str) -> Any:
        raise ConnectionError("store down")


async def test_a_store_that_cannot_be_read_shows_unknown_and_stays_ready(caplog):
    caplog.set_level(logging.WARNING, logger="tierchain")
    routes = Routes({"echo": [Backend("tower", "http://127.0.0.1:9")]})
    transport = httpx.ASGITransport(app=Endpoints(routes=routes, store=BrokenStore()))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        ready = await client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["routes"]["echo"]["backends"][0]["state"] == "unknown"
    events = [getattr(r, "event", None) for r in caplog.records]
    assert "endpoints.breaker_snapshot_failed" in events


async def test_other_methods_are_405_head_has_no_body_and_model_ids_may_hold_slashes():
    routes = Routes({"meta-llama/Llama-3-8B": [Backend("tower", "http://127.0.0.1:9")]})
    downstream: list[str] = []

    async def app(scope, receive, send):
        downstream.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=Endpoints(app, routes=routes))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        post = await client.post("/v1/models", content=b"{}")
        head = await client.head("/readyz")
        slash = await client.get("/v1/models/")
        one = await client.get("/v1/models/meta-llama/Llama-3-8B")
        other = await client.post("/v1/chat/completions", content=b"{}")
    assert post.status_code == 405
    assert post.headers["allow"] == "GET, HEAD"
    assert post.json()["error"]["code"] == "method_not_allowed"
    assert head.status_code == 200
    assert head.content == b""
    assert int(head.headers["content-length"]) > 0
    assert [m["id"] for m in slash.json()["data"]] == ["meta-llama/Llama-3-8B"]
    assert one.json()["id"] == "meta-llama/Llama-3-8B"
    assert other.status_code == 204
    assert downstream == ["/v1/chat/completions"]


async def test_metrics_expose_the_given_registry():
    registry = CollectorRegistry()
    Counter("only_here", "A counter in a registry of its own.", registry=registry).inc()
    transport = httpx.ASGITransport(app=Endpoints(registry=registry))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        metrics = await client.get("/metrics")
    assert "only_here_total 1.0" in metrics.text
    assert "tierchain_attempts" not in metrics.text


async def test_alone_or_mounted_under_a_prefix_it_serves_its_paths_and_404s_the_rest():
    routes = Routes({"echo": [Backend("tower", "http://127.0.0.1:9")]})
    ops = Endpoints(routes=routes)
    host = FastAPI()
    host.mount("/ops", ops)
    async with (
        serve(ops, lifespan="on") as alone,
        serve(host, lifespan="on") as mounted,
        httpx.AsyncClient(timeout=5) as client,
    ):
        health = await client.get(alone + "/healthz")
        unknown = await client.get(alone + "/nothing/here")
        prefixed = await client.get(mounted + "/ops/readyz")
    assert health.status_code == 200
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "not_found"
    assert prefixed.status_code == 200
    assert prefixed.json()["routes"]["echo"]["backends"][0]["state"] == "unknown"


# -- the recipes in docs/endpoints.md, run as written ------------------------------------


@pytest.mark.parametrize("index", [0, 1], ids=["fastapi", "litestar"])
async def test_the_documented_recipes_answer_models_and_carry_v1_and_api_at_once(index):
    doc = ROOT / "docs" / "endpoints.md"
    code = python_blocks(doc)[index]

    async def tower_answers(ex: Any) -> None:
        # Ollama's non-streaming /api/chat answer (its docs/api.md, "Chat request (No
        # streaming)"), application/json; charset=utf-8 as its Go server sends it.
        body = (
            b'{"model":"echo","created_at":"2023-12-12T14:13:43.416799Z","message":'
            b'{"role":"assistant","content":"hi there"},"done_reason":"stop","done":true}'
        )
        await ex.respond(200, body, {"content-type": "application/json; charset=utf-8"})

    async with FakeBackend("tower", tower_answers) as tower:
        # The recipe as written, its tower's address replaced by the fake's.
        code = code.replace('"http://127.0.0.1:11434"', repr(tower.url))
        namespace = run_block(code, doc)
        async with (
            serve(namespace["app"], lifespan="on") as url,
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client,
            httpx.AsyncClient(base_url=url, timeout=5) as http,
        ):
            listed = await client.models.list()
            bare = await http.get("/v1/models")
            slash = await http.get("/v1/models/")
            ready = await http.get("/readyz")
            ollama_client = ollama.AsyncClient(host=url)
            try:
                tags = await ollama_client.list()
                chat = await ollama_client.chat(
                    model="echo", messages=[{"role": "user", "content": "hi"}], stream=False
                )
            finally:
                await ollama_client.close()
        # The recipe closes its Forwarder at shut-down (lifespan): its kept-alive connection
        # to the tower is not left to the collector (it was a ResourceWarning after the run).
        assert namespace["forwarder"]._client is None
    assert [m.model for m in tags.models] == ["echo"]
    assert chat.message.content == "hi there"
    assert [(r.method, r.path) for r in tower.requests] == [("POST", "/api/chat")]
    assert [m.id for m in listed.data] == ["echo"]
    assert bare.status_code == slash.status_code == 200  # no redirect either way
    assert bare.json() == slash.json()
    assert ready.status_code == 200
    assert ready.json()["routes"]["echo"]["backends"] == [
        {"name": "tower", "state": "closed", "retry_in_s": None}
    ]


async def test_a_forwarder_with_nowhere_to_send_a_request_answers_404_json():
    forwarder = Forwarder()
    async with (
        serve(forwarder, lifespan="on") as url,
        httpx.AsyncClient(timeout=5) as client,
    ):
        response = await client.post(url + "/v1/chat/completions", content=b"{}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert "/v1/chat/completions" in response.json()["error"]["message"]


class BrokenCollector:
    def collect(self):
        raise RuntimeError("collector broke")


async def test_a_broken_metrics_collector_is_a_503_json_answer_not_a_500(caplog):
    registry = CollectorRegistry()
    registry.register(BrokenCollector())
    transport = httpx.ASGITransport(app=Endpoints(registry=registry))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        metrics = await client.get("/metrics")
        health = await client.get("/healthz")
    assert metrics.status_code == 503
    assert metrics.json()["error"]["code"] == "endpoint_failed"
    assert health.status_code == 200
    assert "endpoints.failed" in [getattr(r, "event", None) for r in caplog.records]
