"""The start-up identity line: one structured log record saying what is running.

After an incident, the first question is what was running at the time: which
implementation and version, which process, which routes, which settings. One
``tierchain.started`` event answers it::

    tierchain.started ts="2026-11-04T21:00:00.123Z" implementation="tierchain"
        version="0.1.0" pid=4242 host="gw-1" python="3.12.3"
        routes={"echo": [{"name": "tower", "url": "http://10.0.0.5:11434", ...}]}
        settings={"stack": [...], "options": {...}}

Secrets never appear: option values declared secret, header values, and a
URL's credentials and secret query parameters are masked
(:mod:`tierchain.masking`).

:class:`StartupIdentity` writes it on ``lifespan.startup``, or, where the
framework never shows lifespan to middleware (Litestar builds its middleware
per route handler and keeps lifespan to itself), on the first request instead.
Either way it is written once per process: every instance shares one
:class:`Once` unless given its own, so a Litestar app with one instance per
route still writes one line.

The record is logged at INFO on the ``tierchain`` logger; configure logging
(``logging.basicConfig(level=logging.INFO)`` or uvicorn's ``--log-config``) or
it is dropped like any other INFO record.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from ._types import ASGIApp, Message, Receive, Scope, Send
from .backend import Routes
from .failover.hedging import may_hedge
from .masking import MASK, mask_url
from .telemetry import VERSION, log_event


class Settings(Protocol):
    """What the identity line reads of a :class:`tierchain.config.Settings` (named here,
    not imported: the configuration builds the stack that holds this layer)."""

    @property
    def routes(self) -> Routes | None: ...

    def effective(self) -> dict[str, Any]: ...


__all__ = ["EVENT", "PROCESS_ONCE", "Once", "StartupIdentity", "identity_fields", "write_identity"]

EVENT = "tierchain.started"
_SECRET_KEY = re.compile(
    r"token|secret|passw(or)?d|api[_-]?key|authori[sz]ation|credential|cookie", re.IGNORECASE
)


class Once:
    """A flag that can be claimed once."""

    __slots__ = ("_claimed",)

    def __init__(self) -> None:
        self._claimed = False

    @property
    def claimed(self) -> bool:
        return self._claimed

    def claim(self) -> bool:
        """True the first time, False ever after."""
        if self._claimed:
            return False
        self._claimed = True
        return True


PROCESS_ONCE = Once()
"""The flag every :class:`StartupIdentity` shares unless given its own."""


def _routes(routes: Routes | Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for route, chain in routes.items():
        entries = []
        for backend in chain:
            entry: dict[str, Any] = {"name": backend.name, "url": mask_url(backend.url)}
            if backend.regime is not None:
                entry["regime"] = backend.regime
            if backend.status_url is not None:
                entry["status_url"] = mask_url(backend.status_url)
            if backend.model is not None:
                entry["model"] = backend.model
            if backend.stream_end != "openai":
                entry["stream_end"] = backend.stream_end
            if backend.stall_after is not None:
                entry["stall_after"] = backend.stall_after
            if backend.first_token is not None:
                entry["first_token"] = backend.first_token
            if backend.max_in_flight is not None:
                entry["max_in_flight"] = backend.max_in_flight
            for side in ("price_input", "price_output"):
                if getattr(backend, side) is not None:
                    entry[side] = getattr(backend, side)
            if backend.headers:
                entry["headers"] = sorted(backend.headers)  # names only, never values
            if backend.forward_caller_auth:
                entry["forward_caller_auth"] = True  # this tier receives callers' credentials
            if backend.pool is not None:
                entry["pool"] = backend.pool
            if backend.shares is not None:
                entry["shares"] = backend.shares
            # Whether Failover's hedge_after may start the next tier beside this one.
            entry["may_hedge"] = may_hedge(backend)
            entries.append(entry)
        out[route] = entries
    return out


def mask_mapping(value: Any) -> Any:
    """A copy of ``value`` with the values of secret-sounding keys and URL credentials masked."""
    if isinstance(value, Mapping):
        return {
            str(k): (MASK if _SECRET_KEY.search(str(k)) and v is not None else mask_mapping(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [mask_mapping(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return mask_url(value)
    return value


def identity_fields(
    *,
    settings: Settings | Mapping[str, Any] | None = None,
    routes: Routes | Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The identity line's fields (secrets masked), without writing anything.

    ``settings`` is a :class:`~tierchain.config.Settings` (its effective,
    masked view is used, and its routes when ``routes`` is not given) or any
    mapping (keys that sound secret are masked). ``extra`` adds fields.
    """
    effective: Any = None
    if settings is not None:
        if isinstance(settings, Mapping):
            effective = mask_mapping(settings)
        else:
            effective = settings.effective()
            if routes is None:
                routes = settings.routes
    fields: dict[str, Any] = {
        "ts": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "implementation": "tierchain",
        "version": VERSION,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "routes": _routes(routes) if routes is not None else None,
        "settings": effective,
    }
    if extra:
        fields.update(mask_mapping(dict(extra)))
    return fields


def write_identity(
    *,
    settings: Settings | Mapping[str, Any] | None = None,
    routes: Routes | Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    level: int = logging.INFO,
) -> dict[str, Any]:
    """Log the ``tierchain.started`` line now (no once-guard); return its fields."""
    fields = identity_fields(settings=settings, routes=routes, extra=extra)
    log_event(EVENT, level, **fields)
    return fields


class StartupIdentity:
    """Write the identity line once: on lifespan start-up, or else on the first request.

    Put it outermost. ``settings``/``routes``/``extra`` are as for
    :func:`identity_fields`; ``once`` is the guard (default: one per process).

    Options: [the identity line](operations.md#the-identity-line).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: Settings | Mapping[str, Any] | None = None,
        routes: Routes | Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        once: Once | None = None,
        level: int = logging.INFO,
    ) -> None:
        self.app = app
        self.settings = settings
        self.routes = routes
        self.extra = dict(extra) if extra else None
        self.once = PROCESS_ONCE if once is None else once
        self.level = level

    def write(self) -> bool:
        """Write the line unless it was already written; True when this call wrote it."""
        if not self.once.claim():
            return False
        write_identity(
            settings=self.settings, routes=self.routes, extra=self.extra, level=self.level
        )
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.once.claimed:
            return await self.app(scope, receive, send)
        if scope["type"] == "lifespan":

            async def startup_receive() -> Message:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self.write()
                return message

            return await self.app(scope, startup_receive, send)
        self.write()
        await self.app(scope, receive, send)
