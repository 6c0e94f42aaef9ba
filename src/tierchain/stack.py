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

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ._types import ASGIApp, Message, Receive, Scope, Send
from .accounts import period_text
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
from .usage import DEFAULT_MAX_TOKENS

__all__ = ["CloseOnShutdown", "Mount", "build_stack", "conflicts", "make_store", "unrouted"]


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
    then :class:`~tierchain.limits.KeyLimits` (with the keys: it counts every key's
    usage and enforces the limits of those that have some; with backend budgets in
    the keys file, :class:`~tierchain.limits.BackendBudgets` stands in front of the
    handler), then Shed (when ``TIERCHAIN_SHED_MAX_CONCURRENT`` is set),
    Heartbeats, Budget, PreferBackend, Failover, Breaker, SaturationWatchdog:
    each that is enabled, with its configured options. The watchdog's status
    board is given to the Breaker and the Failover around it (``status_board``). One
    store (``store``, or one made from ``TIERCHAIN_STORE_URL``) is shared by
    every piece that takes one; a store made here is closed on lifespan
    shut-down. A constructor that rejects its options raises
    :class:`~tierchain.config.ConfigError` naming the variables it was given, and so
    does a pair of options that cannot work together (:func:`conflicts`).
    """
    problems: list[str] = []
    keys, budgets = _keys_and_budgets(settings, problems)
    problems.extend(conflicts(settings, keys, budgets, own_forwarder=app is None))
    keyed = bool(settings.layers["CallerKeys"].options)
    made_store = store is None and _needs_store(settings, keyed, budgets)
    if made_store:
        store = make_store(settings)
    construct = _Construct(settings, store, problems)
    inner = app if app is not None else construct("Forwarder")
    if budgets and inner is not None:
        inner = BackendBudgets(inner, store=store, budgets=budgets)  # per attempt, innermost
    inner = _middlewares(construct, settings, inner)
    if keyed:
        inner = _keyed(construct, settings, inner, keys, budgets)
    inner = _front(construct, settings, inner, keys)
    if problems:
        raise ConfigError(problems)
    if made_store and hasattr(store, "aclose"):
        inner = CloseOnShutdown(inner, close=store.aclose)
    if settings.identity if identity is None else identity:
        view = limits_view(settings)
        extra = {"limits": view} if view is not None else None
        inner = StartupIdentity(inner, settings=settings, extra=extra)
    return inner


class _Construct:
    """One configured piece built by name, with the shared store; a constructor that rejects
    its options adds a problem naming the variables it was given, and builds nothing."""

    def __init__(self, settings: Settings, store: Any, problems: list[str]) -> None:
        self.settings = settings
        self.store = store
        self.problems = problems

    def __call__(self, name: str, *args: Any, **wired: Any) -> Any:
        settings = self.settings
        try:
            kwargs = settings.middleware_kwargs(name, store=self.store)
            return layer_class(name)(*args, **kwargs, **wired)
        except (TypeError, ValueError) as exc:
            given = ", ".join(
                f"{env}={display_value(name, opt, settings.layers[name].options[opt])!r}"
                for opt, env in settings.layers[name].sources.items()
            )
            self.problems.append(f"{name} rejected its options ({given or 'defaults'}): {exc}")
            return None


def _needs_store(settings: Settings, keyed: bool, budgets: Sequence[BackendBudget]) -> bool:
    """Does any piece of the stack take the store (the Admin, the keys' limits, budgets, a
    middleware wired to it)?"""
    return (
        settings.admin_enabled
        or keyed
        or bool(budgets)
        or any("store" in find_layer(n).wired for n in settings.stack)
    )


def _middlewares(construct: _Construct, settings: Settings, inner: Any) -> Any:
    """The enabled middlewares around ``inner``, innermost first, then Shed outermost (when
    ``TIERCHAIN_SHED_MAX_CONCURRENT`` is set); the watchdog's status board is given to the
    layers that wrap it."""
    board: Any = None
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
    return inner


def _keyed(
    construct: _Construct,
    settings: Settings,
    inner: Any,
    keys: Sequence[CallerKey],
    budgets: Sequence[BackendBudget],
) -> Any:
    """Keys before anything else routed (Shed included); the endpoints stay open. Every key's
    usage is counted (and limited, where it has limits) right behind them."""
    prefer = settings.layers["PreferBackend"].options.get("header", "X-Prefer-Backend")
    failover = settings.layers["Failover"].options  # (the body as Failover reads it)
    body = {k: failover[k] for k in ("max_body", "body_timeout") if k in failover}
    limited = any(k.limited for k in keys) or bool(budgets)
    if not (limited and settings.layers["CallerKeys"].options.get("open_paths")):
        # (with open paths, conflicts() has refused the limits already: said once)
        inner = KeyLimits(inner, store=construct.store, budgets=budgets, **body)
    with_keys = construct("CallerKeys", inner, header=prefer)
    return inner if with_keys is None else with_keys


def _front(construct: _Construct, settings: Settings, inner: Any, keys: Sequence[CallerKey]) -> Any:
    """The gateway's own endpoints in front, and the Admin mounted when a token is set."""
    all_keyed = settings.keys_on and not settings.layers["CallerKeys"].options.get("open_paths")
    inner = Endpoints(
        inner,
        routes=settings.routes,
        store=construct.store if "Breaker" in settings.stack else None,
        # Every caller keyed: the prefix affinity is per key, nobody can probe another's.
        prompt_metrics=True if all_keyed else None,
        **settings.layers["Endpoints"].options,
    )
    if settings.admin_enabled:
        admin = construct("Admin", keys=keys)
        if admin is not None:
            inner = Mount(inner, path=settings.admin_path, mounted=admin)
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


