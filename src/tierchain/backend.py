"""`Backend`, `Pool` and `Routes`: what a request may be sent to, in which order.

A chain's positions (its tiers) each hold a :class:`Backend` or a :class:`Pool`
of replicas. :class:`Routes` keeps both views: ``routes[route]`` is every
backend of the chain in order, a pool's replicas side by side (what breakers,
leases, readiness and pins are keyed by), and :meth:`Routes.tiers` the tiers as
given. Each replica of a pool knows its pool (``Backend.pool``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from types import MappingProxyType
from urllib.parse import urlsplit

from ._checks import count, duration
from .masking import MASK, SECRET_NAME, mask_text, mask_url
from .wire import check_format

__all__ = ["BACKEND_NAME", "Backend", "Pool", "Routes", "check_url", "is_local"]

BACKEND_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
"""What a backend's (or a pool's) name may be: 1-64 characters from ``A-Z a-z 0-9 . _ -``."""


def check_url(what: str, url: str) -> str:
    """``url`` when it is an http or https URL with a host; ``ValueError`` naming ``what``
    (and the URL, masked) otherwise."""
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

    ``name`` identifies it everywhere; ``url`` is its base URL. The other options say
    how to reach and judge it: headers to add, its wire format and stream end, how many
    attempts it takes at once, the hardware it shares, its retries, prefill and hedging.

    Options: [Backend options](failover.md#backend).
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
    shares: str | None = None
    retries: int | None = None
    prefill: bool | None = None
    hedge: bool | None = None
    price_input: float | None = None
    """What a million input tokens cost here (None: not priced; 0: free, as a local tier)."""
    price_output: float | None = None
    """What a million output tokens cost here (None: not priced)."""
    first_token: float | timedelta | None = None  # a float (or None) once built
    pool: str | None = field(default=None, init=False, compare=False)

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            if f.repr:
                value = getattr(self, f.name)
                if f.name == "pool" and value is None:
                    continue
                if f.name.endswith("url") and isinstance(value, str):
                    value = mask_url(value)
                elif SECRET_NAME.search(f.name) and isinstance(value, str) and value:
                    value = MASK
                shown.append(f"{f.name}={value!r}")
        if self.headers:
            shown.append(f"headers=<{', '.join(sorted(self.headers))}: values not shown>")
        return f"Backend({', '.join(shown)})"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not BACKEND_NAME.fullmatch(self.name):
            raise ValueError(
                f"backend name {self.name!r} must be 1-64 characters from A-Z a-z 0-9 . _ -"
            )
        check_url(f"backend {self.name!r} url", self.url)
        if self.status_url is not None:
            check_url(f"backend {self.name!r} status_url", self.status_url)
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
        if self.hedge is not None and not isinstance(self.hedge, bool):
            raise ValueError(
                f"backend {self.name!r} hedge must be True, False or None, got {self.hedge!r}"
            )
        if self.prefill is not None and not isinstance(self.prefill, bool):
            raise ValueError(
                f"backend {self.name!r} prefill must be True, False or None, got {self.prefill!r}"
            )
        if self.shares is not None and (not isinstance(self.shares, str) or not self.shares):
            raise ValueError(
                f"backend {self.name!r} shares must be a non-empty string such as 'gpu0' or None, "
                f"got {self.shares!r}"
            )
        who = f"backend {self.name!r}"
        limit = count(f"{who} max_in_flight", self.max_in_flight, allow_none=True)
        object.__setattr__(self, "max_in_flight", limit)
        stall = duration(f"{who} stall_after", self.stall_after, allow_none=True)
        object.__setattr__(self, "stall_after", stall)
        first = duration(f"{who} first_token", self.first_token, allow_none=True)
        object.__setattr__(self, "first_token", first)
        again = count(f"{who} retries", self.retries, minimum=0, allow_none=True)
        object.__setattr__(self, "retries", again)
        for side in ("price_input", "price_output"):
            object.__setattr__(self, side, _price(f"{who} {side}", getattr(self, side)))


def _price(what: str, value: object) -> float | None:
    """A price per million tokens: a finite number >= 0, or None."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or value > 1e6
    ):
        raise ValueError(
            f"{what} must be a price per million tokens: a number from 0 to 1000000, got {value!r}"
        )
    return float(value)


def is_local(backend: Backend) -> bool:
    """True for a local backend: regime ``local``, or, when no regime was written, a URL
    host that is ``localhost``, a loopback or a private address. A declared regime wins
    over the address: a paid API behind a private endpoint (a VPC link, a corporate
    proxy) declared ``hosted`` is not local. (What hedging and the gateway's own checks
    of a saturated backend go by.)"""
    if backend.regime is not None:
        return backend.regime == "local"
    host = urlsplit(backend.url).hostname or ""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


