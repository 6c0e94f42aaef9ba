"""Who may use the Admin app: the bearer token, signed session cookies, CSRF tokens, origins.

The API takes ``Authorization: Bearer <token>``, compared in constant time.
The page logs in once with the token and gets a session cookie whose value is
``<issued>.<nonce>.<mac>``: an expiring nonce signed with a key derived from
the token, never the token itself. Every form that changes something carries a
CSRF token derived from the session and must come from this origin.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable, Collection
from urllib.parse import urlsplit

from .._responses import header
from .._types import Headers

__all__ = ["COOKIE", "TOKEN_PATTERN", "Sessions", "cookie", "presented_bearer", "same_origin"]

COOKIE = "tierchain_admin"
"""The session cookie's name."""

TOKEN_PATTERN = re.compile(r"[\x21-\x7e]{16,512}")
"""What an admin token must look like: 16 to 512 printable ASCII characters, no spaces."""

_SESSION_KEY_LABEL = b"tierchain-admin-session-v1"
_CLOCK_SKEW = 60  # seconds a session may appear to be issued in the future


class Sessions:
    """The checks a token unlocks: the token itself, session cookies and CSRF tokens.

    ``token`` is the configured admin token, ``ttl`` how long a session lasts
    (seconds) and ``clock`` the wall clock (seconds since the epoch).
    """

    __slots__ = ("_clock", "_key", "_token", "ttl")

    def __init__(self, token: str, *, ttl: float, clock: Callable[[], float]) -> None:
        self._token = token.encode("ascii")
        self._key = hmac.new(self._token, _SESSION_KEY_LABEL, hashlib.sha256).digest()
        self.ttl = ttl
        self._clock = clock

    def __repr__(self) -> str:
        return f"Sessions(ttl={self.ttl!r})"

    def token_ok(self, presented: bytes) -> bool:
        """True when ``presented`` is the configured token (constant time)."""
        return hmac.compare_digest(presented, self._token)

    def new(self) -> str:
        """A fresh session value for the cookie."""
        payload = f"{int(self._clock())}.{secrets.token_urlsafe(18)}"
        return f"{payload}.{self._sign(b'session:' + payload.encode())}"

    def valid(self, value: str) -> bool:
        """True when ``value`` is a session this token signed and it has not expired."""
        payload, _, mac = value.rpartition(".")
        issued, _, nonce = payload.partition(".")
        if not (issued.isdigit() and nonce and mac):
            return False
        expected = self._sign(b"session:" + payload.encode()).encode()
        if not hmac.compare_digest(mac.encode("utf-8", "replace"), expected):
            return False
        age = self._clock() - int(issued)
        return -_CLOCK_SKEW <= age < self.ttl

    def csrf(self, session: str) -> str:
        """The CSRF token the page's forms carry for ``session``."""
        return self._sign(b"csrf:" + session.encode())

    def csrf_ok(self, session: str, presented: bytes) -> bool:
        """True when ``presented`` is ``session``'s CSRF token (constant time)."""
        return hmac.compare_digest(presented, self.csrf(session).encode())

    def from_cookies(self, headers: Headers) -> str | None:
        """The request's valid session value, or None."""
        for key, value in headers:
            if key.lower() != b"cookie":
                continue
            for part in value.decode("latin-1").split(";"):
                name, _, content = part.strip().partition("=")
                if name == COOKIE and self.valid(content):
                    return content
        return None

    def _sign(self, message: bytes) -> str:
        mac = hmac.new(self._key, message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def presented_bearer(headers: Headers) -> bytes | None:
    """The bearer credentials of ``Authorization``; b"" for another scheme, None when absent."""
    value = header(headers, b"authorization")
    if value is None:
        return None
    scheme, _, credentials = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return b""
    return credentials.strip()


def cookie(value: str, max_age: float, *, path: str, secure: bool) -> tuple[bytes, bytes]:
    """The ``Set-Cookie`` header for a session value (``""`` with 0 to clear it)."""
    parts = [
        f"{COOKIE}={value}",
        f"Path={path}",
        f"Max-Age={int(max_age)}",
        "HttpOnly",
        "SameSite=Strict",
    ]
    if secure:
        parts.append("Secure")
    return (b"set-cookie", "; ".join(parts).encode("latin-1"))


def same_origin(headers: Headers, allowed_origins: Collection[str]) -> bool:
    """True when a form comes from this origin (``Origin`` or ``Sec-Fetch-Site``)."""
    origin = header(headers, b"origin")
    if origin is not None:
        text = origin.decode("latin-1").strip().rstrip("/").lower()
        if text in allowed_origins:
            return True
        host = header(headers, b"host")
        try:
            netloc = urlsplit(text).netloc
        except ValueError:
            return False
        return host is not None and bool(netloc) and netloc == host.decode("latin-1").lower()
    site = header(headers, b"sec-fetch-site")
    return site is None or site in (b"same-origin", b"none")