def conflicts(
    settings: Settings,
    keys: tuple[CallerKey, ...],
    budgets: tuple[BackendBudget, ...],
    *,
    own_forwarder: bool,
) -> list[str]:
    """Options that load one by one but cannot work together: one sentence and a hint each.

    ``tierchain serve``, ``check-config`` and :func:`build_stack` refuse to start
    on any of them rather than answer a request with a 500 or do nothing the
    operator asked for. ``own_forwarder``: the stack ends in its own Forwarder
    (what ``tierchain serve`` runs), not in a host's handler.
    """
    found: list[str] = []
    keys_layer = settings.layers["CallerKeys"]
    open_paths = keys_layer.options.get("open_paths")
    limited = [k.name for k in keys if k.limited]
    if open_paths and (limited or budgets):
        what = (
            f"key limits ({', '.join(repr(n) for n in limited)})"
            if limited
            else "[[backend_budgets]]"
        )
        found.append(
            f"{keys_layer.sources.get('open_paths', 'open_paths')}={','.join(open_paths)} "
            f"cannot work with {what} in {keys_layer.sources.get('keys_file', 'the keys file')}: "
            "a request without a key on an open path has no key to limit or count, so the "
            "limits would not hold; remove the open paths, or the limits (serve the open paths "
            "from a gateway of their own)"
        )
    if own_forwarder:
        found.extend(unrouted(settings))
    found.extend(_room_never_used(settings))
    secrets = {
        "TIERCHAIN_ADMIN_TOKEN": settings.layers["Admin"].options.get("token"),
        "TIERCHAIN_METRICS_KEY": settings.layers["Endpoints"].options.get("metrics_key"),
    }
    for variable, secret in secrets.items():
        shared = [k.name for k in keys if secret is not None and k.key == secret]
        if shared:
            found.append(
                f"{variable} is the same as caller key {shared[0]!r}: that caller could "
                f"{'administer the gateway' if 'ADMIN' in variable else 'read /metrics'}; "
                "give it a value of its own"
            )
    steering = [k.name for k in keys if k.backend is not None or k.prefer]
    if steering and "PreferBackend" not in settings.stack:
        found.append(
            f"keys {', '.join(repr(n) for n in steering)} steer (prefer or backend) but "
            "PreferBackend is not in TIERCHAIN_STACK, so nothing would honour them; add "
            "PreferBackend to TIERCHAIN_STACK or drop prefer and backend from those keys"
        )
    names = _backend_names(settings)
    if names is not None:
        for key in keys:
            if key.backend is not None and key.backend not in names:
                found.append(
                    f"key {key.name!r}: backend = {key.backend!r} is no backend or pool of "
                    f"any route (known: {', '.join(sorted(names))})"
                )
        for budget in budgets:
            if budget.backend not in names:
                found.append(
                    f"[[backend_budgets]] backend = {budget.backend!r} is no backend of any "
                    f"route, so its budget would never be spent (known: {', '.join(sorted(names))})"
                )
    return found


