"""The request target, checked and normalised, and the upstream URL built from it.

A caller names a path and a query; it never names the host. :func:`request_target`
accepts only an origin-form target (a path starting with one ``/``, then an
optional query) and refuses, with :class:`BadTarget`, anything that could steer
a request elsewhere once it is joined to a backend's URL or handed to a server
that normalises paths:

- not origin-form: an absolute URL (``http://other/...``), an authority or
  userinfo (``@host:port/...``), ``*``, or a path starting with ``//``;
- a dot segment (``.`` or ``..``), also percent-encoded (``%2e%2e``, ``.%2E``),
  separated by an encoded slash (``..%2f``) or followed by parameters (``..;x``);
- a backslash (also ``%5c``), a NUL or any other control character (also
  percent-encoded), a fragment (``#``), a ``%`` not followed by two hex digits,
  or a path that is not UTF-8 once decoded (an overlong ``%c0%ae``).

The normalised path decodes percent-encoded unreserved characters (``%76`` is
``v``) and upper-cases every other escape, so a path check (Failover's
``paths``) and the upstream see the same path. :func:`upstream_url` then keeps
the backend's scheme, userinfo, host, port and base path, appends the
normalised path, and merges the queries: the backend's own parameters come
first and a caller's parameter of the same name is dropped.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import quote, unquote_plus, unquote_to_bytes

import httpx

from ._responses import send_json_error
from ._types import Scope, Send
from .telemetry import TARGET_REJECTED, labelled, log_event
from .wire import error_format

__all__ = ["BadTarget", "Target", "refuse", "request_target", "upstream_url"]

_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")
_HIGH = re.compile(rb"[\x80-\xff]")
# A path with nothing to decode, no dot right after a slash, no backslash: accepted as is.
_PLAIN = re.compile(rb"/(?![/.])(?:[A-Za-z0-9\-_~!$&'()*+,;=:@]|\.|/(?!\.))*")
_PLAIN_QUERY = re.compile(rb"[A-Za-z0-9\-._~!$&'()*+,;=:@/?]*")
_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PCHAR_SAFE = "/:@!$&'()*+,;=-._~"
_SHOWN = 120
# A byte as an int: ``int in bytes`` is a byte search, while ``b"?" in bytes`` first tries
# the needle as an int (a TypeError made and dropped in C), then searches.
_QUERY_MARK = ord("?")


class BadTarget(ValueError):
    """A request target that is refused; ``reason`` is a short stable word."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Target:
    """A checked request target: the normalised ``path`` and the raw ``query``."""

    path: bytes
    query: bytes


def _normalise_escape(match: re.Match[bytes]) -> bytes:
    value = int(match.group(1), 16)
    if value in _UNRESERVED:
        return bytes((value,))
    return b"%" + match.group(1).upper()


def _escape_high(match: re.Match[bytes]) -> bytes:
    return b"%%%02X" % match.group()[0]


def _has_control(data: bytes) -> bool:
    return any(b < 0x20 or b == 0x7F for b in data)


_PLAIN_SEEN: dict[bytes, Target] = {}  # query-less plain paths already accepted
_PLAIN_SEEN_MAX = 256


def check_target(raw_path: bytes, query: bytes = b"") -> Target:
    """``raw_path`` and ``query`` checked and normalised; :class:`BadTarget` if refused."""
    if not query:
        seen = _PLAIN_SEEN.get(raw_path)
        if seen is not None:
            return seen  # a gateway sees the same few paths again and again
    if _PLAIN.fullmatch(raw_path) and _PLAIN_QUERY.fullmatch(query):
        target = Target(raw_path, query)  # the common case: nothing to decode or doubt
        if not query:
            if len(_PLAIN_SEEN) >= _PLAIN_SEEN_MAX:
                _PLAIN_SEEN.clear()  # many distinct paths: start again, never grow
            _PLAIN_SEEN[raw_path] = target
        return target
    return _checked(raw_path, query)


