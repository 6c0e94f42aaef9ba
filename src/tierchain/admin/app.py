"""The Admin ASGI app: dispatch, the JSON pin API and the page's forms.

Who may call it is decided in :mod:`.session`; what the page looks like in
:mod:`.page`. Every answer, success or error, carries ``Cache-Control:
no-store``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import parse_qs

from .._body import CallerGone, read_body
from .._checks import count, duration, parse_duration
from .._json import loads as load_json
from .._responses import header, send_json_error
from .._types import Headers, Message, Receive, Scope, Send
from ..backend import Routes
from ..errors import BodyTooLarge
from ..keys import CallerKey
from ..limits import usage_report
from ..masking import mask_text
from ..store import Store
from ..telemetry import log_event
from . import page
from .session import TOKEN_PATTERN, Sessions, cookie, presented_bearer, same_origin

__all__ = ["MIN_TTL", "Admin", "parse_ttl"]

T = TypeVar("T")

MIN_TTL = 1.0
"""The shortest pin, in seconds."""

_REALM = b'Bearer realm="tierchain"'
_NO_STORE = (b"cache-control", b"no-store")
_SNAPSHOT_TIMEOUT = 1.0


class _StoreDown(Exception):
    """The store failed a pin operation: answered 503."""


class _Invalid(ValueError):
    """A request the operator must correct: answered 422 (or 400) with its message."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


def parse_ttl(value: object, max_ttl: float) -> float:
    """A pin's lifetime in seconds, from a number or a duration like ``90s``, ``30m``, ``4h``.

    Raises ``ValueError`` (answered 422) for anything else, including a number
    too large to be a float.
    """
    if isinstance(value, bool) or value is None:
        raise _Invalid("ttl is required: seconds as a number, or a duration such as 30m, 4h, 2d")
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:
            seconds = math.inf
    elif isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ValueError:
            shown = value if len(value) <= 32 else value[:32] + "..."
            raise _Invalid(
                f"ttl {shown!r} is not a duration such as 90, 90s, 30m, 4h or 2d"
            ) from None
    else:
        raise _Invalid("ttl must be seconds as a number, or a duration such as 30m, 4h, 2d")
    if not math.isfinite(seconds) or not MIN_TTL <= seconds <= max_ttl:
        got = f"{seconds:g} seconds" if math.isfinite(seconds) else "a number out of that range"
        raise _Invalid(
            f"ttl must be between {page.duration(MIN_TTL)} and {page.duration(max_ttl)}, got {got}"
        )
    return seconds


def _shown(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[:limit] + "..."


class Admin:
    """The operator's app: pins over a JSON API and one server-rendered page.

    Give it the same :class:`~tierchain.Routes` the Failover uses and the same store
    PreferBackend (and the breaker) use, so a pin set here reorders what callers get.
    ``token`` turns the app on; without it everything answers 404.

    Options: [Admin options](admin.md#options).
    """

    def __init__(
        self,
        *,
        routes: Routes | Mapping[str, Any],
        store: Store,
        token: str | None = None,
        max_ttl: float | timedelta = 7 * 86400.0,
        session_ttl: float | timedelta = 12 * 3600.0,
        allowed_origins: Collection[str] = (),
        max_body: int = 16 * 1024,
        clock: Callable[[], float] = time.time,
        keys: Iterable[CallerKey] = (),
    ) -> None:
        self.routes = routes if isinstance(routes, Routes) else Routes(routes)
        self.keys = tuple(keys)
        if store is None:
            raise ValueError("Admin needs store=: pass the same store PreferBackend uses")
        self.store = store
        self.max_ttl = duration("max_ttl", max_ttl, at_least=MIN_TTL)
        self.session_ttl = duration("session_ttl", session_ttl, at_least=60.0)
        self.max_body = count("max_body", max_body, minimum=1024)
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)
        self.clock = clock
        self._sessions: Sessions | None = None
        if token is None or token == "":
            log_event(
                "admin.disabled",
                logging.WARNING,
                message="tierchain Admin is off because no token is configured: "
                "it answers 404 to every request.",
            )
        elif not isinstance(token, str) or not TOKEN_PATTERN.fullmatch(token):
            length = len(token) if isinstance(token, str) else 0
            raise ValueError(
                "token must be 16 to 512 printable ASCII characters without spaces "
                f"(got {length} characters)"
            )
        else:
            self._sessions = Sessions(token, ttl=self.session_ttl, clock=lambda: self.clock())

    @property
    def enabled(self) -> bool:
        """True when a token is configured."""
        return self._sessions is not None

    def __repr__(self) -> str:
        return f"Admin(routes={self.routes!r}, enabled={self.enabled})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        if self._sessions is None:
            return await _text(send, 404, "Not Found")
        await _Call(self, self._sessions, scope, receive, send).run()


