"""The Admin page: the login form and the console, as HTML with a strict CSP.

Everything here is a pure function from facts to HTML text; the app gathers
the facts (pins, breaker snapshots) and sends the document. Every value is
escaped; the page has no script, and its one style sheet is pinned by hash in
the ``Content-Security-Policy``.
"""

from __future__ import annotations

import base64
import hashlib
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from .._types import Headers
from ..backend import Backend, Routes

__all__ = ["HTML_HEADERS", "BreakerView", "console", "document", "duration", "iso", "login"]

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

HTML_HEADERS: Headers = [
    (b"content-type", b"text/html; charset=utf-8"),
    (b"content-security-policy", _CSP),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
]
"""The headers every page is sent with."""

esc = html.escape


def duration(seconds: float) -> str:
    """``3h 59m``, ``45s``, ``2d 3h``: a remaining time as an operator reads it."""
    s = max(0, math.ceil(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (s, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n][:2]
    return " ".join(shown) or "0s"


def iso(epoch: float) -> str:
    """``2026-11-04T21:00:00Z``: a moment in UTC, to the second."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class BreakerView:
    """What the page shows of one backend's breaker (empty strings: not known)."""

    state: str = "unknown"
    cooldown: str = ""
    failures: str = ""
    saturations: str = ""


def document(title: str, body: str) -> str:
    """A whole HTML document with the page's style."""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="data:,">'
        f"<title>{esc(title)}</title><style>{_STYLE}</style></head>"
        f"<body>{body}</body></html>"
    )


def login(root: str, message: str | None = None) -> str:
    """The login form, posting to ``root``/login, with ``message`` above it."""
    action = esc(root, quote=True)
    note = f'<p class="error" role="alert">{esc(message)}</p>' if message else ""
    body = (
        "<h1>tierchain operator</h1>"
        f"{note}"
        f'<form method="post" action="{action}/login" class="login">'
        '<label for="token">Admin token</label> '
        '<input id="token" name="token" type="password" autocomplete="current-password" '
        'required autofocus> <button type="submit">Log in</button></form>'
    )
    return document("tierchain: log in", body)


def console(
    *,
    root: str,
    routes: Routes,
    pins: Mapping[str, tuple[str, float]],
    breakers: Mapping[tuple[str, str], BreakerView],
    now: float,
    csrf: str | None,
    error: str | None = None,
    degraded: bool = False,
    usage: Mapping[str, Any] | None = None,
) -> str:
    """The operator console: every route's chain with its breakers, the pins, the forms,
    and (``usage``: :func:`tierchain.limits.usage_report`'s read-out) tokens per key.

    ``csrf`` is the session's form token; None shows the page read-only (a
    bearer client without a session). ``breakers`` is keyed by (route, backend).
    """
    action = esc(root, quote=True)
    token = esc(csrf, quote=True) if csrf else ""
    out: list[str] = ["<header><h1>tierchain operator</h1>"]
    if csrf:
        out.append(
            f'<form method="post" action="{action}/logout" class="logout">'
            f'<input type="hidden" name="csrf" value="{token}">'
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
    if degraded:
        out.append(
            '<p class="error" role="status">The shared store is unreachable: this replica '
            "is serving from its local fallback, so what you see here may differ from "
            "the other replicas, and pins cannot be changed until it is back.</p>"
        )
    out.append("<h2>Routes</h2>")
    for route, chain in routes.items():
        pinned = pins.get(route)
        out.append(f'<section class="route" data-route="{esc(route, quote=True)}">')
        title = f"<h3>{esc(route)}"
        if pinned:
            title += (
                f' <span class="pin">pinned to {esc(pinned[0])} '
                f"for {esc(duration(pinned[1]))}</span>"
            )
        out.append(title + "</h3>")
        out.append(
            "<table><thead><tr><th>tier</th><th>backend</th><th>regime</th>"
            "<th>breaker</th><th>cooldown</th><th>failures</th><th>saturations</th>"
            "</tr></thead><tbody>"
        )
        for n, backend in enumerate(chain, 1):
            view = breakers.get((route, backend.name), BreakerView())
            out.append(_backend_row(n, backend, view, pinned))
        out.append("</tbody></table>")
        if csrf:
            out.append(_forms(action, token, route, chain, pinned))
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
            f"<td>{esc(pinned_to)}</td><td>{esc(duration(remaining))}</td>"
            f"<td>{esc(iso(now + remaining))}</td></tr>"
        )
    out.append("</tbody></table>")
    if usage is not None:
        out.append(_usage(usage))
    return document("tierchain operator", "".join(out))


def _usage(usage: Mapping[str, Any]) -> str:
    """Tokens per key name, route, backend and kind; each key's limits and windows now."""
    out = [
        '<h2>Usage</h2><table id="usage"><thead><tr><th>key</th><th>route</th>'
        "<th>backend</th><th>kind</th><th>count</th><th>cost</th></tr></thead><tbody>"
    ]
    rows = usage.get("usage", [])
    if not rows:
        out.append('<tr class="empty"><td colspan="6">Nothing counted yet.</td></tr>')
    for row in rows:
        cost = row.get("cost")
        shown = "" if cost is None else f"{cost:.6f}"
        out.append(
            f'<tr data-key="{esc(row["key_name"], quote=True)}"><td>{esc(row["key_name"])}</td>'
            f"<td>{esc(row['route'])}</td><td>{esc(row['backend'])}</td>"
            f"<td>{esc(row['kind'])}</td><td>{esc(str(row['value']))}</td>"
            f"<td>{esc(shown)}</td></tr>"
        )
    out.append("</tbody></table>")
    limits = usage.get("limits", [])
    if limits:
        out.append(
            '<table id="limits"><thead><tr><th>key</th><th>requests this minute</th>'
            "<th>tokens this minute</th><th>budget used</th><th>in flight at most</th>"
            "</tr></thead><tbody>"
        )
        for row in limits:
            cells = [
                _of(row["rpm_used"], row["rpm"]),
                _of(row["tpm_used"], row["tpm"]),
                _of(row["budget_used"], row["budget_tokens"]),
                "no limit" if row.get("max_parallel") is None else str(row["max_parallel"]),
            ]
            out.append(
                f'<tr data-key="{esc(row["key_name"], quote=True)}">'
                f"<td>{esc(row['key_name'])}</td>"
                + "".join(f"<td>{esc(c)}</td>" for c in cells)
                + "</tr>"
            )
        out.append("</tbody></table>")
    return "".join(out)


def _of(used: int | None, limit: int | None) -> str:
    return "no limit" if limit is None else f"{used or 0} of {limit}"


def _forms(
    action: str, token: str, route: str, chain: Sequence[Backend], pinned: tuple[str, float] | None
) -> str:
    options = "".join(
        f'<option value="{esc(b.name, quote=True)}"'
        f"{' selected' if pinned and pinned[0] == b.name else ''}>"
        f"{esc(b.name)}</option>"
        for b in chain
    )
    hidden = (
        f'<input type="hidden" name="csrf" value="{token}">'
        f'<input type="hidden" name="route" value="{esc(route, quote=True)}">'
    )
    out = (
        f'<form method="post" action="{action}/pin" class="pin-form">{hidden}'
        f'<label>Pin to <select name="backend">{options}</select></label> '
        '<label>for <input name="ttl" value="4h" size="6" required '
        'title="seconds, or a duration such as 30m, 4h, 2d"></label> '
        '<button type="submit">Pin</button></form>'
    )
    if pinned:
        out += (
            f'<form method="post" action="{action}/unpin" class="unpin-form">{hidden}'
            '<button type="submit">Unpin</button></form>'
        )
    return out


def _backend_row(
    n: int, backend: Backend, view: BreakerView, pinned: tuple[str, float] | None
) -> str:
    state = view.state
    mark = ' <span class="pin">pinned</span>' if pinned and pinned[0] == backend.name else ""
    return (
        f'<tr data-backend="{esc(backend.name, quote=True)}"><td>{n}</td>'
        f"<td>{esc(backend.name)}{mark}</td><td>{esc(backend.regime or '')}</td>"
        f'<td class="breaker {esc(state, quote=True)}">{esc(state.replace("_", "-"))}</td>'
        f"<td>{esc(view.cooldown)}</td><td>{esc(view.failures)}</td>"
        f"<td>{esc(view.saturations)}</td></tr>"
    )