def _checked(raw_path: bytes, query: bytes) -> Target:
    """:func:`check_target` the long way, for a target the fast path could not accept."""
    if not raw_path.startswith(b"/") or raw_path.startswith(b"//"):
        raise BadTarget(
            "the request target must be a path that starts with a single '/' "
            "(no scheme, host, userinfo or '@' before it)",
            "not_origin_form",
        )
    if b"#" in raw_path or b"#" in query:
        raise BadTarget("the request target must not carry a fragment ('#')", "fragment")
    if _BAD_ESCAPE.search(raw_path) or _BAD_ESCAPE.search(query):
        raise BadTarget(
            "the request target has a '%' that is not followed by two hex digits",
            "bad_percent_encoding",
        )
    decoded = unquote_to_bytes(raw_path)
    if b"\\" in decoded:
        raise BadTarget(
            "the request path must not contain a backslash (also not as %5C)", "backslash"
        )
    if _has_control(decoded) or _has_control(unquote_to_bytes(query)):
        raise BadTarget(
            "the request target must not contain NUL or other control characters "
            "(also not percent-encoded)",
            "control_character",
        )
    try:
        decoded.decode("utf-8")
    except UnicodeDecodeError:
        raise BadTarget(
            "the request path is not UTF-8 once percent-decoded (an overlong '.' such as "
            "%c0%ae is one)",
            "bad_percent_encoding",
        ) from None
    # A segment's parameters (";...") are dropped by some servers before they resolve dots.
    if any(segment.partition(b";")[0] in (b".", b"..") for segment in decoded.split(b"/")):
        raise BadTarget(
            "the request path must not contain '.' or '..' segments (also not percent-encoded)",
            "dot_segment",
        )
    path = _ESCAPE.sub(_normalise_escape, raw_path) if b"%" in raw_path else raw_path
    # Bytes beyond ASCII (a lenient server passes them through) go on percent-encoded.
    return Target(_HIGH.sub(_escape_high, path), _HIGH.sub(_escape_high, query))


def request_target(scope: Scope) -> Target:
    """The scope's request target, checked and normalised; :class:`BadTarget` if refused."""
    raw_path: bytes | None = scope.get("raw_path")
    if raw_path is None:  # a server that gives only the decoded path
        raw_path = quote(scope["path"], safe=_PCHAR_SAFE).encode("ascii")
    elif _QUERY_MARK in raw_path:  # some servers leave the query on raw_path (query_string has it)
        raw_path = raw_path.partition(b"?")[0]
    return check_target(raw_path, scope.get("query_string", b""))


def _query_name(pair: bytes) -> str:
    return unquote_plus(pair.partition(b"=")[0].decode("latin-1"))


def merge_query(base: bytes, caller: bytes) -> bytes:
    """The backend's query, then the caller's parameters whose names it does not set."""
    if not base or not caller:
        return base or caller
    names = {_query_name(pair) for pair in base.split(b"&") if pair}
    kept = [pair for pair in caller.split(b"&") if pair and _query_name(pair) not in names]
    return b"&".join([base, *kept])


@lru_cache(maxsize=256)
def _base(url: str) -> tuple[str, bytes]:
    """A backend URL split once: everything up to its base path (no trailing slash), its query."""
    parsed = httpx.URL(url)  # the same parser that will read the joined URL
    if parsed.fragment:
        url = url.partition("#")[0]
    prefix = url.partition("?")[0]
    return prefix.rstrip("/"), parsed.query


def upstream_url(backend_url: str, target: Target) -> str:
    """``backend_url``'s scheme, userinfo, host, port and base path + ``target``.

    A plain join is safe here, and only here: the target was checked (one leading
    ``/``, no ``?``, ``#``, backslash or control character in the path, all ASCII),
    so nothing in it can end the authority or the base path.
    """
    prefix, base_query = _base(backend_url)
    query = merge_query(base_query, target.query)
    tail = target.path + b"?" + query if query else target.path
    return prefix + tail.decode("ascii")


def _shown_path(scope: Scope) -> str:
    raw: bytes = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "replace")
    text = "".join(chr(b) if 0x20 < b < 0x7F else "?" for b in raw[: _SHOWN + 1])
    return text[:_SHOWN] + "..." if len(raw) > _SHOWN else text


async def refuse(scope: Scope, send: Send, error: BadTarget) -> None:
    """Answer 400 for a refused target; log it (path only, never the query) and count it."""
    labelled(TARGET_REJECTED, error.reason).inc()
    log_event(
        "request.target_rejected",
        logging.INFO,
        method=scope.get("method"),
        path=_shown_path(scope),
        reason=error.reason,
    )
    await send_json_error(
        send,
        400,
        str(error),
        "invalid_request_error",
        "invalid_request_target",
        wire=error_format(scope.get("path") or ""),
        reason=error.reason,
    )