@dataclass(frozen=True, slots=True)
class Pool:
    """Several replicas standing in one tier of a chain.

    ``Pool(name="tower", backends=[Backend(...), Backend(...)])`` stands where a
    :class:`Backend` stands in a :class:`Routes` chain. An attempt at the pool
    picks one replica by its live state (see :mod:`tierchain.picker`); a replica
    that fails before anything reached the caller is followed by another replica
    of the pool, then by the next tier. ``name`` follows the backend name rules
    and names the pool in heartbeat lines, the attempt trail and a preference
    header; each replica keeps its own name, breaker, leases and learned normals.
    ``backends`` holds copies of the given backends with ``pool`` set to ``name``.

    Options: [Pools](pools.md).
    """

    name: str
    backends: Sequence[Backend]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not BACKEND_NAME.fullmatch(self.name):
            raise ValueError(
                f"pool name {self.name!r} must be 1-64 characters from A-Z a-z 0-9 . _ -"
            )
        given = self.backends
        if isinstance(given, Backend | str | bytes) or not isinstance(given, Iterable):
            raise ValueError(f"pool {self.name!r} backends must be a list of Backend")
        replicas = []
        seen: set[str] = set()
        for backend in given:
            if not isinstance(backend, Backend):
                raise ValueError(f"pool {self.name!r} holds {backend!r}, which is not a Backend")
            if backend.name in seen:
                raise ValueError(f"pool {self.name!r} names backend {backend.name!r} twice")
            if backend.name == self.name:
                raise ValueError(
                    f"pool {self.name!r} holds a backend of the same name; give each its own"
                )
            seen.add(backend.name)
            replica = dataclasses.replace(backend)
            object.__setattr__(replica, "pool", self.name)
            replicas.append(replica)
        if not replicas:
            raise ValueError(f"pool {self.name!r} has no backends; give it at least one")
        object.__setattr__(self, "backends", tuple(replicas))

    def __repr__(self) -> str:
        return f"Pool(name={self.name!r}, backends=[{', '.join(b.name for b in self.backends)}])"


Tier = Backend | Pool
"""What stands in one position of a chain."""


class Routes(Mapping[str, tuple[Backend, ...]]):
    """Logical model name -> its chain of backends, in order.

    ``Routes({"echo": [Backend(...), Backend(...)]})``; a :class:`Pool` may stand
    where a Backend stands, and ``routes[route]`` then lists its replicas side
    by side (:meth:`tiers` gives the chain as written). ``wire_formats`` and
    ``continuations`` set a route's wire format and continuations.

    Options: [Routes options](failover.md#routes).
    """

    __slots__ = ("_continuations", "_formats", "_routes", "_tiers", "pooled", "shared")

    def __init__(
        self,
        routes: Mapping[str, Iterable[Backend | Pool]],
        *,
        wire_formats: Mapping[str, str] | None = None,
        continuations: Mapping[str, int] | None = None,
    ) -> None:
        built: dict[str, tuple[Backend, ...]] = {}
        tiers: dict[str, tuple[Backend | Pool, ...]] = {}
        pooled: set[str] = set()
        shared: set[str] = set()
        for route, backends in routes.items():
            if not isinstance(route, str) or not route:
                raise ValueError(f"route name {route!r} must be a non-empty string")
            given = tuple(backends)
            if not given:
                raise ValueError(f"route {route!r} has an empty chain; give it a backend")
            seen: set[str] = set()
            chain: list[Backend] = []
            for tier in given:
                if isinstance(tier, Pool):
                    if tier.name in seen:
                        raise ValueError(f"route {route!r} names {tier.name!r} twice")
                    seen.add(tier.name)
                    members = tier.backends
                    pooled.add(route)
                elif isinstance(tier, Backend):
                    if tier.pool is not None:
                        raise ValueError(
                            f"route {route!r} holds backend {tier.name!r} of pool {tier.pool!r} "
                            "on its own; put the Pool in the chain"
                        )
                    members = (tier,)
                else:
                    raise ValueError(
                        f"route {route!r} holds {tier!r}, which is not a Backend or a Pool"
                    )
                for backend in members:
                    if backend.name in seen:
                        raise ValueError(f"route {route!r} names backend {backend.name!r} twice")
                    seen.add(backend.name)
                    if backend.shares is not None:
                        shared.add(route)
                    chain.append(backend)
            built[route] = tuple(chain)
            tiers[route] = given
        if not built:
            raise ValueError("Routes needs at least one route")
        self._routes = built
        self._tiers = tiers
        self.pooled: frozenset[str] = frozenset(pooled)
        """The routes with a pool in their chain."""
        self.shared: frozenset[str] = frozenset(shared)
        """The routes with a backend that ``shares`` hardware."""
        formats: dict[str, str] = {}
        for route, wire in (wire_formats or {}).items():
            if route not in built:
                raise ValueError(f"wire_formats names route {route!r}, which is not a route")
            formats[route] = check_format(f"route {route!r} wire_format", wire) or ""
        self._formats = {r: w for r, w in formats.items() if w}
        self._continuations: dict[str, int] = {}
        for route, n in (continuations or {}).items():
            if route not in built:
                raise ValueError(f"continuations names route {route!r}, which is not a route")
            self._continuations[route] = count(f"route {route!r} continuations", n, minimum=0)

    def __getitem__(self, route: str) -> tuple[Backend, ...]:
        return self._routes[route]

    def __contains__(self, route: object) -> bool:
        return route in self._routes

    def __iter__(self) -> Iterator[str]:
        return iter(self._routes)

    def __len__(self) -> int:
        return len(self._routes)

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{r!r}: [{', '.join(_shown(t) for t in c)}]" for r, c in self._tiers.items()
        )
        return f"Routes({{{inner}}})"

    def tiers(self, route: str) -> tuple[Backend | Pool, ...]:
        """``route``'s chain as given: a Backend or a Pool per tier."""
        return self._tiers[route]

    def wire_format(self, route: str) -> str | None:
        """The wire format set for ``route`` (None: recognised from each request's path)."""
        return self._formats.get(route)

    def continuations(self, route: str, default: int) -> int:
        """How many times a request on ``route`` may be continued (``default``: unset)."""
        return self._continuations.get(route, default)

    def backend(self, route: str, name: str) -> Backend | None:
        """The backend called ``name`` in ``route``'s chain, or None."""
        for backend in self._routes.get(route, ()):
            if backend.name == name:
                return backend
        return None


def _shown(tier: Backend | Pool) -> str:
    if isinstance(tier, Pool):
        return f"{tier.name}({', '.join(b.name for b in tier.backends)})"
    return tier.name