class _Call:
    """One request to the admin app."""

    def __init__(
        self, admin: Admin, sessions: Sessions, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.admin = admin
        self.sessions = sessions
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
                await self._json_error(503, message, "store_unavailable", "service_unavailable")
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
        if path == "/usage":
            if method != "GET":
                return await self._not_allowed("GET")
            if await self._bearer():
                usage = await self._store(usage_report, self.admin.store, self.admin.keys)
                await _json(self._send, 200, usage)
            return None
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

    async def _json_error(
        self, status: int, message: str, type: str, code: str, extra: Headers | None = None
    ) -> None:
        headers = [*(extra or ()), _NO_STORE]
        await send_json_error(self._send, status, message, type, code, headers=headers)

    # -- authentication ------------------------------------------------------

    async def _bearer(self) -> bool:
        """True when the bearer token is right; otherwise answers 401 and says why in the log."""
        presented = presented_bearer(self.headers)
        if presented and self.sessions.token_ok(presented):
            return True
        reason = "missing" if presented is None else "wrong"
        self._auth_failed(reason)
        await self._json_error(
            401,
            "a bearer token is required: Authorization: Bearer <token>"
            if reason == "missing"
            else "the bearer token is not the configured token",
            "authentication_error",
            "unauthorized",
            [(b"www-authenticate", _REALM)],
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
                        "until": page.iso(now + remaining),
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
                body["until"] = page.iso(self.admin.clock() + remaining)
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
            data = load_json(raw)
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
            {"route": route, "backend": backend, "ttl_s": ttl, "until": page.iso(until)},
        )

    async def _api_invalid(self, exc: _Invalid) -> None:
        await self._json_error(
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
        chain = self.admin.routes[route]
        # A pin names a backend, a pool's replica, or a pool (its replicas go first).
        if self.admin.routes.backend(route, backend) is None and not any(
            b.pool == backend for b in chain
        ):
            names = ", ".join(b.name for b in chain)
            raise _Invalid(
                f"unknown backend {_shown(backend)!r} for route {route!r}; its chain is: {names}"
            )

    async def _pin(self, route: str, backend: str, ttl: float, *, via: str) -> float:
        until = await self._store(self.admin.store.set_pin, route, backend, ttl)
        log_event(
            "admin.pin_set",
            route=route,
            backend=backend,
            until=page.iso(until),
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
                until=page.iso(self.admin.clock()),
                via=via,
                client=self.client,
            )
        return removed, previous

    # -- the page and its forms ------------------------------------------------

    async def _page(self) -> None:
        session = self.sessions.from_cookies(self.headers)
        if session is None:
            presented = presented_bearer(self.headers)
            if presented and self.sessions.token_ok(presented):
                session = ""  # a bearer client can read the page; forms need a login
            else:
                if presented is not None:
                    self._auth_failed("wrong")
                return await self._login_page()
        await self._render(session)

    async def _login_page(self, message: str | None = None) -> None:
        await _html(
            self._send, 401, page.login(self.root, message), [(b"www-authenticate", _REALM)]
        )

    async def _form(self, action: str) -> None:
        if not same_origin(self.headers, self.admin.allowed_origins):
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
            if not token or not self.sessions.token_ok(token):
                self._auth_failed("missing" if not token else "wrong")
                return await self._login_page("That is not the admin token.")
            log_event("admin.login", client=self.client)
            return await self._redirect(self._cookie(self.sessions.new(), self.admin.session_ttl))
        session = self.sessions.from_cookies(self.headers)
        if session is None:
            self._auth_failed("no_session")
            return await self._login_page("Log in first (or again: the session expired).")
        presented = form.get("csrf", "").encode("utf-8", "replace")
        if not self.sessions.csrf_ok(session, presented):
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
        return cookie(
            value, max_age, path=self.root or "/", secure=self.scope.get("scheme") == "https"
        )

    async def _redirect(self, *extra: tuple[bytes, bytes]) -> None:
        location = (self.root or "") + "/"
        await self._send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode("latin-1")),
                    (b"content-length", b"0"),
                    _NO_STORE,
                    *extra,
                ],
            }
        )
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _render(self, session: str, *, error: str | None = None, status: int = 200) -> None:
        admin = self.admin
        pins = await self._store(admin.store.list_pins)
        breakers = {
            (route, backend.name): await _breaker_view(admin.store, route, backend.name)
            for route, chain in admin.routes.items()
            for backend in chain
        }
        document = page.console(
            root=self.root,
            routes=admin.routes,
            pins=pins,
            breakers=breakers,
            now=admin.clock(),
            csrf=self.sessions.csrf(session) if session else None,
            error=error,
            degraded=getattr(admin.store, "degraded", False) is True,
            usage=await self._store(usage_report, admin.store, admin.keys),
        )
        await _html(self._send, status, document)


async def _breaker_view(store: Store, route: str, backend: str) -> page.BreakerView:
    """What the page shows of (route, backend)'s breaker; "unknown" when the store cannot say."""
    snapshot_of = getattr(store, "breaker_snapshot", None)
    if snapshot_of is None:
        return page.BreakerView()
    try:
        async with asyncio.timeout(_SNAPSHOT_TIMEOUT):
            snapshot = await snapshot_of(route, backend)
    except Exception as exc:  # a display must not fail the page
        log_event("admin.breaker_snapshot_failed", logging.WARNING, route=route, error=repr(exc))
        return page.BreakerView()
    if snapshot is None:
        return page.BreakerView()
    retry_in = getattr(snapshot, "retry_in", None)
    return page.BreakerView(
        state=str(getattr(snapshot, "state", "unknown")),
        cooldown=page.duration(retry_in) if isinstance(retry_in, int | float) else "",
        failures=str(getattr(snapshot, "failures", "")),
        saturations=str(getattr(snapshot, "saturations", "")),
    )


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


async def _html(send: Send, status: int, document: str, extra: Headers | None = None) -> None:
    await _respond(send, status, document.encode("utf-8"), [*page.HTML_HEADERS, *(extra or ())])


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
                _NO_STORE,
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
