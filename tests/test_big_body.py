"""One caller's huge body never holds the event loop (issue 43, item 4).

A body is bounded by its shape before anything parses it (``tierchain._json.check_shape``):
30 MB of ``[[],[],...]``, under the 32 MiB ``max_body``, is refused with a 400 after a count
that lets the loop run between slices, and ``/healthz`` is answered all the while. The loop
is watched by the package's own lag monitor (``tierchain._runtime.lag``), not a stopwatch in
the test; the figure is measured by ``bench/big_body.py`` (docs/failover.md).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tierchain import _json
from tierchain._runtime import clock, lag
from tierchain.config import from_env
from tierchain.stack import build_stack

from .support import on_virtual_time, serve
from .test_hostile import exchange, post

MB30 = 30 * 2**20
NESTED = b"[" + b"[]," * (MB30 // 3) + b"[]]"


async def _turns_during(work: object) -> tuple[object, int]:
    """Run ``work`` (a coroutine) beside a task that counts the loop's turns."""
    turns = 0
    stop = asyncio.Event()

    async def count() -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    counter = asyncio.create_task(count())
    try:
        result = await work  # type: ignore[misc]
    except ValueError as exc:
        result = exc
    finally:
        stop.set()
        await counter
    return result, turns


@pytest.mark.parametrize(
    ("body", "what"),
    [
        (NESTED, "arrays and objects"),
        (b'{"model":"m","input":[' + b"1," * (MB30 // 2) + b"1]}", "values"),
        (b"[" + b'"",' * (MB30 // 3) + b'""]', "values"),
        (b'{"a":[' + b"{}," * 60_000 + b"{}]}", "arrays and objects"),
    ],
    ids=["nested", "numbers", "strings", "just_past_the_bound"],
)
async def test_a_body_of_too_many_values_is_refused_before_any_parse(body, what):
    refused, _ = await _turns_during(_json.check_shape(body))
    assert isinstance(refused, _json.TooComplex)
    assert what in str(refused)


async def test_brackets_and_commas_inside_strings_do_not_count_and_the_loop_turns_meanwhile():
    text = '[[a], {b}, c, \\"quoted\\", back\\\\slash ' * (MB30 // 40)
    body = b'{"model":"m","messages":[{"role":"user","content":"' + text.encode() + b'"}]}'
    counted, turns = await _turns_during(_json.check_shape(body))
    assert counted == 3  # the object, the messages array, the message
    assert turns > 50  # the count let the loop run between its slices
    assert json.loads(body)["model"] == "m"  # (a valid body: nothing else is said of it)


@pytest.mark.parametrize("cut", range(-3, 4))
async def test_an_escape_cut_by_a_slice_end_is_read_whole(cut):
    """A backslash right at a slice's end: the escaped quote after it does not end the
    string, so the brackets after it, inside the string, are not counted."""
    head = b'{"x":"'
    fill = b"a" * (_json._SLICE - len(head) - 1 + cut)
    body = head + fill + b'\\"' + b"[]" * 60_000 + b'"}'
    assert await _json.check_shape(body) == 1


async def test_a_string_that_never_ends_is_left_to_the_parser():
    body = b'{"x":"' + b"a" * 300_000 + b"\\"
    assert await _json.check_shape(body) == 1
    with pytest.raises(ValueError):
        _json.loads(body)


async def test_a_30_mb_nested_body_is_a_400_and_healthz_is_answered_meanwhile(tmp_path: Path):
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    app = build_stack(
        None, from_env({"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_IDENTITY": "off"})
    )
    lag.watch()
    async with serve(app, lifespan="on") as url, httpx.AsyncClient() as client:
        answered = 0
        started = clock.now()
        refused = asyncio.create_task(exchange(url, post(NESTED)))
        while not refused.done():
            assert (await client.get(url + "/healthz")).status_code == 200
            answered += 1
        answer = await refused
        blocked = lag.lag_since(started)
    assert answer.status == 400
    # The package's lag monitor never saw the loop held for anything like the whole parse
    # (seconds before the bound); what is left is the machine's own noise.
    assert blocked < 1.0
    assert answered >= 1
    error = answer.json()["error"]
    assert error["code"] == "invalid_body"
    assert "more than 50,000 arrays and objects" in error["message"]


@on_virtual_time
async def test_heartbeats_never_parse_a_long_body_on_the_loop_to_learn_stream(monkeypatch):
    """A 2 MiB body that says nothing in its Accept header: Heartbeats does not parse it
    (the layer inside says "stream" once it has bounded the body); a short one it does."""
    from tierchain import Heartbeats, TierRequest
    from tierchain import heartbeats as module

    parsed: list[int] = []
    real = module.says_stream

    def counting(parts: list[bytes]) -> bool:
        parsed.append(sum(map(len, parts)))
        return real(parts)

    monkeypatch.setattr(module, "says_stream", counting)

    async def inner(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await asyncio.sleep(0.3)  # past commit_after, before the inner layer says anything
        TierRequest.of(scope).streaming = True
        await asyncio.sleep(0.3)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n"})

    app = Heartbeats(inner, commit_after=0.1, interval=0)
    long_ = b'{"model":"m","stream":true,"x":"' + b"a" * 2**21 + b'"}'
    short = b'{"model":"m","stream":true}'
    async with serve(app) as url, httpx.AsyncClient() as client:
        for body in (long_, short):
            r = await client.post(url + "/v1/chat/completions", content=body)
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
    assert parsed == [len(short)]


PROSE = b'The quick [brown] {fox}, \\"jumps\\" over the lazy dog. ' * (MB30 // 56)


@pytest.mark.parametrize(
    ("body", "found"),
    [
        (
            b'{"stream": true, "messages": [{"role": "user", "content": "'
            + PROSE
            + b'", "model": "inner"}], "model": "echo"}',
            {"model": "echo", "stream": True},
        ),
        (b' {"model":"a","x":{"model":"b"},"model":"c"}', {"model": "c"}),  # the last, top only
        (b'{"m\\"odel":"a","model" : "b"}', {"model": "b"}),
        (b'{"x": [1, {"stream": true}]}', {}),
        (b'["model", "echo"]', None),
        (b'{"model": "echo", "x": "never closed', None),
    ],
    ids=["prose_30mb", "nested_and_twice", "escaped_name", "none_on_top", "array", "unclosed"],
)
async def test_a_long_bodys_routing_members_are_read_without_parsing_the_rest(body, found):
    got, turns = await _turns_during(_json.members(body, frozenset({"model", "stream"})))
    assert got == found
    if len(body) > MB30 // 2:
        assert turns > 50  # the walk let the loop run between its slices


async def test_a_long_chat_body_is_routed_and_forwarded_whole(tmp_path: Path):
    from .support import FakeBackend, completion_body

    body = (
        b'{"model": "echo", "messages": [{"role": "user", "content": "'
        + PROSE[: 3 * 2**20]
        + b'"}], "stream": false}'
    )

    async def answer(ex):
        await ex.respond(200, completion_body("ok"))

    async with FakeBackend("tower", answer) as tower:
        routes = tmp_path / "routes.toml"
        routes.write_text(f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower.url}"\n')
        app = build_stack(
            None, from_env({"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_IDENTITY": "off"})
        )
        async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=60) as client:
            r = await client.post(url + "/v1/chat/completions", content=body)
    assert r.status_code == 200
    [seen] = tower.requests
    assert seen.body == body


async def test_a_long_bodys_max_tokens_is_read_without_parsing_its_messages(monkeypatch):
    from tierchain.usage import asked_output

    def no_parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the whole body was parsed")

    body = (
        b'{"model": "echo", "messages": [{"role": "user", "content": "'
        + PROSE[: 3 * 2**20]
        + b'"}], "options": {"num_predict": 9}, "max_tokens": 77}'
    )
    monkeypatch.setattr(_json, "loads", no_parse)
    assert await asked_output(body) == 77
