"""The operator page: log in, pin, see it listed, unpin; safe against forged forms."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tierchain import Backend, Routes
from tierchain.store import MemoryStore

from .support import FakeBackend, chat_request, refused_url, serve, streams
from .test_admin import MOUNT, TOKEN, auth, host_app

SHOTS = os.environ.get("TIERCHAIN_SCREENSHOTS")


@pytest.mark.chromium
async def test_an_operator_logs_in_pins_sees_it_listed_and_unpins(browser):
    store = MemoryStore()
    async with FakeBackend("hosted", streams(["h"])) as hosted:
        routes = Routes(
            {
                "echo": [
                    Backend("tower", refused_url(), regime="local"),
                    Backend("hosted", hosted.url, regime="hosted"),
                ],
                "deep": [Backend("hosted", hosted.url, regime="hosted")],
            }
        )
        breaker = {"failure_threshold": 1, "failure_cooldown": 90.0, "probe_every": 0}
        app, fwd, _ = host_app(routes, store, token=TOKEN, breaker=breaker)
        async with serve(app) as url:
            async with httpx.AsyncClient(timeout=5) as client:  # tower refuses: its breaker opens
                first = await client.post(f"{url}/v1/chat/completions", content=chat_request())
            assert first.headers["x-tierchain-backend"] == "hosted"
            context = await browser.new_context()
            context.set_default_timeout(5000)
            page = await context.new_page()
            try:
                await page.goto(f"{url}{MOUNT}/")
                await page.fill("#token", TOKEN)
                await page.click("text=Log in")
                echo = page.locator('section[data-route="echo"]')
                await echo.wait_for()
                tower_row = echo.locator('tr[data-backend="tower"]')
                assert "open" in await tower_row.locator("td.breaker").inner_text()
                assert re.search(r"1m (2\d|30)s", await tower_row.inner_text())
                hosted_row = echo.locator('tr[data-backend="hosted"]')
                assert "closed" in await hosted_row.locator("td.breaker").inner_text()
                assert await page.locator("#pins tr.empty").count() == 1

                await echo.locator('select[name="backend"]').select_option("hosted")
                await echo.locator('input[name="ttl"]').fill("2h")
                await echo.locator("form.pin-form button").click()
                row = page.locator('#pins tr[data-route="echo"]')
                await row.wait_for()
                assert "hosted" in await row.inner_text()
                assert re.search(r"1h 59m|2h", await row.inner_text())
                if SHOTS:
                    await page.screenshot(
                        path=str(Path(SHOTS) / "admin-pinned.png"), full_page=True
                    )
                assert (await store.list_pins())["echo"][0] == "hosted"
                async with httpx.AsyncClient(timeout=5) as client:
                    caller = await client.post(f"{url}/v1/chat/completions", content=chat_request())
                # pinned: hosted goes first, so the open tower is not even skipped
                assert caller.headers["x-tierchain-attempts"] == "hosted;outcome=ok"

                await echo.locator("form.unpin-form button").click()
                await page.locator("#pins tr.empty").wait_for()
                assert await store.list_pins() == {}
                cookies = await context.cookies()
            finally:
                await context.close()
        await fwd.aclose()
    [cookie] = cookies
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert cookie["path"] == MOUNT
    assert TOKEN not in cookie["value"]


@pytest.mark.chromium
async def test_a_wrong_token_in_the_login_form_is_refused(browser):
    app, fwd, _ = host_app(_routes(), MemoryStore(), token=TOKEN)
    async with serve(app) as url:
        page = await browser.new_page()
        page.set_default_timeout(5000)
        try:
            await page.goto(f"{url}{MOUNT}/")
            await page.fill("#token", TOKEN[:-1])
            await page.click("text=Log in")
            await page.locator(".error").wait_for()
            assert await page.locator('section[data-route="echo"]').count() == 0
        finally:
            await page.close()
    await fwd.aclose()


# -- the page without a browser: login, cookies, CSRF, escaping ---------------------


def _routes() -> Routes:
    return Routes(
        {
            "echo": [
                Backend("tower", "http://127.0.0.1:1"),
                Backend("hosted", "http://127.0.0.1:2"),
            ],
            "<script>alert(1)</script>": [Backend("x", "http://127.0.0.1:3", regime='"><b>')],
        }
    )


async def _login(client: httpx.AsyncClient, base: str) -> str:
    """Log in through the form; returns the page's CSRF token."""
    response = await client.post(f"{base}/login", data={"token": TOKEN})
    assert response.status_code == 303
    assert response.headers["location"] == f"{MOUNT}/"
    page = await client.get(f"{base}/")
    assert page.status_code == 200
    match = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert match is not None
    return match[1]


