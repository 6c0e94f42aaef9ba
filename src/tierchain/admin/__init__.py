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
    GET    /usage            JSON: tokens per key name, route, backend and kind, and each
                             key's limits with what its windows hold now (also on the page)

The JSON API takes ``Authorization: Bearer <token>`` only, compared in constant
time; a missing or wrong token gets 401 with ``WWW-Authenticate: Bearer
realm="tierchain"``. A browser cannot send that header from a plain form, so
the page has a login form: it posts the token once and gets back a session
cookie (``HttpOnly``, ``SameSite=Strict``, scoped to the mount's path,
``Secure`` over https) whose value is an expiring nonce signed with a key
derived from the token, never the token itself. Every form that changes
something carries a CSRF token derived from the session (checked with
``hmac.compare_digest``) and must come from this origin (``Origin`` or
``Sec-Fetch-Site``). The token never appears in a log line. Every answer,
errors included, carries ``Cache-Control: no-store``.

The package has one module per job: :mod:`.app` (the ASGI app, the JSON API
and the forms), :mod:`.session` (token, session cookie, CSRF and origin
checks) and :mod:`.page` (the HTML).
"""

from __future__ import annotations

from .app import MIN_TTL, Admin, parse_ttl
from .session import COOKIE

__all__ = ["COOKIE", "MIN_TTL", "Admin", "parse_ttl"]
