"""Log formatters that write one line per event, in text or JSON.

The library configures no logging: its events go to the ``tierchain`` logger
(see :func:`tierchain.telemetry.log_event`) and appear wherever the
application sends them. ``tierchain serve`` uses these formatters; any
``logging.config.dictConfig`` can too::

    "formatters": {"json": {"()": "tierchain.logs.JsonFormatter"}}

Text: ``2026-11-04T21:00:00.123Z INFO    tierchain tierchain.started pid=4242 ...``.
JSON: ``{"ts": "...", "level": "INFO", "logger": "tierchain", "event":
"tierchain.started", "pid": 4242, ...}``: a tierchain event's fields become
keys of their own (a field whose name is taken gets a ``_`` appended); any
other record has its text under ``message``. A traceback stays on its line
(as ``exc``).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from .masking import mask_text, mask_url

__all__ = [
    "DropLoggedErrors",
    "JsonFormatter",
    "MaskAccessLog",
    "TextFormatter",
    "mark_logged",
    "one_line",
]

# Every character a reader may take for the end of a line (str.splitlines, JavaScript,
# editors: CR, LF, VT, FF, the C0 and C1 controls, NEL, U+2028, U+2029), escaped. JSON
# escapes the C0 controls itself, and json.dumps(ensure_ascii=False) leaves the rest raw.
_LINE_SAFE = {c: f"\\u{c:04x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029)}
_LINE_SAFE.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"})


def one_line(text: str) -> str:
    """``text`` with every line separator and control character escaped (``\\u2028``)."""
    return text.translate(_LINE_SAFE) if not text.isprintable() else text


def _timestamp(record: logging.LogRecord) -> str:
    when = datetime.fromtimestamp(record.created, UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class MaskAccessLog(logging.Filter):
    """A filter for ``uvicorn.access``: the request target's secret query values (``?key=``,
    ``?token=``...) and any caller key in it become ``***`` (:mod:`tierchain.masking`).

    uvicorn logs ``(client, method, target, http version, status)`` as the record's args.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            target = args[2]
            if "?" in target or "@" in target or "#" in target:
                target = mask_url(target)
            record.args = (*args[:2], mask_text(target), *args[3:])
        return True


_LOGGED = "_tierchain_logged"


def mark_logged(exc: BaseException) -> None:
    """Note that tierchain logged ``exc`` itself (see :class:`DropLoggedErrors`)."""
    try:
        setattr(exc, _LOGGED, True)
    except AttributeError:  # (an exception type with slots and no __dict__)
        pass


class DropLoggedErrors(logging.Filter):
    """A filter for ``uvicorn.error``: drops the server's "Exception in ASGI application"
    traceback for an exception tierchain already logged as an event of its own."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not getattr(exc, _LOGGED, False)


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger> <message>`` on one line; newlines inside are escaped."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        line = f"{_timestamp(record)} {record.levelname:<7} {record.name} {text}"
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        elif record.exc_text:
            line += " exc=" + json.dumps(record.exc_text)
        return one_line(line)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, then ``event`` and its fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
        }
        event = getattr(record, "event", None)
        fields = getattr(record, "tierchain", None)
        if isinstance(event, str) and isinstance(fields, dict):
            doc["event"] = event
            for key, value in fields.items():
                doc[key if key not in doc else f"{key}_"] = value
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return one_line(json.dumps(doc, ensure_ascii=False, default=str))
