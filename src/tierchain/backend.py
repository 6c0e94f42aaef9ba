"""`Backend` and `Routes`: what a request may be sent to, in which order."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from types import MappingProxyType
from urllib.parse import urlsplit

from ._checks import count, duration
from .masking import MASK, SECRET_NAME, mask_text, mask_url
from .wire import check_format

__all__ = ["Backend", "Routes"]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _check_url(what: str, url: str) -> str:
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(
            f"{what} {mask_url(url)!r} is not a URL: {mask_text(str(exc), url)}"
        ) from None
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(
            f"{what} {mask_url(url)!r} needs an http or https scheme and a host, "
            "e.g. http://127.0.0.1:11434"
        )
    return url


@dataclass(frozen=True, slots=True)
class Backend:
    """One upstream an attempt can go to.

    ``name`` identifies it in routes, headers, metrics and heartbeat lines
    (``[A-Za-z0-9._-]{1,64}``). ``url`` is its base URL: the request's checked
    path is appended to its path, and its own query parameters come before the
    caller's (and win over a caller's of the same name). ``regime`` is
    operator-supplied state such as ``local`` or ``hosted``. ``status_url``, when
    set, is asked whether the
    backend is still working before a slow attempt is abandoned. ``headers``
    are added to every request sent to it (an API key for a hosted tier), and
    ``model``, when set, replaces the JSON body's ``model`` for this backend.
    ``stream_end`` says when its event streams are complete: ``"openai"``
    (``data: [DONE]``, or a ``finish_reason`` before a clean end), another
    string (a data event whose value is exactly that), or None (any clean end).
    A stream that ends otherwise is truncated, an error. ``stall_after``
    overrides the SaturationWatchdog's ``stall_after`` for this backend (seconds
    or a ``timedelta``, kept as seconds).
    ``forward_caller_auth`` lets the caller's own credentials (``Authorization``,
    ``x-api-key``, ``api-key``, ``Cookie``) through to this backend; by default
    the Forwarder drops them, so a tier never sees a secret meant for another.
    ``max_in_flight`` is how many attempts may be in flight at this backend at
    once, counted across replicas through the store (None: unlimited); one
    more is skipped at once as busy, unless the backend is the chain's last tier.
    ``wire_format`` names the protocol this backend speaks (``"openai"``,
    ``"responses"``, ``"anthropic"``, ``"ollama"``, ``"plain"``; see
    :mod:`tierchain.wire`); None recognises it from the request's path.
    ``stream_end`` applies to the ``openai`` and ``plain`` formats.
    """

    name: str
    url: str
    regime: str | None = None
    status_url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    model: str | None = None
    stream_end: str | None = "openai"
    stall_after: float | timedelta | None = None  # a float (or None) once built
    forward_caller_auth: bool = False
    max_in_flight: int | None = None
    wire_format: str | None = None

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            if f.repr:
                value = getattr(self, f.name)
                if f.name.endswith("url") and isinstance(value, str):
                    value = mask_url(value)
                elif SECRET_NAME.search(f.name) and isinstance(value, str) and value:
                    value = MASK
                shown.append(f"{f.name}={value!r}")
        if self.headers:
            shown.append(f"headers=<{', '.join(sorted(self.headers))}: values not shown>")
        return f"Backend({', '.join(shown)})"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"backend name {self.name!r} must be 1-64 characters from A-Z a-z 0-9 . _ -"
            )
        _check_url(f"backend {self.name!r} url", self.url)
        if self.status_url is not None:
            _check_url(f"backend {self.name!r} status_url", self.status_url)
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        if not isinstance(self.forward_caller_auth, bool):
            raise ValueError(
                f"backend {self.name!r} forward_caller_auth must be True or False, "
                f"got {self.forward_caller_auth!r}"
            )
        if self.stream_end is not None and (
            not isinstance(self.stream_end, str) or not self.stream_end.strip()
        ):
            raise ValueError(
                f"backend {self.name!r} stream_end must be a non-empty string or None, "
                f"got {self.stream_end!r}"
            )
        check_format(f"backend {self.name!r} wire_format", self.wire_format)
        who = f"backend {self.name!r}"
        limit = count(f"{who} max_in_flight", self.max_in_flight, allow_none=True)
        object.__setattr__(self, "max_in_flight", limit)
        stall = duration(f"{who} stall_after", self.stall_after, allow_none=True)
        object.__setattr__(self, "stall_after", stall)


class Routes(Mapping[str, tuple[Backend, ...]]):
    """Logical model name -> its chain of backends, in order.

    ``Routes({"echo": [Backend(...), Backend(...)]})``. An empty chain, a
    duplicate backend name within a chain, or a route name that is empty is a
    ``ValueError`` naming the route. ``wire_formats`` maps a route to the wire
    format its requests speak (see :mod:`tierchain.wire`), whatever their path;
    a backend's own ``wire_format`` still wins for that backend.
    """

    __slots__ = ("_formats", "_routes")

    def __init__(
        self,
        routes: Mapping[str, Iterable[Backend]],
        *,
        wire_formats: Mapping[str, str] | None = None,
    ) -> None:
        built: dict[str, tuple[Backend, ...]] = {}
        for route, backends in routes.items():
            if not isinstance(route, str) or not route:
                raise ValueError(f"route name {route!r} must be a non-empty string")
            chain = tuple(backends)
            if not chain:
                raise ValueError(f"route {route!r} has an empty chain; give it a backend")
            seen: set[str] = set()
            for backend in chain:
                if not isinstance(backend, Backend):
                    raise ValueError(f"route {route!r} holds {backend!r}, which is not a Backend")
                if backend.name in seen:
                    raise ValueError(f"route {route!r} names backend {backend.name!r} twice")
                seen.add(backend.name)
            built[route] = chain
        if not built:
            raise ValueError("Routes needs at least one route")
        self._routes = built
        formats: dict[str, str] = {}
        for route, wire in (wire_formats or {}).items():
            if route not in built:
                raise ValueError(f"wire_formats names route {route!r}, which is not a route")
            formats[route] = check_format(f"route {route!r} wire_format", wire) or ""
        self._formats = {r: w for r, w in formats.items() if w}

    def __getitem__(self, route: str) -> tuple[Backend, ...]:
        return self._routes[route]

    def __contains__(self, route: object) -> bool:
        return route in self._routes

    def __iter__(self) -> Iterator[str]:
        return iter(self._routes)

    def __len__(self) -> int:
        return len(self._routes)

    def __repr__(self) -> str:
        inner = ", ".join(f"{r!r}: [{', '.join(b.name for b in c)}]" for r, c in self.items())
        return f"Routes({{{inner}}})"

    def wire_format(self, route: str) -> str | None:
        """The wire format set for ``route`` (None: recognised from each request's path)."""
        return self._formats.get(route)

    def backend(self, route: str, name: str) -> Backend | None:
        """The backend called ``name`` in ``route``'s chain, or None."""
        for backend in self._routes.get(route, ()):
            if backend.name == name:
                return backend
        return None
