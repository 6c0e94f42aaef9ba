"""Admin: operator pins over an authenticated JSON API, mounted inside a host app."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from tierchain import Admin, Backend, Breaker, Failover, Forwarder, PreferBackend, Routes
from tierchain.store import MemoryStore

from .support import FakeBackend, chat_request, serve, streams

TOKEN = "s3cret-operator-token-0123456789"
MOUNT = "/admin/tierchain"


def host_app(
    routes: Routes, store: Any, *, breaker: dict[str, Any] | None = None, **admin_opts: Any
) -> tuple[Starlette, Forwarder, Admin]:
    """A host app: the admin under /admin/tierchain, the gateway everywhere else.

    The gateway is PreferBackend(Failover([Breaker(]Forwarder()[)])), all on ``store``.
    """
    forwarder = Forwarder()
    admin = Admin(routes=routes, store=store, **admin_opts)
    inner: Any = forwarder if breaker is None else Breaker(forwarder, store=store, **breaker)
    gateway = PreferBackend(Failover(inner, routes=routes), store=store)
    app = Starlette(routes=[Mount(MOUNT, admin), Mount("/", gateway)])
    return app, forwarder, admin


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}".strip()}


def events(caplog, name: str) -> list[dict[str, Any]]:
    return [r.tierchain for r in caplog.records if getattr(r, "event", "") == name]


PLACEHOLDER = Routes(
    {
        "echo": [Backend("tower", "http://127.0.0.1:1"), Backend("hosted", "http://127.0.0.1:2")],
        "meta/llama-3": [Backend("tower", "http://127.0.0.1:1")],
    }
)


@pytest.fixture
async def admin_url():
    """The base URL of a mounted admin (with token) over a fresh MemoryStore."""
    app, fwd, _ = host_app(PLACEHOLDER, MemoryStore(), token=TOKEN)
    async with serve(app) as url:
        yield url + MOUNT
    await fwd.aclose()


async def test_an_operator_pin_reaches_every_caller_until_it_is_removed(caplog):
    store = MemoryStore()
    async with (
        FakeBackend("tower", streams(["t"])) as tower,
        FakeBackend("hosted", streams(["h"])) as hosted,
    ):
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        app, fwd, _ = host_app(routes, store, token=TOKEN)
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            with caplog.at_level(logging.INFO, logger="tierchain"):
                put = await client.put(
                    f"{url}{MOUNT}/pins/echo",
                    json={"backend": "hosted", "ttl": 3600},
                    headers=auth(),
                )
                callers = [
                    await client.post(f"{url}/v1/chat/completions", content=chat_request())
                    for _ in range(2)
                ]
                listed = await client.get(f"{url}{MOUNT}/pins", headers=auth())
                one = await client.get(f"{url}{MOUNT}/pins/echo", headers=auth())
                removed = await client.delete(f"{url}{MOUNT}/pins/echo", headers=auth())
                again = await client.delete(f"{url}{MOUNT}/pins/echo", headers=auth())
                after = await client.post(f"{url}/v1/chat/completions", content=chat_request())
        await fwd.aclose()
    assert put.status_code == 200
    assert put.json()["backend"] == "hosted"
    assert put.json()["until"].endswith("Z")
    assert [r.headers["x-tierchain-backend"] for r in callers] == ["hosted", "hosted"]
    [pin] = listed.json()["pins"]
    assert pin["route"] == "echo"
    assert pin["backend"] == "hosted"
    assert 3590 < pin["remaining_s"] <= 3600
    assert one.json()["backend"] == "hosted"
    assert removed.json() == {"route": "echo", "removed": True, "backend": "hosted"}
    assert again.json() == {"route": "echo", "removed": False, "backend": None}
    assert after.headers["x-tierchain-backend"] == "tower"
    [pin_set] = events(caplog, "admin.pin_set")
    assert pin_set["route"] == "echo"
    assert pin_set["backend"] == "hosted"
    assert pin_set["until"] == put.json()["until"]
    [pin_removed] = events(caplog, "admin.pin_removed")
    assert (pin_removed["route"], pin_removed["backend"]) == ("echo", "hosted")


async def test_a_route_whose_name_has_a_slash_can_be_pinned(admin_url):
    async with httpx.AsyncClient(timeout=5) as client:
        put = await client.put(
            f"{admin_url}/pins/meta%2Fllama-3",
            json={"backend": "tower", "ttl": "30m"},
            headers=auth(),
        )
        listed = await client.get(f"{admin_url}/pins", headers=auth())
    assert put.status_code == 200, put.text
    assert put.json()["ttl_s"] == 1800
    assert listed.json()["pins"][0]["route"] == "meta/llama-3"


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/pins/nope", {"backend": "tower", "ttl": 60}, "unknown route 'nope'"),
        ("/pins/echo", {"backend": "hostd", "ttl": 60}, "unknown backend 'hostd'"),
        ("/pins/echo", {"ttl": 60}, '"backend" is required'),
        ("/pins/echo", {"backend": "hosted"}, "ttl is required"),
        ("/pins/echo", {"backend": "hosted", "ttl": 0.5}, "ttl must be between 1s and 7d"),
        ("/pins/echo", {"backend": "hosted", "ttl": 8 * 86400}, "ttl must be between"),
        ("/pins/echo", {"backend": "hosted", "ttl": "forever"}, "not a duration"),
        ("/pins/echo", {"backend": "hosted", "ttl": True}, "ttl is required"),
        ("/pins/echo", {"backend": "hosted", "ttl": "9" * 400}, "ttl must be between"),
    ],
)
async def test_an_unknown_route_backend_or_a_bad_ttl_is_422_naming_it(
    admin_url, path, body, needle
):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.put(admin_url + path, json=body, headers=auth())
        listed = await client.get(f"{admin_url}/pins", headers=auth())
    assert response.status_code == 422
    assert needle in response.json()["error"]["message"]
    assert listed.json() == {"pins": []}


@pytest.mark.parametrize("digits", ["9" * 400, "1" + "0" * 399, "-" + "9" * 400])
async def test_a_ttl_number_too_large_for_a_float_is_422_not_500(admin_url, digits):
    body = b'{"backend": "hosted", "ttl": ' + digits.encode() + b"}"
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.put(f"{admin_url}/pins/echo", content=body, headers=auth())
        listed = await client.get(f"{admin_url}/pins", headers=auth())
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_pin"
    assert "ttl must be between 1s and 7d" in response.json()["error"]["message"]
    assert listed.json() == {"pins": []}


async def test_deleting_a_pin_on_an_unknown_route_is_422(admin_url):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.delete(f"{admin_url}/pins/nope", headers=auth())
    assert response.status_code == 422
    assert "'nope'" in response.json()["error"]["message"]


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"\xff\xfe"])
async def test_a_malformed_body_is_400(admin_url, body):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.put(f"{admin_url}/pins/echo", content=body, headers=auth())
    assert response.status_code == 400


async def test_an_oversized_body_is_413(admin_url):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.put(
            f"{admin_url}/pins/echo", content=b"{" + b" " * 20_000 + b"}", headers=auth()
        )
    assert response.status_code == 413


ALMOST = [
    TOKEN[:-1],
    TOKEN + "x",
    TOKEN[:-1] + TOKEN[-1].upper() if TOKEN[-1].isalpha() else TOKEN[:-1] + "X",
    TOKEN.upper(),
    " " + TOKEN[1:],
    "",
]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/pins"), ("GET", "/pins/echo"), ("PUT", "/pins/echo"), ("DELETE", "/pins/echo")],
)
async def test_a_missing_token_is_401_with_www_authenticate(admin_url, method, path):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.request(
            method, admin_url + path, json={"backend": "hosted", "ttl": 60}
        )
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="tierchain"'


@pytest.mark.parametrize("token", ALMOST, ids=["short", "long", "case", "upper", "space", "empty"])
async def test_a_wrong_or_almost_right_token_is_401_and_changes_nothing(admin_url, token):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.put(
            f"{admin_url}/pins/echo", json={"backend": "hosted", "ttl": 60}, headers=auth(token)
        )
        listed = await client.get(f"{admin_url}/pins", headers=auth())
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="tierchain"'
    assert listed.json() == {"pins": []}


@pytest.mark.parametrize("scheme", ["Basic", "Token", ""])
async def test_the_right_token_under_another_scheme_is_401(admin_url, scheme):
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(
            f"{admin_url}/pins", headers={"Authorization": f"{scheme} {TOKEN}".strip()}
        )
    assert response.status_code == 401


async def test_the_token_never_appears_in_a_log_line(admin_url, caplog):
    with caplog.at_level(logging.DEBUG):
        async with httpx.AsyncClient(timeout=5) as client:
            for token in [TOKEN, *ALMOST]:
                await client.put(
                    f"{admin_url}/pins/echo",
                    json={"backend": "hosted", "ttl": 60},
                    headers=auth(token),
                )
            await client.post(f"{admin_url}/login", data={"token": TOKEN[:-1]})
            await client.post(f"{admin_url}/login", data={"token": TOKEN})
    assert events(caplog, "admin.auth_failed")
    assert events(caplog, "admin.pin_set")
    text = "\n".join(f"{r.getMessage()} {getattr(r, 'tierchain', '')}" for r in caplog.records)
    assert TOKEN[:16] not in text
    assert TOKEN[-16:] not in text


async def test_without_a_token_everything_is_404_and_the_log_says_so_once(caplog):
    with caplog.at_level(logging.WARNING, logger="tierchain"):
        app, fwd, admin = host_app(PLACEHOLDER, MemoryStore())
    assert not admin.enabled
    [disabled] = events(caplog, "admin.disabled")
    assert "no token" in disabled["message"]
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        responses = [
            await client.get(f"{url}{MOUNT}/"),
            await client.get(f"{url}{MOUNT}/pins", headers=auth()),
            await client.put(
                f"{url}{MOUNT}/pins/echo", json={"backend": "hosted", "ttl": 60}, headers=auth()
            ),
            await client.post(f"{url}{MOUNT}/login", data={"token": TOKEN}),
        ]
    await fwd.aclose()
    assert [r.status_code for r in responses] == [404] * 4
    assert len(events(caplog, "admin.disabled")) == 1


@pytest.mark.parametrize(
    "token", ["short", "has a space in it 0123", "x" * 600, "tökén-0123456789abc"]
)
def test_a_weak_or_unsendable_token_is_refused_without_echoing_it(token):
    with pytest.raises(ValueError, match="token must be") as info:
        Admin(routes=PLACEHOLDER, store=MemoryStore(), token=token)
    assert token not in str(info.value)


def test_admin_needs_a_store():
    with pytest.raises(ValueError, match="store="):
        Admin(routes=PLACEHOLDER, store=None, token=TOKEN)  # type: ignore[arg-type]


async def test_unknown_paths_are_404_and_wrong_methods_are_405(admin_url):
    async with httpx.AsyncClient(timeout=5) as client:
        missing = await client.get(f"{admin_url}/nothing-here", headers=auth())
        wrong = await client.patch(f"{admin_url}/pins/echo", headers=auth())
        page_post = await client.post(f"{admin_url}/", headers=auth())
    assert missing.status_code == 404
    assert wrong.status_code == 405
    assert "PUT" in wrong.headers["allow"]
    assert page_post.status_code == 405


class DownStore(MemoryStore):
    """A store whose writes fail, the way RedisStore's do while Redis is away."""

    async def set_pin(self, route: str, backend: str, ttl: float) -> float:
        raise ConnectionError("the pin was not set: Redis at redis://127.0.0.1:1 is unreachable")

    async def delete_pin(self, route: str) -> bool:
        raise ConnectionError("the pin was not removed: Redis is unreachable")


