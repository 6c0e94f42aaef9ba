"""The README's FastAPI example runs as written and stacks in the brief's order."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from .support import Exchange, FakeBackend, completion_body, serve

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_gateway_builds_with_the_stack_in_the_briefs_order():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    app = namespace["app"]
    layer = app.build_middleware_stack()
    order = []
    while layer is not None and len(order) < 20:
        order.append(type(layer).__name__)
        layer = getattr(layer, "app", None)
    ours = [
        name
        for name in order
        if name
        in {"Heartbeats", "Budget", "PreferBackend", "Failover", "Breaker", "SaturationWatchdog"}
    ]
    assert ours == [
        "Heartbeats",
        "Budget",
        "PreferBackend",
        "Failover",
        "Breaker",
        "SaturationWatchdog",
    ]


def test_the_readme_gateway_gives_its_status_board_to_the_layers_that_read_it():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    board = namespace["board"]
    layer = namespace["app"].build_middleware_stack()
    boards = {}
    while layer is not None and len(boards) < 3:
        name = type(layer).__name__
        if name == "SaturationWatchdog":
            boards[name] = layer.board
        elif name in ("Breaker", "Failover"):
            boards[name] = layer.status_board
        layer = getattr(layer, "app", None)
    # Passed by hand, not found by walking each layer's app: one board, the README's own.
    assert boards == {"Failover": board, "Breaker": board, "SaturationWatchdog": board}


def test_a_status_board_given_to_the_watchdog_is_the_one_it_and_the_layers_around_it_read():
    from tierchain import Backend, Breaker, Failover, Routes, SaturationWatchdog
    from tierchain.status import StatusBoard

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    board = StatusBoard()
    watchdog = SaturationWatchdog(handler, status_interval=0, status_board=board)
    assert watchdog.board is board  # given: used even with status_interval=0
    # Given none, the Breaker and the Failover find the watchdog's board (the fallback).
    routes = Routes({"echo": [Backend(name="tower", url="http://127.0.0.1:9")]})
    failover = Failover(Breaker(watchdog), routes=routes)
    assert failover.status_board is board
    assert failover.app.status_board is board
    own = SaturationWatchdog(handler)
    assert own.board is not None
    assert own.board is not board


def test_a_status_board_that_is_not_one_is_refused_by_the_watchdog():
    async def handler(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    from tierchain import SaturationWatchdog

    with pytest.raises(ValueError, match=r"^status_board must be a tierchain\.status\.StatusBoard"):
        SaturationWatchdog(handler, status_board="board")


def readme_gateway(tower_url: str) -> Any:
    """The README's gateway as written, with its tower's address replaced by ``tower_url``."""
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert '"http://127.0.0.1:11434"' in code
    code = code.replace('"http://127.0.0.1:11434"', repr(tower_url))
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace["app"]


# Ollama's non-streaming /api/chat answer, as its docs/api.md shows it ("Chat request (No
# streaming)"), served as application/json; charset=utf-8 like the Go server does.
OLLAMA_CHAT = (
    b'{"model":"echo","created_at":"2023-12-12T14:13:43.416799Z",'
    b'"message":{"role":"assistant","content":"Hello! How are you today?"},'
    b'"done_reason":"stop","done":true,"total_duration":5191566416,"load_duration":2154458,'
    b'"prompt_eval_count":26,"prompt_eval_duration":383809000,"eval_count":298,'
    b'"eval_duration":4799921000}'
)


async def test_the_readme_gateway_carries_openai_and_ollama_paths_at_once():
    async def tower_answers(ex: Exchange) -> None:
        if ex.request.path == "/api/chat":
            await ex.respond(200, OLLAMA_CHAT, {"content-type": "application/json; charset=utf-8"})
        else:
            await ex.respond(200, completion_body("hello from v1"))

    async with FakeBackend("tower", tower_answers) as tower:
        app = readme_gateway(tower.url)
        async with (
            serve(app, lifespan="on") as url,
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as client,
        ):
            ollama_client = ollama.AsyncClient(host=url)
            try:
                tags = await ollama_client.list()
                chat = await ollama_client.chat(
                    model="echo", messages=[{"role": "user", "content": "hi"}], stream=False
                )
            finally:
                await ollama_client.close()
            completion = await client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "hi"}]
            )
            models = await client.models.list()
    assert [m.model for m in tags.models] == [m.id for m in models.data] == ["echo"]
    assert chat.message.content == "Hello! How are you today?"
    assert chat.done is True
    assert completion.choices[0].message.content == "hello from v1"
    # Each request reached the tower on its own path, nothing doubled, nothing else sent.
    assert [(r.method, r.path) for r in tower.requests] == [
        ("POST", "/api/chat"),
        ("POST", "/v1/chat/completions"),
    ]


def test_the_docs_quick_start_is_the_readmes_gateway():
    index = README.parent / "docs" / "index.md"
    quick_start = re.findall(r"```python\n(.*?)```", index.read_text(), re.S)[0]
    readme = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert quick_start == readme  # Endpoints and one shared store included
