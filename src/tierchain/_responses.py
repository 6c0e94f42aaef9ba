"""Small helpers to answer a request ourselves."""

from __future__ import annotations

import json
from typing import Any

from ._types import Headers, Send
from .sse import error_json


async def send_json_error(
    send: Send,
    status: int,
    message: str,
    type: str,
    code: str | None = None,
    *,
    headers: Headers | None = None,
    **extra: Any,
) -> None:
    """Answer ``status`` with an OpenAI-compatible JSON error body."""
    body = json.dumps(error_json(message, type, code, **extra), ensure_ascii=False).encode()
    all_headers: Headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or ()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def header(headers: Headers, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case), or None."""
    for key, value in headers:
        if key.lower() == name:
            return value
    return None
