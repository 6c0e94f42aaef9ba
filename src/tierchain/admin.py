"""Admin: the operator's ASGI app for pins, with one server-rendered page.

Mount it where you like (``app.mount("/admin/tierchain", admin)`` in FastAPI
or Starlette); every link and form action is built from ``scope["root_path"]``.
It is off unless a token is configured: without one it answers 404 to
everything and says so once in the log when it is built.

Paths, relative to the mount::

    GET    /                 the operator page (session cookie or bearer token)
    POST   /login            form: token -> session cookie, redirect to the page
    POST   /logout           form: clear the session cookie
    POST   /pin              form: route, backend, ttl (CSRF-protected)
    POST   /unpin            form: route (CSRF-protected)
    GET    /pins             JSON: every live pin with its remaining time
    GET    /pins/{route}     JSON: one route's pin (backend null when none)
    PUT    /pins/{route}     JSON body {"backend": "...", "ttl": seconds}: pin
    POST   /pins/{route}     the same as PUT
    DELETE /pins/{route}     JSON: remove the pin

The JSON API takes ``Authorization: Bearer <token>`` only, compared in constant
time; a missing or wrong token gets 401 with ``WWW-Authenticate: Bearer
realm="tierchain"``. A browser cannot send that header from a plain form, so
the page has a login form: it posts the token once and gets back a session
cookie (``HttpOnly``, ``SameSite=Strict``, scoped to the mount's path,
``Secure`` over https) whose value is an expiring nonce signed with a key
derived from the token, never the token itself. Every form that changes
something carries a CSRF token derived from the session (checked with
``hmac.compare_digest``) and must come from this origin (``Origin`` or
``Sec-Fetch-Site``). The token never appears in a log line.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import html
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from ._body import CallerGone, read_body
from ._responses import header, send_json_error
from ._types import Headers, Message, Receive, Scope, Send
from .backend import Backend, Routes
from .errors import BodyTooLarge
from .masking import mask_text
from .store import Store
from .telemetry import log_event

__all__ = ["Admin"]

T = TypeVar("T")

MIN_TTL = 1.0
"""The shortest pin, in seconds."""

COOKIE = "tierchain_admin"
_REALM = b'Bearer realm="tierchain"'
_TOKEN = re.compile(r"[\x21-\x7e]{16,512}")
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", re.IGNORECASE)
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SNAPSHOT_TIMEOUT = 1.0


class _StoreDown(Exception):
    """The store failed a pin operation: answered 503."""


class _Invalid(ValueError):
    """A request the operator must correct: answered 422 (or 400) with its message."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def parse_ttl(value: object, max_ttl: float) -> float:
    """A pin's lifetime in seconds, from a number or a duration like ``90s``, ``30m``, ``4h``."""
    if isinstance(value, bool) or value is None:
        raise _Invalid("ttl is required: seconds as a number, or a duration such as 30m, 4h, 2d")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION.fullmatch(value)
        if match is None:
            shown = value if len(value) <= 32 else value[:32] + "..."
            raise _Invalid(f"ttl {shown!r} is not a duration such as 90, 90s, 30m, 4h or 2d")
        seconds = float(match[1]) * _UNITS[match[2].lower()]
    else:
        raise _Invalid("ttl must be seconds as a number, or a duration such as 30m, 4h, 2d")
    if not math.isfinite(seconds) or not MIN_TTL <= seconds <= max_ttl:
        raise _Invalid(
            f"ttl must be between {_duration(MIN_TTL)} and {_duration(max_ttl)}, "
            f"got {seconds:g} seconds"
        )
    return seconds