@pytest.fixture
async def page_app():
    store = MemoryStore()
    app, fwd, admin = host_app(_routes(), store, token=TOKEN)
    async with serve(app) as url:
        yield url + MOUNT, store, admin
    await fwd.aclose()


async def test_the_page_without_a_session_is_a_401_login_form(page_app):
    base, _, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"{base}/")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == 'Bearer realm="tierchain"'
    assert f'action="{MOUNT}/login"' in response.text
    assert "<section" not in response.text


async def test_a_bearer_client_can_read_the_page_but_gets_no_forms(page_app):
    base, _, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"{base}/", headers=auth())
    assert response.status_code == 200
    assert "<section" in response.text
    assert "<form" not in response.text


async def test_the_session_cookie_is_scoped_httponly_strict_and_not_the_token(page_app):
    base, _, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.post(f"{base}/login", data={"token": TOKEN})
    cookie = response.headers["set-cookie"]
    assert f"Path={MOUNT};" in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    assert TOKEN not in cookie


async def test_everything_on_the_page_is_escaped(page_app):
    base, _, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        await _login(client, base)
        page = await client.get(f"{base}/")
    assert "<script>" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    assert '"><b>' not in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "script-src" not in csp  # no script may run at all


async def test_a_form_without_the_csrf_token_is_refused(page_app):
    base, store, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        await _login(client, base)
        missing = await client.post(
            f"{base}/pin", data={"route": "echo", "backend": "hosted", "ttl": "1h"}
        )
        wrong = await client.post(
            f"{base}/pin",
            data={"route": "echo", "backend": "hosted", "ttl": "1h", "csrf": "x" * 43},
        )
    assert missing.status_code == 403
    assert wrong.status_code == 403
    assert await store.list_pins() == {}


async def test_a_form_from_another_origin_is_refused_even_with_the_csrf_token(page_app):
    base, store, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        csrf = await _login(client, base)
        form = {"route": "echo", "backend": "hosted", "ttl": "1h", "csrf": csrf}
        forged = await client.post(
            f"{base}/pin", data=form, headers={"Origin": "https://evil.example"}
        )
        null = await client.post(f"{base}/pin", data=form, headers={"Origin": "null"})
        cross = await client.post(
            f"{base}/pin", data=form, headers={"Sec-Fetch-Site": "cross-site"}
        )
        assert await store.list_pins() == {}
        good = await client.post(f"{base}/pin", data=form, headers={"Origin": base.split(MOUNT)[0]})
    assert [forged.status_code, null.status_code, cross.status_code] == [403, 403, 403]
    assert good.status_code == 303
    assert (await store.list_pins())["echo"][0] == "hosted"


async def test_a_form_without_a_session_gets_the_login_form(page_app):
    base, store, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        csrf = await _login(client, base)
        client.cookies.clear()
        response = await client.post(
            f"{base}/pin", data={"route": "echo", "backend": "hosted", "ttl": "1h", "csrf": csrf}
        )
    assert response.status_code == 401
    assert await store.list_pins() == {}


async def test_an_expired_session_no_longer_works():
    now = [1_000_000.0]
    app, fwd, _ = host_app(_routes(), MemoryStore(), token=TOKEN, clock=lambda: now[0])
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        base = url + MOUNT
        await _login(client, base)
        now[0] += 12 * 3600 + 1
        page = await client.get(f"{base}/")
    await fwd.aclose()
    assert page.status_code == 401


