"""Small helpers to answer a request ourselves."""

from __future__ import annotations

import email.utils
import json
import math
import time
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


def retry_after(headers: Headers) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    value = header(headers, b"retry-after")
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def error_detail(body: bytes) -> str | None:
    """The message an upstream error body gives (OpenAI shape or plain text), shortened."""
    if not body:
        return None
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        data = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            text = error["message"]
        elif isinstance(error, str):
            text = error
        elif isinstance(data.get("message"), str):
            text = data["message"]
        elif isinstance(data.get("detail"), str):
            text = data["detail"]
        else:
            text = body.decode("utf-8", "replace")
    else:
        text = body.decode("utf-8", "replace")
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:300] + "..."
