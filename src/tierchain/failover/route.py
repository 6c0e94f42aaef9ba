"""Failover's routing of one request: its route from the body, the reorderings.

The body is read once for its ``model`` (and ``stream``) by the C scanner where it can
(:func:`route_of`); the reorderers outer layers registered (PreferBackend, pins) are
applied as permutations only (:func:`reordered`); :class:`ScopeCopy` keeps the scope as
it came, for the attempts after the first. See docs/failover.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container
from typing import Any, NamedTuple

from .. import _json
from .._types import Scope
from ..backend import Backend
from ..errors import (
    ResolveError,
)
from ..request import (
    TierRequest,
)
from ..telemetry import (
    log_event,
)
from .answers import Refusal

__all__ = ["Resolver", "ScopeCopy", "Shape", "reordered", "route_of", "shape_of"]

Resolver = Callable[[Scope, bytes], str]
# The key tuples of the scopes seen (one per shape: server, framework, mounts).
_SCOPE_SHAPES: dict[tuple[str, ...], tuple[str, ...]] = {}
_SCOPE_SHAPES_MAX = 256
# The C scanner, when the json module has it.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


_ROUTING = frozenset({"model", "stream"})  # what routing reads of a body
_PASSED_OVER = 2**20  # a body longer than this is not parsed to route it: its members are read


class Shape(NamedTuple):
    """What :func:`shape_of` learned of a long body before anything parsed it."""

    containers: int | None
    """Its arrays and objects outside strings (None: not counted)."""
    top: dict[str, Any] | None
    """Its ``model`` and ``stream`` members, read without parsing the rest (None: not read,
    so routing parses the body)."""


async def shape_of(req: TierRequest, body: bytes, *, read_top: bool) -> Shape | Refusal:
    """The body's shape (:class:`Shape`), or the caller's 400 for a body that holds too many
    values to parse on the event loop (:func:`_json.check_shape`). With ``read_top`` (no
    resolver of the host's) a body over 1 MiB has its routing members read on their own
    (:func:`_json.members`): its megabytes of messages are never parsed on the loop here."""
    try:
        containers = await _json.check_shape(body)
    except _json.TooComplex as exc:
        req.streaming = False  # (nothing outside parses it to ask either)
        return Refusal(
            400,
            f"the request body is too complex to route: {exc}",
            "invalid_request_error",
            "invalid_body",
        )
    top = None
    if read_top and len(body) > _PASSED_OVER:
        top = await _json.members(body, _ROUTING)
    return Shape(containers, top)


def _loaded(body: bytes, containers: int | None = None) -> dict[str, Any]:
    """A body the scanner alone did not read, by the loader (:mod:`tierchain._json`)."""
    try:
        data = _json.loads(body, containers=containers)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ResolveError(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResolveError("the request body must be a JSON object with a string 'model'")
    return data


def route_of(
    resolve: Resolver | None,
    routes: Container[str],
    known: str,
    scope: Scope,
    req: TierRequest,
    body: bytes,
    shape: Shape | None = None,
) -> str | Refusal:
    """The request's route, or why it has none (the caller's 400 or 404); ``routes``: the
    routes' names (a Routes, or a mapping keyed by them), ``known``: the same, for the
    404's message; ``shape``: what :func:`shape_of` learned of a long body (its arrays and
    objects outside strings, else counted here, strings and all; its routing members, else
    the body is parsed here)."""
    try:
        if resolve is not None:
            route = resolve(scope, body)
        else:
            # The usual body, a UTF-8 JSON object, read by the scanner alone (json.loads'
            # parser without its encoding detection and its Python-level wrappers; here,
            # not in a function of its own: a frame less a request). Anything unusual (or
            # wrong) is left to the loader, which bounds the depth and gives the error.
            data: dict[str, Any] | None = None
            containers = None
            if shape is not None:
                data, containers = shape.top, shape.containers
            # (a text with many brackets is left to the loader, which checks its depth)
            if (
                data is None
                and body[:1] == b"{"
                and (_json.depth_ok(body) if containers is None else containers <= _json.MAX_DEPTH)
            ):
                try:
                    text = body.decode()
                    scanned, end = _scan(text, 0)
                except (StopIteration, UnicodeDecodeError, ValueError):
                    pass
                else:
                    # Nothing but blanks after the object (else the loader says what).
                    if isinstance(scanned, dict) and (
                        end == len(text) or not text[end:].strip(" \t\n\r")
                    ):
                        data = scanned
            if data is None:
                data = _loaded(body, containers)
            model = data.get("model")
            if not isinstance(model, str):
                raise ResolveError("the request body has no string 'model' to route on")
            route = model
            if req.streaming is None:
                req.streaming = data.get("stream") is True
    except ResolveError as exc:
        return Refusal(400, str(exc), "invalid_request_error", "invalid_body")
    if route not in routes:
        shown = route if len(route) <= 200 else route[:200] + "..."
        return Refusal(
            404,
            f"no route for model {shown!r}; known routes: {known}",
            "invalid_request_error",
            "model_not_found",
        )
    return route


async def reordered(route: str, chain: tuple[Backend, ...], reorder: Any) -> tuple[Backend, ...]:
    """``chain`` as ``reorder`` proposes it, if that is a permutation of it (a hint
    reorders, never filters); else ``chain``."""
    try:
        proposed = tuple(await reorder(route, chain))
    except Exception as exc:  # a hint must never fail a request
        log_event("request.reorder_failed", error=repr(exc), route=route)
        return chain
    if len(proposed) != len(chain) or set(proposed) != set(chain):
        log_event("request.reorder_refused", route=route, reason="not a permutation")
        return chain
    return proposed


class ScopeCopy:
    """The scope as it came, for the attempts after the first: routers (Starlette's Mount,
    Litestar) rewrite it as they dispatch, and a replay must start from the original. Its
    values, with its keys kept once for every request of the same shape; calling it makes a
    fresh copy; :meth:`next` gives the scope itself once, first."""

    __slots__ = ("keys", "scope", "values")

    def __init__(self, scope: Scope) -> None:
        self.scope: Scope | None = scope
        keys = tuple(scope)
        shape = _SCOPE_SHAPES.get(keys)  # (a shape seen before: the usual case)
        if shape is None:
            if len(_SCOPE_SHAPES) < _SCOPE_SHAPES_MAX:
                _SCOPE_SHAPES[keys] = keys
        else:
            keys = shape
        self.keys = keys
        self.values = tuple(scope.values())

    def __call__(self) -> Scope:
        return dict(zip(self.keys, self.values, strict=True))

    def next(self) -> Scope:
        """The scope itself the first time (the first attempt that calls the app), a
        fresh copy after."""
        scope = self.scope
        if scope is None:
            return self()
        self.scope = None
        return scope