async def test_a_forged_session_cookie_is_refused(page_app):
    base, _, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        await client.post(f"{base}/login", data={"token": TOKEN})
        real = next(iter(client.cookies.jar)).value
        issued, nonce, mac = real.split(".")
        forgeries = [
            f"{int(issued) + 3600}.{nonce}.{mac}".encode(),
            f"{issued}.{nonce}x.{mac}".encode(),
            f"{issued}.{nonce}.{mac[:-1]}{'B' if mac.endswith('A') else 'A'}".encode(),
            f"{issued}.{nonce}.".encode() + b"\xc3\xa9",
            TOKEN.encode(),
        ]
        client.cookies.clear()
        statuses = []
        for forged in forgeries:
            headers = {"cookie": b"tierchain_admin=" + forged}
            statuses.append((await client.get(f"{base}/", headers=headers)).status_code)
        headers = {"cookie": b"tierchain_admin=" + real.encode()}
        assert (await client.get(f"{base}/", headers=headers)).status_code == 200
    assert statuses == [401] * len(forgeries)


@pytest.mark.parametrize(
    ("form", "needle"),
    [
        ({"route": "echo", "backend": "nope", "ttl": "1h"}, "unknown backend &#x27;nope&#x27;"),
        ({"route": "nope", "backend": "hosted", "ttl": "1h"}, "unknown route &#x27;nope&#x27;"),
        ({"route": "echo", "backend": "hosted", "ttl": "9d"}, "ttl must be between"),
    ],
)
async def test_a_bad_pin_form_renders_the_page_with_a_422_naming_the_problem(
    page_app, form, needle
):
    base, store, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        csrf = await _login(client, base)
        response = await client.post(f"{base}/pin", data={**form, "csrf": csrf})
    assert response.status_code == 422
    assert needle in response.text
    assert await store.list_pins() == {}


async def test_logging_out_clears_the_cookie(page_app):
    base, _, _ = page_app
    async with httpx.AsyncClient(timeout=5) as client:
        csrf = await _login(client, base)
        out = await client.post(f"{base}/logout", data={"csrf": csrf})
        page = await client.get(f"{base}/")
    assert out.status_code == 303
    assert "Max-Age=0" in out.headers["set-cookie"]
    assert page.status_code == 401


async def test_the_page_shows_unknown_when_the_store_has_no_breaker_view():
    class PinsOnly:
        def __init__(self) -> None:
            self.inner = MemoryStore()

        def __getattr__(self, name: str) -> Any:
            if name == "breaker_snapshot":
                raise AttributeError(name)
            return getattr(self.inner, name)

    app, fwd, _ = host_app(_routes(), PinsOnly(), token=TOKEN)
    async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
        page = await client.get(f"{url}{MOUNT}/", headers=auth())
    await fwd.aclose()
    assert page.status_code == 200
    assert page.text.count('class="breaker unknown"') == 3


async def test_mounted_at_the_root_the_links_still_work():
    from tierchain import Admin

    admin = Admin(routes=_routes(), store=MemoryStore(), token=TOKEN)
    async with serve(admin) as url, httpx.AsyncClient(timeout=5) as client:
        login = await client.get(f"{url}/")
        posted = await client.post(f"{url}/login", data={"token": TOKEN})
    assert 'action="/login"' in login.text
    assert posted.headers["location"] == "/"
    assert "Path=/;" in posted.headers["set-cookie"]


async def test_a_slow_page_render_does_not_block_the_api():
    # The page asks the store for every breaker; a store that hangs bounds it.
    class SlowBreakers(MemoryStore):
        async def breaker_snapshot(self, route: str, backend: str) -> Any:
            await asyncio.sleep(10)

    import tierchain.admin.app as admin_module

    app, fwd, _ = host_app(_routes(), SlowBreakers(), token=TOKEN)
    old = admin_module._SNAPSHOT_TIMEOUT
    admin_module._SNAPSHOT_TIMEOUT = 0.05
    try:
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            page = await client.get(f"{url}{MOUNT}/", headers=auth())
    finally:
        admin_module._SNAPSHOT_TIMEOUT = old
    await fwd.aclose()
    assert page.status_code == 200
    assert 'class="breaker unknown"' in page.text