async def test_a_store_that_cannot_write_is_503_saying_nothing_changed(caplog):
    app, fwd, _ = host_app(PLACEHOLDER, DownStore(), token=TOKEN)
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        with caplog.at_level(logging.ERROR, logger="tierchain"):
            put = await client.put(
                f"{url}{MOUNT}/pins/echo", json={"backend": "hosted", "ttl": 60}, headers=auth()
            )
            delete = await client.delete(f"{url}{MOUNT}/pins/echo", headers=auth())
    await fwd.aclose()
    assert [put.status_code, delete.status_code] == [503, 503]
    assert "nothing was changed" in put.json()["error"]["message"]
    assert "unreachable" in put.json()["error"]["message"]
    assert len(events(caplog, "admin.store_unavailable")) == 2
    assert events(caplog, "admin.pin_set") == []


async def test_every_error_answer_says_no_store():
    routes, pin = PLACEHOLDER, {"backend": "hosted", "ttl": 60}
    app, fwd, _ = host_app(routes, MemoryStore(), token=TOKEN, max_body=1024)
    down_app, down_fwd, _ = host_app(routes, DownStore(), token=TOKEN)
    off_app, off_fwd, _ = host_app(routes, MemoryStore())
    async with (
        serve(app) as url,
        serve(down_app) as down_url,
        serve(off_app) as off_url,
        httpx.AsyncClient(timeout=5) as client,
    ):
        base, down, off = url + MOUNT, down_url + MOUNT, off_url + MOUNT
        answers = {
            400: await client.put(f"{base}/pins/echo", content=b"{not json", headers=auth()),
            401: await client.put(f"{base}/pins/echo", json=pin),
            "401 page": await client.get(f"{base}/"),
            403: await client.post(
                f"{base}/login", data={"token": TOKEN}, headers={"origin": "https://evil.example"}
            ),
            404: await client.get(f"{base}/nothing-here", headers=auth()),
            "404 off": await client.get(f"{off}/pins", headers=auth()),
            405: await client.patch(f"{base}/pins/echo", headers=auth()),
            413: await client.put(f"{base}/pins/echo", content=b" " * 2048, headers=auth()),
            422: await client.put(f"{base}/pins/nope", json=pin, headers=auth()),
            "422 ttl": await client.put(
                f"{base}/pins/echo",
                content=b'{"backend":"hosted","ttl":' + b"9" * 400 + b"}",
                headers=auth(),
            ),
            503: await client.put(f"{down}/pins/echo", json=pin, headers=auth()),
        }
    for fwd_ in (fwd, down_fwd, off_fwd):
        await fwd_.aclose()
    for expected, response in answers.items():
        assert response.status_code == int(str(expected)[:3]), (expected, response.text)
        assert response.headers.get("cache-control") == "no-store", expected


