"""Every ASGI message the stack sends or hands on is on the ASGI spec, as asgiref.typing has it.

A checking layer sits between uvicorn and the whole configured stack (identity,
Admin mount, Heartbeats ... Forwarder) and holds every message it sees, both
ways, against asgiref's TypedDicts: the right keys for the message's type, and
values of the right types. The ASGI spec makes some keys optional that
asgiref's TypedDicts declare (``trailers`` and ``headers`` of a response start,
``body`` and ``more_body`` of a body); those may be left out.
"""

from __future__ import annotations

import asyncio
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import httpx
from asgiref import typing as asgi

from tierchain.config import from_env
from tierchain.stack import build_stack

from .support import (
    Exchange,
    FakeBackend,
    answers,
    chat_request,
    fault,
    openai_stream,
    refused_url,
    serve,
    streams,
)

TOKEN = "asgi-messages-token-0123456789"
SPEC_OPTIONAL = {
    "http.response.start": {"headers", "trailers"},
    "http.response.body": {"body", "more_body"},
    "http.request": {"body", "more_body"},
}


def by_type(union: Any) -> dict[str, type]:
    """``{"http.response.start": HTTPResponseStartEvent, ...}`` for a union of event TypedDicts."""
    out = {}
    for cls in get_args(union):
        (literal,) = get_args(get_type_hints(cls)["type"])
        out[literal] = cls
    return out


SENT = by_type(asgi.ASGISendEvent)
RECEIVED = by_type(asgi.ASGIReceiveEvent)


def conforms(value: Any, hint: Any) -> bool:
    origin = get_origin(hint)
    if hint is Any or hint is object:
        return True
    if origin is Literal:
        return value in get_args(hint)
    if origin in (Union, types.UnionType):
        return any(conforms(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        args = get_args(hint)
        return (
            isinstance(value, tuple)
            and len(value) == len(args)
            and all(conforms(v, a) for v, a in zip(value, args, strict=True))
        )
    if origin in (Iterable, typing.Iterable, list):
        (arg,) = get_args(hint)
        return isinstance(value, Iterable) and all(conforms(v, arg) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    raise AssertionError(f"the checker does not know the hint {hint!r}")


def problems(message: Any, kinds: dict[str, type]) -> list[str]:
    """What is wrong with ``message`` for the spec (empty: nothing)."""
    kind = message.get("type")
    cls = kinds.get(kind)
    if cls is None:
        return [f"unknown message type {kind!r}"]
    hints = get_type_hints(cls)
    required = set(cls.__required_keys__) - SPEC_OPTIONAL.get(kind, set())
    found = [f"{kind}: missing {key!r}" for key in sorted(required - message.keys())]
    found += [f"{kind}: unknown key {key!r}" for key in sorted(message.keys() - hints.keys())]
    found += [
        f"{kind}: {key}={value!r} is not {hints[key]}"
        for key, value in message.items()
        if key in hints and not conforms(value, hints[key])
    ]
    return found


class Conformance:
    """An ASGI layer that records every message that breaks the spec, both ways."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: dict[str, int] = {}
        self.wrong: list[str] = []

    def note(self, message: Any, kinds: dict[str, type]) -> None:
        self.seen[message["type"]] = self.seen.get(message["type"], 0) + 1
        self.wrong += problems(message, kinds)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def checked_receive() -> Any:
            message = await receive()
            self.note(message, RECEIVED)
            return message

        async def checked_send(message: Any) -> None:
            self.note(message, SENT)
            await send(message)

        await self.app(scope, checked_receive, checked_send)


def test_the_checker_catches_a_message_off_the_spec():
    assert problems({"type": "http.response.start", "status": 200}, SENT) == []
    assert problems({"type": "http.response.start", "status": "200"}, SENT)
    assert problems({"type": "http.response.body", "body": "text"}, SENT)
    assert problems({"type": "http.response.start", "status": 200, "headers": [("a", "b")]}, SENT)
    assert problems({"type": "http.response.body", "body": b"", "extra": 1}, SENT)
    assert problems({"type": "lifespan.startup.failed"}, SENT)
    assert problems({"type": "http.response.sent"}, SENT)


def slow_then_streams(delay: float) -> Any:
    async def script(ex: Exchange) -> None:
        await asyncio.sleep(delay)
        await ex.head()
        for event in openai_stream(["late"]):
            await ex.write(event)
        await ex.end()

    return script


async def test_every_message_of_the_whole_stack_is_on_the_spec(tmp_path: Path):
    async with FakeBackend("hosted", streams(["Hel", "lo"])) as hosted:
        routes = tmp_path / "routes.toml"
        routes.write_text(
            f'[[routes.echo.backends]]\nname = "tower"\nurl = "{refused_url()}"\n\n'
            f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{hosted.url}"\n'
        )
        settings = from_env(
            {
                "TIERCHAIN_ROUTES_FILE": str(routes),
                "TIERCHAIN_ADMIN_TOKEN": TOKEN,
                "TIERCHAIN_HEARTBEAT_COMMIT_AFTER": "0.05",
                "TIERCHAIN_IDENTITY": "0",
            }
        )
        app = Conformance(build_stack(None, settings))
        admin = {"authorization": f"Bearer {TOKEN}"}
        async with serve(app, lifespan="on") as base, httpx.AsyncClient(base_url=base) as client:
            url = "/v1/chat/completions"
            answered = [
                await client.post(url, content=chat_request(stream=True)),
                await client.post(url, content=chat_request(stream=False)),
                await client.put("/admin/tierchain/pins/echo", json={"ttl": 60}, headers=admin),
                await client.get("/admin/tierchain/", headers=admin),
            ]
            for path in ("/v1/models", "/v1/models/echo", "/healthz", "/readyz", "/metrics"):
                answered.append(await client.get(path))
            hosted.script = fault("reset", after=1)
            answered.append(await client.post(url, content=chat_request(stream=True)))
            hosted.script = answers(503)
            answered.append(await client.post(url, content=chat_request(stream=False)))
            hosted.script = slow_then_streams(0.3)
            answered.append(await client.post(url, content=chat_request(stream=True)))
    assert [r.status_code for r in answered] == [200, 200, 422, 200, *[200] * 5, 200, 502, 200]
    assert b": {" in answered[-1].content  # Heartbeats committed before the backend answered
    assert app.wrong == []
    assert {
        "lifespan.startup",
        "lifespan.startup.complete",
        "lifespan.shutdown",
        "lifespan.shutdown.complete",
        "http.request",
        "http.response.start",
        "http.response.body",
    } <= set(app.seen)