def _duration(seconds: float) -> str:
    """``3h 59m``, ``45s``, ``2d 3h``: a remaining time as an operator reads it."""
    s = max(0, math.ceil(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (s, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n][:2]
    return " ".join(shown) or "0s"


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _shown(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


class Admin:
    """The operator's app: pins over a JSON API and one server-rendered page.

    ``routes`` is the same :class:`~tierchain.Routes` the Failover uses;
    ``store`` the same store PreferBackend (and the breaker) use, so a pin set
    here reorders what callers get. ``token`` turns the app on (at least 16
    printable ASCII characters); without it everything answers 404. ``max_ttl``
    bounds a pin's lifetime (default 7 days; the minimum is 1 s).
    ``session_ttl`` bounds a page login (default 12 h). ``allowed_origins``
    lists extra origins (``https://ops.example``) whose forms are accepted when
    a proxy makes the browser's origin differ from the ``Host`` header.
    ``max_body`` bounds a request body (default 16 KiB).
    """

    def __init__(
        self,
        *,
        routes: Routes | Mapping[str, Any],
        store: Store,
        token: str | None = None,
        max_ttl: float = 7 * 86400.0,
        session_ttl: float = 12 * 3600.0,
        allowed_origins: Collection[str] = (),
        max_body: int = 16 * 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.routes = routes if isinstance(routes, Routes) else Routes(routes)
        if store is None:
            raise ValueError("Admin needs store=: pass the same store PreferBackend uses")
        self.store = store
        if not MIN_TTL <= max_ttl < math.inf:
            raise ValueError(f"max_ttl must be a finite number of seconds >= 1, got {max_ttl!r}")
        if not 60 <= session_ttl < math.inf:
            raise ValueError(f"session_ttl must be at least 60 seconds, got {session_ttl!r}")
        if max_body < 1024:
            raise ValueError(f"max_body must be at least 1024 bytes, got {max_body!r}")
        self.max_ttl = float(max_ttl)
        self.session_ttl = float(session_ttl)
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self.max_body = int(max_body)
        self.clock = clock
        self._token: bytes | None = None
        self._session_key = b""
        if token is None or token == "":
            log_event(
                "admin.disabled",
                logging.WARNING,
                message="tierchain Admin is off because no token is configured: "
                "it answers 404 to every request.",
            )
        elif not isinstance(token, str) or not _TOKEN.fullmatch(token):
            length = len(token) if isinstance(token, str) else 0
            raise ValueError(
                "token must be 16 to 512 printable ASCII characters without spaces "
                f"(got {length} characters)"
            )
        else:
            self._token = token.encode("ascii")
            self._session_key = hmac.new(
                self._token, b"tierchain-admin-session-v1", hashlib.sha256
            ).digest()

    @property
    def enabled(self) -> bool:
        """True when a token is configured."""
        return self._token is not None

    def __repr__(self) -> str:
        return f"Admin(routes={self.routes!r}, enabled={self.enabled})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        if self._token is None:
            return await _text(send, 404, "Not Found")
        await _Call(self, scope, receive, send).run()

    # -- sessions ------------------------------------------------------------

    def _new_session(self) -> str:
        payload = f"{int(self.clock())}.{secrets.token_urlsafe(18)}"
        return f"{payload}.{self._sign(b'session:' + payload.encode())}"

    def _valid_session(self, value: str) -> bool:
        payload, _, mac = value.rpartition(".")
        issued, _, nonce = payload.partition(".")
        if not (issued.isdigit() and nonce and mac):
            return False
        expected = self._sign(b"session:" + payload.encode()).encode()
        if not hmac.compare_digest(mac.encode("utf-8", "replace"), expected):
            return False
        age = self.clock() - int(issued)
        return -60 <= age < self.session_ttl

    def _csrf(self, session: str) -> str:
        return self._sign(b"csrf:" + session.encode())

    def _sign(self, message: bytes) -> str:
        mac = hmac.new(self._session_key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def _token_ok(self, presented: bytes) -> bool:
        assert self._token is not None
        return hmac.compare_digest(presented, self._token)


class _Call:
    """One request to the admin app."""

    def __init__(self, admin: Admin, scope: Scope, receive: Receive, send: Send) -> None:
        self.admin = admin
        self.scope = scope
        self.receive = receive
        self._send = send
        self.headers: Headers = list(scope.get("headers", ()))
        self.root: str = scope.get("root_path", "") or ""
        path: str = scope["path"]
        if self.root and path.startswith(self.root):
            path = path[len(self.root) :]
        self.path = path
        self.method: str = scope["method"]
        client = scope.get("client")
        self.client = client[0] if client else None

    # -- dispatch --------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._dispatch()
        except _StoreDown as exc:
            log_event(
                "admin.store_unavailable", logging.ERROR, path=_shown(self.path), error=str(exc)
            )
            message = f"the pin store is unavailable, nothing was changed: {exc}"
            if self.path.startswith("/pins"):
                await send_json_error(
                    self._send, 503, message, "store_unavailable", "service_unavailable"
                )
            else:
                await _text(self._send, 503, message)

    async def _store(self, op: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Call a store method; any failure becomes :class:`_StoreDown` (answered 503)."""
        try:
            return await op(*args)
        except Exception as exc:
            raise _StoreDown(mask_text(str(exc) or repr(exc))) from exc

    async def _dispatch(self) -> None:
        path, method = self.path, self.method
        if path in ("", "/"):
            if method != "GET":
                return await self._not_allowed("GET")
            return await self._page()
        if path in ("/login", "/logout", "/pin", "/unpin"):
            if method != "POST":
                return await self._not_allowed("POST")
            return await self._form(path[1:])
        if path == "/pins":
            if method != "GET":
                return await self._not_allowed("GET")
            if await self._bearer():
                await self._api_list()
            return None
        if path.startswith("/pins/") and len(path) > len("/pins/"):
            route = path[len("/pins/") :]
            if method not in ("GET", "PUT", "POST", "DELETE"):
                return await self._not_allowed("GET, PUT, POST, DELETE")
            if await self._bearer():
                await self._api_pin(route)
            return None
        await _text(self._send, 404, "Not Found")

    async def _not_allowed(self, allow: str) -> None:
        await _text(self._send, 405, "Method Not Allowed", [(b"allow", allow.encode())])

    # -- authentication ------------------------------------------------------

    def _presented_bearer(self) -> bytes | None:
        value = header(self.headers, b"authorization")
        if value is None:
            return None
        scheme, _, credentials = value.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return b""
        return credentials.strip()

    async def _bearer(self) -> bool:
        """True when the bearer token is right; otherwise answers 401 and says why in the log."""
        presented = self._presented_bearer()
        if presented and self.admin._token_ok(presented):
            return True
        reason = "missing" if presented is None else "wrong"
        self._auth_failed(reason)
        await send_json_error(
            self._send,
            401,
            "a bearer token is required: Authorization: Bearer <token>"
            if reason == "missing"
            else "the bearer token is not the configured token",
            "authentication_error",
            "unauthorized",
            headers=[(b"www-authenticate", _REALM), (b"cache-control", b"no-store")],
        )
        return False

    def _auth_failed(self, reason: str) -> None:
        log_event(
            "admin.auth_failed",
            logging.WARNING,
            reason=reason,
            method=self.method,
            path=_shown(self.path),
            client=self.client,
        )

    def _session(self) -> str | None:
        """The request's valid session value, or None."""
        for key, value in self.headers:
            if key.lower() != b"cookie":
                continue
            for part in value.decode("latin-1").split(";"):
                name, _, content = part.strip().partition("=")
                if name == COOKIE and self.admin._valid_session(content):
                    return content
        return None

    def _same_origin(self) -> bool:
        origin = header(self.headers, b"origin")
        if origin is not None:
            text = origin.decode("latin-1").strip().rstrip("/").lower()
            if text in self.admin.allowed_origins:
                return True
            host = header(self.headers, b"host")
            try:
                netloc = urlsplit(text).netloc
            except ValueError:
                return False
            return host is not None and bool(netloc) and netloc == host.decode("latin-1").lower()
        site = header(self.headers, b"sec-fetch-site")
        return site is None or site in (b"same-origin", b"none")

    # -- the JSON API --------------------------------------------------------------

    async def _api_list(self) -> None:
        pins = await self._store(self.admin.store.list_pins)
        now = self.admin.clock()
        await _json(
            self._send,
            200,
            {
                "pins": [
                    {
                        "route": route,
                        "backend": backend,
                        "remaining_s": round(remaining, 3),
                        "until": _iso(now + remaining),
                    }
                    for route, (backend, remaining) in sorted(pins.items())
                ]
            },
        )

    async def _api_pin(self, route: str) -> None:
        try:
            self._check_route(route)
        except _Invalid as exc:
            return await self._api_invalid(exc)
        if self.method == "GET":
            pins = await self._store(self.admin.store.list_pins)
            backend, remaining = pins.get(route, (None, 0.0))
            body: dict[str, Any] = {"route": route, "backend": backend}
            if backend is not None:
                body["remaining_s"] = round(remaining, 3)
                body["until"] = _iso(self.admin.clock() + remaining)
            return await _json(self._send, 200, body)
        if self.method == "DELETE":
            removed, previous = await self._unpin(route, via="api")
            return await _json(
                self._send, 200, {"route": route, "removed": removed, "backend": previous}
            )
        raw = await self._body()
        if raw is None:
            return None
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            return await self._api_invalid(_Invalid(f"the body is not valid JSON ({exc})", 400))
        if not isinstance(data, dict):
            return await self._api_invalid(
                _Invalid('the body must be a JSON object: {"backend": "...", "ttl": seconds}', 400)
            )
        try:
            backend = data.get("backend")
            if not isinstance(backend, str):
                raise _Invalid('"backend" is required: the name of a backend in the route\'s chain')
            self._check_backend(route, backend)
            ttl = parse_ttl(data.get("ttl"), self.admin.max_ttl)
        except _Invalid as exc:
            return await self._api_invalid(exc)
        until = await self._pin(route, backend, ttl, via="api")
        await _json(
            self._send,
            200,
            {"route": route, "backend": backend, "ttl_s": ttl, "until": _iso(until)},
        )

    async def _api_invalid(self, exc: _Invalid) -> None:
        await send_json_error(
            self._send,
            exc.status,
            str(exc),
            "invalid_request_error",
            "invalid_pin" if exc.status == 422 else "invalid_body",
        )

    async def _body(self) -> bytes | None:
        """The request body, or None after answering 413 (or when the caller left)."""
        try:
            return await read_body(self.scope, self.receive, self.admin.max_body)
        except BodyTooLarge:
            await _text(self._send, 413, f"Request body larger than {self.admin.max_body} bytes")
        except CallerGone:
            pass
        return None

    # -- pins ----------------------------------------------------------------

    def _check_route(self, route: str) -> None:
        if route not in self.admin.routes:
            known = ", ".join(sorted(self.admin.routes))
            raise _Invalid(f"unknown route {_shown(route)!r}; known routes: {known}")

    def _check_backend(self, route: str, backend: str) -> None:
        if self.admin.routes.backend(route, backend) is None:
            names = ", ".join(b.name for b in self.admin.routes[route])
            raise _Invalid(
                f"unknown backend {_shown(backend)!r} for route {route!r}; its chain is: {names}"
            )

    async def _pin(self, route: str, backend: str, ttl: float, *, via: str) -> float:
        until = await self._store(self.admin.store.set_pin, route, backend, ttl)
        log_event(
            "admin.pin_set",
            route=route,
            backend=backend,
            until=_iso(until),
            ttl_s=ttl,
            via=via,
            client=self.client,
        )
        return until

    async def _unpin(self, route: str, *, via: str) -> tuple[bool, str | None]:
        """Remove ``route``'s pin: (whether there was one, the backend it named)."""
        previous = await self._store(self.admin.store.get_pin, route)
        removed = await self._store(self.admin.store.delete_pin, route)
        if removed:
            log_event(
                "admin.pin_removed",
                route=route,
                backend=previous,
                until=_iso(self.admin.clock()),
                via=via,
                client=self.client,
            )
        return removed, previous

    # -- the page and its forms ------------------------------------------------

    async def _page(self) -> None:
        session = self._session()
        if session is None:
            presented = self._presented_bearer()
            if presented and self.admin._token_ok(presented):
                session = ""  # a bearer client can read the page; forms need a login
            else:
                if presented is not None:
                    self._auth_failed("wrong")
                return await self._login_page()
        await self._render(session)

    async def _login_page(self, message: str | None = None) -> None:
        root = html.escape(self.root, quote=True)
        note = f'<p class="error" role="alert">{html.escape(message)}</p>' if message else ""
        body = (
            "<h1>tierchain operator</h1>"
            f"{note}"
            f'<form method="post" action="{root}/login" class="login">'
            '<label for="token">Admin token</label> '
            '<input id="token" name="token" type="password" autocomplete="current-password" '
            'required autofocus> <button type="submit">Log in</button></form>'
        )
        await _html(
            self._send, 401, _document("tierchain: log in", body), [(b"www-authenticate", _REALM)]
        )

    async def _form(self, action: str) -> None:
        if not self._same_origin():
            log_event(
                "admin.cross_site_refused",
                logging.WARNING,
                action=action,
                origin=_shown((header(self.headers, b"origin") or b"").decode("latin-1")),
                client=self.client,
            )
            return await _text(self._send, 403, "Cross-site request refused")
        raw = await self._body()
        if raw is None:
            return None
        form = _parse_form(raw)
        if form is None:
            return await _text(self._send, 400, "Malformed form body")
        if action == "login":
            token = form.get("token", "").encode("utf-8", "replace")
            if not token or not self.admin._token_ok(token):
                self._auth_failed("missing" if not token else "wrong")
                return await self._login_page("That is not the admin token.")
            log_event("admin.login", client=self.client)
            fresh = self.admin._new_session()
            return await self._redirect(self._cookie(fresh, self.admin.session_ttl))
        session = self._session()
        if session is None:
            self._auth_failed("no_session")
            return await self._login_page("Log in first (or again: the session expired).")
        presented = form.get("csrf", "").encode("utf-8", "replace")
        if not hmac.compare_digest(presented, self.admin._csrf(session).encode()):
            log_event("admin.csrf_refused", logging.WARNING, action=action, client=self.client)
            return await _text(
                self._send, 403, "Cross-site request refused: stale or missing form token"
            )
        if action == "logout":
            return await self._redirect(self._cookie("", 0))
        route = form.get("route", "")
        try:
            self._check_route(route)
            if action == "pin":
                backend = form.get("backend", "")
                self._check_backend(route, backend)
                ttl = parse_ttl(form.get("ttl", ""), self.admin.max_ttl)
                await self._pin(route, backend, ttl, via="page")
            else:
                await self._unpin(route, via="page")
        except _Invalid as exc:
            return await self._render(session, error=str(exc), status=422)
        await self._redirect()

    def _cookie(self, value: str, max_age: float) -> tuple[bytes, bytes]:
        path = self.root or "/"
        parts = [
            f"{COOKIE}={value}",
            f"Path={path}",
            f"Max-Age={int(max_age)}",
            "HttpOnly",
            "SameSite=Strict",
        ]
        if self.scope.get("scheme") == "https":
            parts.append("Secure")
        return (b"set-cookie", "; ".join(parts).encode("latin-1"))

    async def _redirect(self, *extra: tuple[bytes, bytes]) -> None:
        location = (self.root or "") + "/"
        await self._send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode("latin-1")),
                    (b"content-length", b"0"),
                    (b"cache-control", b"no-store"),
                    *extra,
                ],
            }
        )
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _render(self, session: str, *, error: str | None = None, status: int = 200) -> None:
        admin = self.admin
        pins = await self._store(admin.store.list_pins)
        now = admin.clock()
        root = html.escape(self.root, quote=True)
        csrf = html.escape(admin._csrf(session), quote=True) if session else ""
        esc = html.escape
        out: list[str] = ["<header><h1>tierchain operator</h1>"]
        if session:
            out.append(
                f'<form method="post" action="{root}/logout" class="logout">'
                f'<input type="hidden" name="csrf" value="{csrf}">'
                '<button type="submit">Log out</button></form>'
            )
        out.append("</header>")
        out.append(
            "<p>A pin moves a backend to the front of a route's chain for every caller until "
            "it expires. Nothing is removed from a chain: if the pinned backend fails, the "
            "others still follow. A caller's own X-Prefer-Backend header goes before a pin.</p>"
        )
        if error:
            out.append(f'<p class="error" role="alert">{esc(error)}</p>')
        if getattr(admin.store, "degraded", False) is True:
            out.append(
                '<p class="error" role="status">The shared store is unreachable: this replica '
                "is serving from its local fallback, so what you see here may differ from "
                "the other replicas, and pins cannot be changed until it is back.</p>"
            )
        out.append("<h2>Routes</h2>")
        for route, chain in admin.routes.items():
            pinned = pins.get(route)
            out.append(f'<section class="route" data-route="{esc(route, quote=True)}">')
            title = f"<h3>{esc(route)}"
            if pinned:
                title += (
                    f' <span class="pin">pinned to {esc(pinned[0])} '
                    f"for {esc(_duration(pinned[1]))}</span>"
                )
            out.append(title + "</h3>")
            out.append(
                "<table><thead><tr><th>tier</th><th>backend</th><th>regime</th>"
                "<th>breaker</th><th>cooldown</th><th>failures</th><th>saturations</th>"
                "</tr></thead><tbody>"
            )
            for n, backend in enumerate(chain, 1):
                out.append(await self._backend_row(route, n, backend, pinned))
            out.append("</tbody></table>")
            if session:
                options = "".join(
                    f'<option value="{esc(b.name, quote=True)}"'
                    f"{' selected' if pinned and pinned[0] == b.name else ''}>"
                    f"{esc(b.name)}</option>"
                    for b in chain
                )
                hidden = (
                    f'<input type="hidden" name="csrf" value="{csrf}">'
                    f'<input type="hidden" name="route" value="{esc(route, quote=True)}">'
                )
                out.append(
                    f'<form method="post" action="{root}/pin" class="pin-form">{hidden}'
                    f'<label>Pin to <select name="backend">{options}</select></label> '
                    '<label>for <input name="ttl" value="4h" size="6" required '
                    'title="seconds, or a duration such as 30m, 4h, 2d"></label> '
                    '<button type="submit">Pin</button></form>'
                )
                if pinned:
                    out.append(
                        f'<form method="post" action="{root}/unpin" class="unpin-form">{hidden}'
                        '<button type="submit">Unpin</button></form>'
                    )
            out.append("</section>")
        out.append(
            '<h2>Pins</h2><table id="pins"><thead><tr><th>route</th><th>backend</th>'
            "<th>remaining</th><th>until (UTC)</th></tr></thead><tbody>"
        )
        if not pins:
            out.append('<tr class="empty"><td colspan="4">No pins.</td></tr>')
        for route, (pinned_to, remaining) in sorted(pins.items()):
            out.append(
                f'<tr data-route="{esc(route, quote=True)}"><td>{esc(route)}</td>'
                f"<td>{esc(pinned_to)}</td><td>{esc(_duration(remaining))}</td>"
                f"<td>{esc(_iso(now + remaining))}</td></tr>"
            )
        out.append("</tbody></table>")
        await _html(self._send, status, _document("tierchain operator", "".join(out)))

    async def _backend_row(
        self, route: str, n: int, backend: Backend, pinned: tuple[str, float] | None
    ) -> str:
        esc = html.escape
        snapshot = await _breaker_snapshot(self.admin.store, route, backend.name)
        if snapshot is None:
            state, cooldown, failures, saturations = "unknown", "", "", ""
        else:
            state = str(getattr(snapshot, "state", "unknown"))
            retry_in = getattr(snapshot, "retry_in", None)
            cooldown = _duration(retry_in) if isinstance(retry_in, int | float) else ""
            failures = str(getattr(snapshot, "failures", ""))
            saturations = str(getattr(snapshot, "saturations", ""))
        mark = ' <span class="pin">pinned</span>' if pinned and pinned[0] == backend.name else ""
        return (
            f'<tr data-backend="{esc(backend.name, quote=True)}"><td>{n}</td>'
            f"<td>{esc(backend.name)}{mark}</td><td>{esc(backend.regime or '')}</td>"
            f'<td class="breaker {esc(state, quote=True)}">{esc(state.replace("_", "-"))}</td>'
            f"<td>{esc(cooldown)}</td><td>{esc(failures)}</td><td>{esc(saturations)}</td></tr>"
        )


async def _breaker_snapshot(store: Store, route: str, backend: str) -> Any:
    """The breaker's snapshot for (route, backend), or None when the store has none."""
    snapshot = getattr(store, "breaker_snapshot", None)
    if snapshot is None:
        return None
    try:
        async with asyncio.timeout(_SNAPSHOT_TIMEOUT):
            return await snapshot(route, backend)
    except Exception as exc:  # a display must not fail the page
        log_event("admin.breaker_snapshot_failed", logging.WARNING, route=route, error=repr(exc))
        return None


def _parse_form(raw: bytes) -> dict[str, str] | None:
    """A urlencoded form as name -> value; None when malformed or a field repeats."""
    try:
        text = raw.decode("ascii")
        pairs = parse_qs(text, keep_blank_values=True, max_num_fields=16, errors="strict")
    except (UnicodeDecodeError, ValueError):
        return None
    if any(len(values) != 1 for values in pairs.values()):
        return None
    return {name: values[0] for name, values in pairs.items()}


# -- responses -------------------------------------------------------------------

_STYLE = (
    "body{font:15px/1.45 system-ui,sans-serif;margin:1.5rem auto;max-width:60rem;"
    "padding:0 1rem;color:#1b1b1b}"
    "header{display:flex;justify-content:space-between;align-items:center}"
    "table{border-collapse:collapse;margin:.4rem 0 .6rem}"
    "th,td{border-bottom:1px solid #ddd;padding:.25rem .7rem;text-align:left}"
    "section.route{border:1px solid #ccc;border-radius:6px;padding:.2rem 1rem .8rem;"
    "margin:0 0 1rem}"
    "form{display:inline-block;margin:.2rem .6rem .2rem 0}"
    ".pin{background:#fff3c4;border-radius:4px;padding:0 .35rem;font-size:.85em}"
    ".breaker.open{color:#a40000;font-weight:600}.breaker.half_open{color:#8a5a00}"
    ".breaker.closed{color:#176117}.error{color:#a40000;font-weight:600}"
)
_STYLE_HASH = base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()
_CSP = (
    f"default-src 'none'; style-src 'sha256-{_STYLE_HASH}'; img-src data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
).encode()


def _document(title: str, body: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )


async def _html(send: Send, status: int, document: str, extra: Headers | None = None) -> None:
    body = document.encode("utf-8")
    await _respond(
        send,
        status,
        body,
        [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-security-policy", _CSP),
            (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"same-origin"),
            *(extra or ()),
        ],
    )


async def _json(send: Send, status: int, data: object) -> None:
    body = json.dumps(data, ensure_ascii=False).encode("utf-8")
    await _respond(send, status, body, [(b"content-type", b"application/json")])


async def _text(send: Send, status: int, text: str, extra: Headers | None = None) -> None:
    body = text.encode("utf-8")
    await _respond(
        send, status, body, [(b"content-type", b"text/plain; charset=utf-8"), *(extra or ())]
    )


async def _respond(send: Send, status: int, body: bytes, headers: Headers) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                *headers,
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                (b"x-content-type-options", b"nosniff"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
