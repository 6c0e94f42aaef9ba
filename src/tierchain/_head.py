"""The caller's request head, checked once before anything is routed or forwarded.

Three checks, in one pass over the header list (its cost grows linearly with
the number of headers, and it runs before anything whose cost does not):

- **Header limits.** More than ``max_headers`` header fields, or more than
  ``max_header_bytes`` of them (each counted as ``name: value`` plus CRLF, as
  on the wire), is answered ``431 Request Header Fields Too Large`` (RFC 6585)
  and the connection closed. uvicorn's h11 parser stops at 16 KiB of head
  (h11's ``max_incomplete_event_size``); its httptools parser has no bound,
  and accepted a request of 20,000 header fields (249 KB). The defaults sit
  where real servers put theirs: 100 fields as Envoy
  (``max_headers_count``) and Apache (``LimitRequestFields``) do, and 32 KiB
  of header bytes, what nginx accepts by default (``large_client_header_buffers
  4 8k``), below Envoy's 60 KiB (``max_request_headers_kb``) and above h11's
  16 KiB.
- **Framing.** A request with both ``Content-Length`` and
  ``Transfer-Encoding`` is a request-smuggling shape: RFC 9112 §6.3 says a
  server may reject it and must close the connection after it. Answered 400
  with ``connection: close`` (uvicorn then closes it, under h11 and httptools
  alike; httptools' own parser already refuses it before the app runs).
- **Trailers.** uvicorn's httptools protocol appends a chunked request's
  trailer fields to the very list it gave the app as ``scope["headers"]``,
  after the app started: a trailer such as ``X-Forwarded-For`` would then look
  like a request header to anything that reads the headers after the body
  (the Forwarder does). The scope gets its own copy of the list here, so the
  headers are the ones that came before the body, and nothing after. When the
  whole chunked request came in one read under uvicorn's own httptools protocol,
  the trailers were appended before the app ran and cannot be told apart
  (:mod:`tierchain._runtime.server`): it is refused with a 400
  (``trailers_unknowable``) and a ``server.trailers_merged`` WARNING, once, tells
  the operator how to run the gateway without that.

Each refusal is counted in ``tierchain_requests_refused_total`` and logged as
``request.refused``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ._checks import count
from ._responses import send_json_error
from ._runtime.server import trailers_merged
from ._types import Scope, Send
from .telemetry import REQUESTS_REFUSED, labelled, log_event
from .wire import error_format

DEFAULT_MAX_HEADERS = 100
DEFAULT_MAX_HEADER_BYTES = 32 * 1024

_CLOSE = (b"connection", b"close")


class HeadLimits:
    """``max_headers`` and ``max_header_bytes``, validated once."""

    __slots__ = ("max_header_bytes", "max_headers")

    def __init__(self, max_headers: int, max_header_bytes: int) -> None:
        self.max_headers = count("max_headers", max_headers)
        self.max_header_bytes = count("max_header_bytes", max_header_bytes)

    def problem(self, scope: Scope) -> tuple[int, str, str] | None:
        """Why the head is refused (status, message, reason), or None; detaches the list."""
        headers = scope.get("headers", ())
        count = len(headers)
        if count > self.max_headers:
            return (
                431,
                f"the request has {count} header fields; at most {self.max_headers} are accepted",
                "too_many_headers",
            )
        size = 0
        length = chunked = False
        for key, value in headers:
            size += len(key) + len(value) + 4
            if key == b"content-length":
                length = True
            elif key == b"transfer-encoding":
                chunked = True
        if size > self.max_header_bytes:
            return (
                431,
                f"the request's header fields take {size} bytes; "
                f"at most {self.max_header_bytes} are accepted",
                "headers_too_large",
            )
        if length and chunked:
            return (
                400,
                "the request has both Content-Length and Transfer-Encoding; send one of them",
                "ambiguous_framing",
            )
        if chunked and trailers_merged():
            _warn_once()
            return (
                400,
                "a chunked request read whole before the gateway ran cannot have its trailer "
                "fields told from its headers under this server; send Content-Length",
                "trailers_unknowable",
            )
        # The server's own list may still grow (httptools appends trailers to it).
        scope["headers"] = list(headers)
        return None


_WARNED: list[bool] = []


def _warn_once() -> None:
    """The operator's side of a ``trailers_unknowable`` refusal, once per process."""
    if not _WARNED:
        _WARNED.append(True)
        log_event(
            "server.trailers_merged",
            logging.WARNING,
            hint="uvicorn's httptools protocol puts a chunked request's trailers among its "
            "headers: run tierchain serve, or uvicorn with --http h11, or "
            "uvicorn.run(app, http=tierchain.httptools_protocol.HttpToolsWithoutTrailers); "
            "until then a chunked request read in one piece is refused (400)",
        )


async def refuse_request(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    reason: str,
    *,
    type: str = "invalid_request_error",
    headers: Sequence[tuple[bytes, bytes]] = (),
    **extra: object,
) -> None:
    """Answer a refused request with ``connection: close``; count and log it."""
    labelled(REQUESTS_REFUSED, str(status), reason).inc()
    log_event(
        "request.refused",
        logging.INFO,
        method=scope.get("method"),
        status=status,
        reason=reason,
    )
    await send_json_error(
        send,
        status,
        message,
        type,
        reason,
        headers=[*headers, _CLOSE],
        wire=error_format(scope.get("path") or ""),
        **extra,
    )
