"""The whole gateway from its configuration: the store, the stack, the mounts.

:mod:`tierchain.config` reads and checks the variables; this module builds
what they describe::

    from tierchain.config import from_env
    from tierchain.stack import build_stack

    app = build_stack(None, from_env())   # the whole stack around a Forwarder

Outermost first, :func:`build_stack` assembles: the identity line, the Admin
mount (when a token is set), the :class:`~tierchain.endpoints.Endpoints`
(``/v1/models``, ``/healthz``, ``/readyz``, ``/metrics``), then Heartbeats,
Budget, PreferBackend, Failover, Breaker, SaturationWatchdog (each that is
enabled), then the handler.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ._types import ASGIApp, Message, Receive, Scope, Send
from .config import (
    ConfigError,
    Settings,
    display_value,
    find_layer,
    layer_class,
    make_store,
)
from .endpoints import Endpoints
from .identity import StartupIdentity
from .keys import CallerKey, load_keys_file
from .limits import BackendBudget, BackendBudgets, KeyLimits, load_budgets

__all__ = ["CloseOnShutdown", "Mount", "build_stack", "make_store"]


class Mount:
    """Send requests under ``path`` to ``mounted`` (with ``root_path`` set), the rest to ``app``."""

    def __init__(self, app: ASGIApp, *, path: str, mounted: ASGIApp) -> None:
        self.app = app
        self.path = path
        self.mounted = mounted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if path == self.path or path.startswith(self.path + "/"):
                child = dict(scope)
                child["root_path"] = scope.get("root_path", "") + self.path
                child["path"] = path[len(self.path) :] or "/"
                return await self.mounted(child, receive, send)
        await self.app(scope, receive, send)


class CloseOnShutdown:
    """Pass everything to ``app``; when its lifespan shut-down completes, await ``close()`` first.

    :func:`build_stack` uses it for the store it made itself (a RedisStore's
    connection pool and pending writes), so that the store's owner closes it.
    """

    def __init__(self, app: ASGIApp, *, close: Callable[[], Awaitable[None]]) -> None:
        self.app = app
        self.close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            return await self.app(scope, receive, send)

        async def closing_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.close()
            await send(message)

        await self.app(scope, receive, closing_send)


def build_stack(
    app: ASGIApp | None,
    settings: Settings,
    *,
    store: Any = None,
    identity: bool | None = None,
) -> ASGIApp:
    """Wrap ``app`` (default: a configured :class:`~tierchain.Forwarder`) in the stack.

    Outermost first: the identity line, the Admin mount (when a token is set),
    the :class:`~tierchain.endpoints.Endpoints` (answered here, never
    forwarded), then :class:`~tierchain.keys.CallerKeys` (when keys are set),
    then :class:`~tierchain.limits.KeyLimits` (when a key has a limit or the keys
    file a backend budget; :class:`~tierchain.limits.BackendBudgets` then stands
    in front of the handler), then Shed (when ``TIERCHAIN_SHED_MAX_CONCURRENT`` is set),
    Heartbeats, Budget, PreferBackend, Failover, Breaker, SaturationWatchdog:
    each that is enabled, with its configured options. The watchdog's status
    board is given to the Breaker and the Failover around it (``status_board``). One
    store (``store``, or one made from ``TIERCHAIN_STORE_URL``) is shared by
    every piece that takes one; a store made here is closed on lifespan
    shut-down. A constructor that rejects its options raises
    :class:`~tierchain.config.ConfigError` naming the variables it was given.
    """
    problems: list[str] = []
    keys, budgets = _keys_and_budgets(settings, problems)
    limited = any(k.limited for k in keys) or bool(budgets)
    needs_store = (
        settings.admin_enabled
        or limited
        or any("store" in find_layer(n).wired for n in settings.stack)
    )
    made_store = store is None and needs_store
    if made_store:
        store = make_store(settings)

    def construct(name: str, *args: Any, **wired: Any) -> Any:
        try:
            kwargs = settings.middleware_kwargs(name, store=store)
            return layer_class(name)(*args, **kwargs, **wired)
        except (TypeError, ValueError) as exc:
            given = ", ".join(
                f"{env}={display_value(name, opt, settings.layers[name].options[opt])!r}"
                for opt, env in settings.layers[name].sources.items()
            )
            problems.append(f"{name} rejected its options ({given or 'defaults'}): {exc}")
            return None

    inner = app if app is not None else construct("Forwarder")
    if budgets and inner is not None:
        inner = BackendBudgets(inner, store=store, budgets=budgets)  # per attempt, innermost
    board: Any = None  # the watchdog's status board, given to the layers that wrap it
    for name in reversed(settings.stack):
        wired = {"status_board": board} if "status_board" in find_layer(name).wired else {}
        built = construct(name, inner, **wired)
        if built is not None:
            inner = built
            board = getattr(built, "board", None) if name == "SaturationWatchdog" else board
    if settings.layers["Shed"].options.get("max_concurrent") is not None:
        shed = construct("Shed", inner)  # outermost of the middlewares
        if shed is not None:
            inner = shed
    if settings.layers["CallerKeys"].options:
        # Keys before anything else routed (Shed included); the endpoints stay open.
        prefer = settings.layers["PreferBackend"].options.get("header", "X-Prefer-Backend")
        if limited:
            inner = KeyLimits(inner, store=store, budgets=budgets)  # right behind the keys
        keyed = construct("CallerKeys", inner, header=prefer)
        if keyed is not None:
            inner = keyed
    inner = Endpoints(
        inner,
        routes=settings.routes,
        store=store if "Breaker" in settings.stack else None,
        **settings.layers["Endpoints"].options,
    )
    if settings.admin_enabled:
        admin = construct("Admin", keys=keys)
        if admin is not None:
            inner = Mount(inner, path=settings.admin_path, mounted=admin)
    if problems:
        raise ConfigError(problems)
    if made_store and hasattr(store, "aclose"):
        inner = CloseOnShutdown(inner, close=store.aclose)
    if settings.identity if identity is None else identity:
        inner = StartupIdentity(inner, settings=settings)
    return inner


def _keys_and_budgets(
    settings: Settings, problems: list[str]
) -> tuple[tuple[CallerKey, ...], tuple[BackendBudget, ...]]:
    """The caller keys (with their limits) and the backend budgets the keys file sets."""
    options = settings.layers["CallerKeys"].options
    keys: tuple[CallerKey, ...] = tuple(options.get("keys", ()))
    path = options.get("keys_file")
    if path is None:
        return keys, ()
    try:
        return keys + load_keys_file(path), load_budgets(path)
    except (OSError, ValueError) as exc:
        problems.append(f"TIERCHAIN_API_KEYS_FILE={path}: {exc}")
        return keys, ()
