"""Configuration from the environment, and (through `routes_file`) routes from a TOML file.

One function reads it all and fails at start-up, listing every problem::

    from tierchain.config import from_env
    from tierchain.stack import build_stack

    settings = from_env()              # ConfigError(ValueError) naming each bad variable
    app = build_stack(handler, settings)   # the whole stack, outermost first

or, one middleware at a time (FastAPI: the last ``add_middleware`` is the
outermost)::

    app.add_middleware(Budget, **settings.middleware_kwargs("Budget"))

Every option of every middleware has a ``TIERCHAIN_*`` variable, declared in
the table of :mod:`tierchain.options` (one :class:`Option` line each, read with the parsers of
:mod:`tierchain.env_parsers`). Options that are objects (clocks, clients, callables) are
code-only and say so. This module reads the variables with that table (:func:`from_env`,
in named steps) into :class:`Settings` (:mod:`tierchain.settings`); every name of those
modules is importable from here too.

A problem message names the variable (or the file and the TOML key path, with
the backend's name), the value (a secret's value is never shown) and what was
expected. Every key of a routes file's backend table is one :class:`BackendKey`
line in :data:`BACKEND_KEYS`, one per :class:`~tierchain.Backend` option.

A configuration that loads but will not do what it looks like gets a warning
instead (:func:`config_warnings`: ``check-config`` prints them, ``serve`` logs
them); each check is a function of the :class:`Settings` listed in
:data:`WARNINGS` (:mod:`tierchain.misconfig`), so a new one is one function and one line.

This module reads and checks; :mod:`tierchain.stack` builds. ``build_stack`` is
still importable from here for code written against that path (the package puts it
here: this module never imports the stack). The routes file's parser is
:mod:`tierchain.routes_file`; its names are importable from here too.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from . import env_parsers
from .backend import Routes
from .env_parsers import _ALLOWANCE, _AUTO, STACK_ORDER
from .errors import ConfigError
from .masking import mask_text, mask_url
from .misconfig import WARNINGS, Check, config_warnings
from .options import (
    _BY_ENV,
    FOREIGN_VARIABLES,
    LAYERS,
    PREFIX,
    SERVE_DEFAULTS,
    Kind,
    Layer,
    Option,
    _keyword_params,
    find_layer,
    layer_class,
    uncovered_options,
)
from .routes_file import (
    BACKEND_KEYS,
    POOL_KEYS,
    ROUTE_TABLE_KEYS,
    BackendKey,
    load_routes,
    routes_from_toml,
)
from .settings import LayerSettings, Settings, display_value, make_store, plain

__all__ = [
    "BACKEND_KEYS",
    "FOREIGN_VARIABLES",
    "LAYERS",
    "POOL_KEYS",
    "PREFIX",
    "ROUTE_TABLE_KEYS",
    "SERVE_DEFAULTS",
    "STACK_ORDER",
    "WARNINGS",
    "BackendKey",
    "Check",
    "ConfigError",
    "Kind",
    "Layer",
    "LayerSettings",
    "Option",
    "Settings",
    "build_stack",
    "config_warnings",
    "display_value",
    "find_layer",
    "from_env",
    "layer_class",
    "load_routes",
    "make_store",
    "mask_url",
    "plain",
    "routes_from_toml",
    "uncovered_options",
]


def _shown(opt: Option, raw: str) -> str:
    if opt.secret:
        return f"<{len(raw)} characters, not shown>"
    return repr(mask_text(raw, raw))


def _defaults(cls: Any, layer: Layer) -> dict[str, Any]:
    names = {o.name for o in layer.options}
    out: dict[str, Any] = {}
    for name, param in _keyword_params(cls).items():
        if name in names and param.default is not inspect.Parameter.empty:
            out[name] = param.default
    return out


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Read every ``TIERCHAIN_*`` variable and the routes file; raise :class:`ConfigError`.

    The error lists every problem found, each naming the variable or TOML key,
    the value and what was expected. Unknown ``TIERCHAIN_*`` variables are
    problems too (a typo must not silently leave a safeguard off).
    """
    env = os.environ if environ is None else environ
    parsed, sources, problems = _read_variables(env)
    general = parsed["tierchain"]
    layers = _layer_settings(parsed, sources)
    problems += _without_effect(parsed, sources)
    routes_file = general.get("routes_file")
    routes, missing = _routes(routes_file, env, _needs_routes(layers, parsed))
    problems += missing
    store = general.get("store_url", "memory://")
    if store == "memory://":
        problems += _no_effect(sources["RedisStore"], "TIERCHAIN_STORE_URL is not a redis URL")
    if problems:
        raise ConfigError(problems)
    return Settings(
        layers=MappingProxyType(layers),
        routes=routes,
        routes_file=routes_file,
        store_url=store,
        admin_path=general.get("admin_path", "/admin/tierchain"),
        identity=general.get("identity", True),
        environ_keys=tuple(sorted(k for k in env if k.startswith(PREFIX))),
    )