@pytest.mark.redis
async def test_a_pin_set_on_one_replica_applies_on_another_through_redis(redis_server):
    from tierchain import RedisStore

    async with (
        FakeBackend("tower", streams(["t"])) as tower,
        FakeBackend("hosted", streams(["h"])) as hosted,
        RedisStore(redis_server.url) as store_a,
        RedisStore(redis_server.url) as store_b,
    ):
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        app_a, fwd_a, _ = host_app(routes, store_a, token=TOKEN)
        app_b, fwd_b, _ = host_app(routes, store_b, token=TOKEN)
        async with (
            serve(app_a) as url_a,
            serve(app_b) as url_b,
            httpx.AsyncClient(timeout=5) as client,
        ):
            before = await client.post(f"{url_b}/v1/chat/completions", content=chat_request())
            put = await client.put(
                f"{url_a}{MOUNT}/pins/echo", json={"backend": "hosted", "ttl": 600}, headers=auth()
            )
            on_b = await client.post(f"{url_b}/v1/chat/completions", content=chat_request())
            listed_b = await client.get(f"{url_b}{MOUNT}/pins", headers=auth())
            removed_b = await client.delete(f"{url_b}{MOUNT}/pins/echo", headers=auth())
            on_a = await client.post(f"{url_a}/v1/chat/completions", content=chat_request())
        await fwd_a.aclose()
        await fwd_b.aclose()
    assert before.headers["x-tierchain-backend"] == "tower"
    assert put.status_code == 200
    assert on_b.headers["x-tierchain-backend"] == "hosted"
    [pin] = listed_b.json()["pins"]
    assert (pin["route"], pin["backend"]) == ("echo", "hosted")
    assert 590 < pin["remaining_s"] <= 600
    assert removed_b.json()["removed"] is True
    assert on_a.headers["x-tierchain-backend"] == "tower"