def unrouted(settings: Settings) -> list[str]:
    """The stack ``tierchain serve`` builds (its own Forwarder) without Failover: nothing
    would tell the Forwarder where to send a request."""
    if "Failover" in settings.stack:
        return []
    return [
        f"TIERCHAIN_STACK={','.join(settings.stack) or '(empty)'} leaves Failover out, so "
        "the gateway's Forwarder has no backend to send a request to and every routed "
        "request would be a 404; add Failover to TIERCHAIN_STACK"
    ]


def _room_never_used(settings: Settings) -> list[str]:
    """The waiting room on, but no route whose every backend can say it is full: no request
    would ever wait in it."""
    failover = settings.layers["Failover"]
    if not failover.options.get("waiting_room") or settings.routes is None:
        return []
    routes = settings.routes
    if any(
        all(b.max_in_flight is not None or b.status_url is not None for b in routes[r])
        for r in routes
    ):
        return []
    variable = failover.sources.get("waiting_room", "TIERCHAIN_FAILOVER_WAITING_ROOM")
    return [
        f"{variable}=on, but no route has every backend with max_in_flight or status_url, "
        "so no request would ever wait (a request waits only while every backend of its "
        "chain says it is full); give the backends max_in_flight or status_url, or turn the "
        "waiting room off"
    ]


def _backend_names(settings: Settings) -> set[str] | None:
    """Every backend and pool name the routes use (None: no routes to check against)."""
    if settings.routes is None:
        return None
    names: set[str] = set()
    for route in settings.routes:
        for backend in settings.routes[route]:
            names.add(backend.name)
            if backend.pool is not None:
                names.add(backend.pool)
    return names


_LIMIT_FIELDS = (
    ("rpm", "rpm"),
    ("tpm", "tpm"),
    ("budget_tokens", "budget"),
    ("max_parallel", "max_parallel"),
    ("default_max_tokens", "default_output"),
)


def limits_view(settings: Settings) -> dict[str, Any] | None:
    """The limits layer as ``check-config`` and the identity line show it: KeyLimits'
    default output reservation (``default_output``: ``default_max_tokens``), each key's
    limits by its *name* (never the key; ``budget`` tokens per ``budget_period``), the
    backend budgets; None without caller keys (no KeyLimits). (No field name says
    "token": the identity line masks the values of such names.)"""
    if not settings.layers["CallerKeys"].options:
        return None
    keys, budgets = _keys_and_budgets(settings, [])
    shown = []
    for key in keys:
        entry: dict[str, Any] = {"name": key.name}
        for field, name in _LIMIT_FIELDS:
            if getattr(key, field) is not None:
                entry[name] = getattr(key, field)
        if key.budget_tokens is not None:
            entry["budget_period"] = period_text(key.budget_period)
        shown.append(entry)
    return {
        "layer": "KeyLimits",
        "default_output": DEFAULT_MAX_TOKENS,
        "keys": shown,
        "backend_budgets": [
            {"backend": b.backend, "budget": b.tokens, "budget_period": period_text(b.period)}
            for b in budgets
        ],
    }