def _read_variables(
    env: Mapping[str, str],
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]], list[str]]:
    """Each variable parsed by its table line: the values and the variable each came from, per
    piece (``tierchain serve``'s own defaults filled in), and the problems."""
    problems: list[str] = []
    parsed: dict[str, dict[str, Any]] = {layer.name: {} for layer in LAYERS}
    sources: dict[str, dict[str, str]] = {layer.name: {} for layer in LAYERS}
    for key in sorted(k for k in env if k.startswith(PREFIX)):
        if key in FOREIGN_VARIABLES:
            continue
        if key not in _BY_ENV:
            close = difflib.get_close_matches(key, list(_BY_ENV), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key} is not a tierchain variable{hint}")
            continue
        layer, opt = _BY_ENV[key]
        raw = env[key]
        try:
            value = opt.parse(raw)
        except ValueError as exc:
            detail = f" ({mask_text(str(exc), raw)})" if str(exc) else ""
            problems.append(f"{key}={_shown(opt, raw)}: expected {opt.expected}{detail}")
            continue
        parsed[layer.name][opt.name] = value
        sources[layer.name][opt.name] = key
    for name, values in SERVE_DEFAULTS.items():
        for option, value in values.items():
            parsed[name].setdefault(option, value)
    return parsed, sources, problems


def _layer_settings(
    parsed: dict[str, dict[str, Any]], sources: dict[str, dict[str, str]]
) -> dict[str, LayerSettings]:
    """Each piece's settings: a middleware is enabled unless ``TIERCHAIN_STACK`` leaves it out."""
    explicit_stack: tuple[str, ...] | None = parsed["tierchain"].get("stack")
    layers: dict[str, LayerSettings] = {}
    for layer in LAYERS:
        if layer.kind == "general":
            layers[layer.name] = LayerSettings(
                layer.name, "general", True,
                MappingProxyType(dict(parsed[layer.name])),
                MappingProxyType(sources[layer.name]), MappingProxyType({}),
            )  # fmt: skip
            continue
        enabled = layer.kind == "middleware" and (
            explicit_stack is None or layer.name in explicit_stack
        )
        layers[layer.name] = LayerSettings(
            name=layer.name,
            kind=layer.kind,
            enabled=enabled,
            options=MappingProxyType(dict(parsed[layer.name])),
            sources=MappingProxyType(dict(sources[layer.name])),
            defaults=MappingProxyType(_defaults(layer_class(layer.name), layer)),
        )
    return layers


def _without_effect(
    parsed: dict[str, dict[str, Any]], sources: dict[str, dict[str, str]]
) -> list[str]:
    """Allowance variables only mean something with TIERCHAIN_SLOW_AFTER=allowance, and
    Learned's only with TIERCHAIN_SLOW_AFTER=auto."""
    slow_after = parsed["SaturationWatchdog"].get("slow_after")
    problems: list[str] = []
    if slow_after != _ALLOWANCE:
        problems += _no_effect(sources["Allowance"], "set TIERCHAIN_SLOW_AFTER=allowance to use it")
    if slow_after != _AUTO:
        problems += _no_effect(sources["Learned"], "set TIERCHAIN_SLOW_AFTER=auto to use it")
    return problems


def _no_effect(sources: Mapping[str, str], why: str) -> list[str]:
    return [f"{env_name} is set but has no effect: {why}" for env_name in sources.values()]


def _needs_routes(layers: Mapping[str, LayerSettings], parsed: dict[str, dict[str, Any]]) -> str:
    """Which piece needs routes (Failover when stacked, else Admin when it has a token), or
    ``""``."""
    if layers["Failover"].enabled:
        return "Failover"
    return "Admin" if "token" in parsed["Admin"] else ""


def _routes(
    routes_file: str | None, env: Mapping[str, str], needed_by: str
) -> tuple[Routes | None, list[str]]:
    """The routes file read, with its problems; without one, the problem when ``needed_by``
    names a piece that needs routes."""
    if routes_file is not None:
        try:
            return load_routes(routes_file, environ=env), []
        except ConfigError as exc:
            return None, list(exc.problems)
    if not needed_by:
        return None, []
    return None, [
        f"TIERCHAIN_ROUTES_FILE is not set: {needed_by} needs routes; expected the path of a "
        "TOML file with [routes.<name>] tables (or leave Failover out with TIERCHAIN_STACK)"
    ]


build_stack: Callable[..., Any]
"""The old path of :func:`tierchain.stack.build_stack`: the same function, put here by the
package's ``__init__`` once both modules are imported, so that this module never imports the
stack that imports it (docs/internals.md, the floors)."""


def __getattr__(name: str) -> Any:
    """The variables' parsers at their old path: they live in :mod:`tierchain.env_parsers`."""
    if name in env_parsers.__all__:
        return getattr(env_parsers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
