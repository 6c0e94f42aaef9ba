"""The caller names a path and a query, never the upstream host: raw request lines over sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

import pytest

from tierchain import Backend, Failover, Forwarder, Routes
from tierchain._target import (
    BadTarget,
    Target,
    _checked,
    check_target,
    merge_query,
    request_target,
    upstream_url,
)

from .support import FakeBackend, chat_request, completion_body, serve


async def raw_request(
    url: str, target: str, body: bytes = b"", *, method: str = "POST", headers: str = ""
) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send one request line exactly as given; return status, header lines and body."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{headers}\r\n"
    )
    writer.write(head.encode("latin-1") + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await writer.wait_closed()
    head_bytes, _, rest = raw.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    parsed = [(k.strip().lower(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:])]
    if ("transfer-encoding", "chunked") in parsed:
        rest = _unchunk(rest)
    return status, parsed, rest


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return out


def untouched(*backends: FakeBackend) -> bool:
    """No connection ever reached any of ``backends``."""
    return all(
        not b.requests and b.open_connections == 0 and not b.connection_closed.is_set()
        for b in backends
    )


REFUSED = [
    ("@127.0.0.1:{attacker}/v1/chat/completions", "not_origin_form"),
    ("http://127.0.0.1:{attacker}/v1/chat/completions", "not_origin_form"),
    ("//127.0.0.1:{attacker}/v1/chat/completions", "not_origin_form"),
    ("*", "not_origin_form"),
    ("/v1/../api/pull", "dot_segment"),
    ("/v1/./chat/completions", "dot_segment"),
    ("/v1/%2e%2e/api/pull", "dot_segment"),
    ("/v1/%2E./api/pull", "dot_segment"),
    ("/v1/.%2e/api/pull", "dot_segment"),
    ("/v1/..%2fapi/pull", "dot_segment"),
    ("/v1/../../tenant-b/v1/chat/completions", "dot_segment"),
    ("/v1/..;p/api/pull", "dot_segment"),
    ("/v1/%c0%ae%c0%ae/api/pull", "bad_percent_encoding"),
    ("/v1\\..\\api\\pull", "backslash"),
    ("/v1/%5c../api/pull", "backslash"),
    ("/v1/chat/completions%00", "control_character"),
    ("/v1/chat/completions?key=sk-caller%00", "control_character"),
    ("/v1/chat/completions%0d%0aX-Injected:%201", "control_character"),
    ("/v1/chat/completions#frag", "fragment"),
    ("/v1/chat/%zzcompletions", "bad_percent_encoding"),
]


def _forwarder_alone(backend: Backend) -> tuple[Any, Forwarder]:
    forwarder = Forwarder(backend=backend)
    return forwarder, forwarder


def _failover_with_default(backend: Backend) -> tuple[Any, Forwarder]:
    # Unrouted requests (GET, other paths) fall through to the default backend.
    forwarder = Forwarder(backend=backend)
    return Failover(forwarder, routes=Routes({"echo": [backend]}), paths=("/v1/",)), forwarder


def _failover_chain(backend: Backend) -> tuple[Any, Forwarder]:
    forwarder = Forwarder()
    return Failover(forwarder, routes=Routes({"echo": [backend]})), forwarder


@pytest.mark.parametrize(
    "build", [_forwarder_alone, _failover_with_default, _failover_chain], ids=lambda f: f.__name__
)
async def test_a_target_that_could_steer_the_upstream_is_a_400_and_no_backend_is_touched(
    build, caplog
):
    async with FakeBackend("tower") as tower, FakeBackend("attacker") as attacker:
        # A hosted-style base path: nothing may leave /tenant-a.
        app, forwarder = build(
            Backend("tower", tower.url + "/tenant-a", headers={"Authorization": "Bearer sk-up"})
        )
        got: dict[str, tuple[int, str | None]] = {}
        with caplog.at_level(logging.INFO, logger="tierchain"):
            async with serve(app) as url:
                for template, _ in REFUSED:
                    target = template.format(attacker=attacker.port)
                    status, _headers, body = await raw_request(url, target, chat_request())
                    error = json.loads(body)["error"] if status == 400 else {}
                    got[template] = (status, error.get("reason"))
                    if status == 400:
                        assert error["code"] == "invalid_request_target"
                        assert error["type"] == "invalid_request_error"
                        assert error["message"]
        await forwarder.aclose()
        assert got == {template: (400, reason) for template, reason in REFUSED}
        assert untouched(tower, attacker)
    events = [r for r in caplog.records if getattr(r, "event", "") == "request.target_rejected"]
    assert len(events) == len(REFUSED)
    assert all("sk-caller" not in r.getMessage() for r in events)  # the path, never the query


async def test_the_upstream_keeps_the_backends_base_path_and_query_and_merges_the_callers():
    async with FakeBackend("hosted") as hosted:
        hosted.script = _answer_json
        backend = Backend("hosted", hosted.url + "/tenant-a/?api-version=2024-06-01&api_key=K")
        forwarder = Forwarder()
        # The caller's path is normalised (%76%31 is v1) before Failover matches ``paths``.
        app = Failover(forwarder, routes=Routes({"echo": [backend]}), paths=("/v1/",))
        async with serve(app) as url:
            status, headers, _ = await raw_request(
                url,
                "/%76%31/chat/completions?api_key=stolen&stream_options=1&api-version=0",
                chat_request(stream=False),
            )
        await forwarder.aclose()
    assert status == 200
    assert dict(headers)["x-tierchain-attempts"] == "hosted;outcome=ok"
    [seen] = hosted.requests
    assert seen.path == (
        "/tenant-a/v1/chat/completions?api-version=2024-06-01&api_key=K&stream_options=1"
    )


async def test_a_forwarder_alone_keeps_the_host_port_and_userinfo_of_its_backend():
    async with FakeBackend("tower") as tower, FakeBackend("attacker") as attacker:
        tower.script = _answer_json
        forwarder = Forwarder(backend=Backend("tower", tower.url.replace("//", "//u:p@")))
        async with serve(forwarder) as url:
            status, _, _ = await raw_request(
                url,
                "/v1/chat/completions?x=1",
                chat_request(stream=False),
                headers=f"X-Forwarded-Host: 127.0.0.1:{attacker.port}\r\n",
            )
        await forwarder.aclose()
    assert status == 200
    [seen] = tower.requests
    assert seen.path == "/v1/chat/completions?x=1"
    assert seen.headers["host"] == f"127.0.0.1:{tower.port}"
    assert seen.headers["authorization"] == "Basic dTpw"  # the backend's userinfo, kept
    assert untouched(attacker)


async def _answer_json(ex: Any) -> None:
    await ex.respond(200, completion_body("ok"))


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        (b"/v1/chat/completions", b"/v1/chat/completions"),
        (b"/%76%31/chat%2dcompletions", b"/v1/chat-completions"),  # unreserved: decoded
        (b"/v1/models/org%2fmodel", b"/v1/models/org%2Fmodel"),  # reserved: kept, upper-cased
        (b"/v1//chat", b"/v1//chat"),  # an empty segment inside is passed on
        (b"/v1/..foo/.well-known/x...", b"/v1/..foo/.well-known/x..."),  # not dot segments
        (b"/v1/@me", b"/v1/@me"),  # '@' after the first '/' is only a path character
        (b"/v1/caf\xc3\xa9", b"/v1/caf%C3%A9"),  # raw bytes beyond ASCII go on encoded
    ],
)
def test_a_plain_path_is_accepted_and_normalised(raw, normalised):
    assert check_target(raw).path == normalised


@pytest.mark.parametrize(
    ("base", "caller", "merged"),
    [
        (b"", b"a=1", b"a=1"),
        (b"api-version=1", b"", b"api-version=1"),
        (b"api-version=1&api_key=K", b"api_key=X&b=2&api%5Fkey=Y", b"api-version=1&api_key=K&b=2"),
        (b"k=1", b"k&k=2&j=3", b"k=1&j=3"),  # a bare name counts as the same parameter
    ],
)
def test_the_backends_query_comes_first_and_wins(base, caller, merged):
    assert merge_query(base, caller) == merged


def test_the_upstream_url_keeps_every_part_of_the_backend_but_the_path_tail_and_query():
    url = upstream_url(
        "https://u:p@hosted.example:8443/tenant-a/?api_key=K#frag",
        check_target(b"/v1/chat/completions", b"stream=1"),
    )
    assert (
        str(url)
        == "https://u:p@hosted.example:8443/tenant-a/v1/chat/completions?api_key=K&stream=1"
    )


def test_the_fast_path_for_plain_targets_agrees_with_the_full_check():
    rng = random.Random(11)
    alphabet = [b"/", b".", b"..", b"%", b"2e", b"2E", b"2f", b"5c", b"00", b"\\", b";", b"#"]
    alphabet += [b"?", b"@", b":", b"v1", b"a", b"-", b"~", b"%41", b"\xc3\xa9", b"\x00", b"//"]

    def outcome(check, raw: bytes, query: bytes) -> object:
        try:
            return check(raw, query)
        except BadTarget as exc:
            return exc.reason

    fast_taken = 0
    for _ in range(20000):
        raw = b"/" + b"".join(rng.choices(alphabet, k=rng.randint(0, 8)))
        query = b"".join(rng.choices(alphabet, k=rng.randint(0, 3)))
        if b"?" in raw:
            raw, _, rest = raw.partition(b"?")
            query = rest + query
        fast_taken += isinstance(outcome(check_target, raw, query), Target)
        assert outcome(check_target, raw, query) == outcome(_checked, raw, query), (raw, query)
    assert fast_taken > 1000  # the comparison covered accepted targets, not only refusals


def test_a_server_that_gives_no_raw_path_or_leaves_the_query_on_it_is_handled():
    decoded_only = {"type": "http", "path": "/v1/a b/caf\u00e9", "query_string": b"x=1"}
    assert request_target(decoded_only) == Target(b"/v1/a%20b/caf%C3%A9", b"x=1")
    with pytest.raises(BadTarget):
        request_target({"type": "http", "path": "/v1/../api/pull", "query_string": b""})
    with_query = {"type": "http", "path": "/v1/x", "raw_path": b"/v1/x?x=1", "query_string": b"x=1"}
    assert request_target(with_query) == Target(b"/v1/x", b"x=1")


def _build_stack_gateway(tower: FakeBackend, tmp_path: Any) -> Any:
    from tierchain.config import from_env
    from tierchain.stack import build_stack

    routes = tmp_path / "routes.toml"
    routes.write_text(f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower.url}"\n')
    return build_stack(None, from_env({"TIERCHAIN_ROUTES_FILE": str(routes)}), identity=False)


def _fastapi_example_gateway(tower: FakeBackend, tmp_path: Any) -> Any:
    from examples.fastapi_app.app import create_app

    return create_app(Routes({"echo": [Backend("tower", tower.url)]}))


def _litestar_example_gateway(tower: FakeBackend, tmp_path: Any) -> Any:
    from examples.litestar_app.app import create_app

    return create_app(Routes({"echo": [Backend("tower", tower.url)]}))


@pytest.mark.parametrize(
    "build",
    [_build_stack_gateway, _fastapi_example_gateway, _litestar_example_gateway],
    ids=lambda f: f.__name__,
)
async def test_the_configured_and_the_example_gateways_refuse_a_steering_target(build, tmp_path):
    async with FakeBackend("tower") as tower, FakeBackend("attacker") as attacker:
        app = build(tower, tmp_path)
        async with serve(app) as url:
            answers = [
                await raw_request(url, target, chat_request())
                for target in (
                    "/v1/../api/pull",
                    "/v1/%2e%2e/api/pull",
                    f"@127.0.0.1:{attacker.port}/v1/chat/completions",
                    f"http://127.0.0.1:{attacker.port}/v1/chat/completions",
                )
            ]
        statuses = [status for status, _, _ in answers]
        if build is _litestar_example_gateway:
            # Litestar answers a path that matches no route itself, before any middleware.
            assert statuses == [400, 400, 404, 404]
        else:
            assert statuses == [400, 400, 400, 400]
        assert untouched(tower, attacker)
