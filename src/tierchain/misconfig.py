"""Warnings: a configuration that loads, but will not do what it looks like.

Each check is a function of the :class:`~tierchain.config.Settings` listed in
:data:`WARNINGS`, so a new one is one function and one line; ``check-config`` prints them,
``serve`` logs them (:func:`config_warnings`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

from .backend import Backend, Pool, Routes
from .masking import mask_url
from .settings import Settings

__all__ = ["WARNINGS", "Check", "config_warnings"]

Check = Callable[["Settings"], Iterable[str]]


def _v1_twice(settings: Settings) -> Iterator[str]:
    """A backend URL ending in /v1 while the requests sent to it already start with /v1
    (the base URL copied from a client's settings): every request would be a 404."""
    if settings.routes is None:
        return
    failover = settings.layers["Failover"]
    paths: tuple[str, ...] = failover.options.get("paths", failover.defaults.get("paths", ("/",)))
    carried = [p for p in paths if p == "/" or p.startswith("/v1")]
    if not carried:
        return
    given = failover.sources.get("paths")
    how = f"{given}={','.join(paths)}" if given else f"Failover paths {','.join(paths)}"
    prefix = f"{settings.routes_file}: " if settings.routes_file else ""
    for route in settings.routes:
        for at, backend in _placed(settings.routes, route):
            parts = urlsplit(backend.url)
            if not parts.path.rstrip("/").endswith("/v1"):
                continue
            base = mask_url(parts._replace(path=parts.path.rstrip("/")[: -len("/v1")]).geturl())
            shown = mask_url(backend.url)
            yield (
                f"{prefix}routes.{route}.{at}.url={shown!r} (backend {backend.name!r}): "
                f"its path ends in /v1 and the requests sent to it already start with /v1 ({how}), "
                f"so /v1/chat/completions would go to {shown.rstrip('/')}/v1/chat/completions, "
                f"a 404 on every request; expected the base URL without /v1: {base!r}"
            )


def _placed(routes: Routes, route: str) -> Iterator[tuple[str, Backend]]:
    """Each backend of ``route`` with its key path in the routes file (``backends[1]``, or
    ``backends[0].backends[1]`` for a pool's replica)."""
    for i, tier in enumerate(routes.tiers(route)):
        if isinstance(tier, Pool):
            for j, replica in enumerate(tier.backends):
                yield f"backends[{i}].backends[{j}]", replica
        else:
            yield f"backends[{i}]", tier


def _windows(settings: Settings) -> Iterable[str]:
    """The first-chunk windows against the budget and the reserve (see ``window_warnings``)."""
    from .watchdog import SaturationWatchdog, window_warnings  # (stack-side, imported late)

    if settings.routes is None or "Failover" not in settings.stack:
        return []
    watchdog = None
    if "SaturationWatchdog" in settings.stack:
        kwargs = settings.middleware_kwargs("SaturationWatchdog")
        kwargs["status_interval"] = 0  # only its windows are read: no status board
        watchdog = SaturationWatchdog(_no_app, **kwargs)
    budget = None
    if "Budget" in settings.stack:
        layer = settings.layers["Budget"]
        budget = layer.options.get("default", layer.defaults.get("default"))
    chains = {route: settings.routes[route] for route in settings.routes}
    return window_warnings(watchdog, chains, budget)


async def _no_app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
    return None


WARNINGS: tuple[Check, ...] = (_v1_twice, _windows)
"""The warning checks ``check-config`` and ``serve`` run: each takes the
:class:`Settings` and returns its warnings, one sentence each (add a check with one line)."""


def config_warnings(settings: Settings) -> list[str]:
    """Every warning about ``settings`` (exit 0 all the same: the gateway can start)."""
    return [warning for check in WARNINGS for warning in check(settings)]
