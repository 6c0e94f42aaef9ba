"""The effective configuration: :class:`Settings` (a :class:`LayerSettings` per piece).

Built by :func:`tierchain.config.from_env`; read by the stack (``middleware_kwargs``,
``make_store``), ``check-config`` and the identity line (``effective``, secrets masked).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .backend import Routes
from .env_parsers import _ALLOWANCE, _AUTO
from .errors import ConfigError
from .masking import MASK, mask_text, mask_url
from .options import _BY_NAME, STACK_ORDER, Kind, layer_class

__all__ = ["LayerSettings", "Settings", "display_value", "make_store", "plain"]


@dataclass(frozen=True, slots=True)
class LayerSettings:
    """One piece's configuration: the options set by variables, and where each came from."""

    name: str
    kind: Kind
    enabled: bool
    options: Mapping[str, Any]
    sources: Mapping[str, str]
    defaults: Mapping[str, Any]

    def __repr__(self) -> str:
        options = {k: display_value(self.name, k, v) for k, v in self.options.items()}
        return (
            f"LayerSettings(name={self.name!r}, kind={self.kind!r}, enabled={self.enabled!r}, "
            f"options={options!r})"
        )


@dataclass(frozen=True, slots=True)
class Settings:
    """The effective configuration. Build it with :func:`from_env`."""

    layers: Mapping[str, LayerSettings]
    routes: Routes | None
    routes_file: str | None
    store_url: str
    admin_path: str
    identity: bool
    environ_keys: tuple[str, ...] = field(default=(), repr=False)

    @property
    def stack(self) -> tuple[str, ...]:
        """The middlewares in the stack, outermost first."""
        return tuple(n for n in STACK_ORDER if self.layers[n].enabled)

    @property
    def admin_enabled(self) -> bool:
        """True when the Admin app will be mounted (a token is set)."""
        return "token" in self.layers["Admin"].options

    def middleware_kwargs(self, name: str, *, store: Any = None) -> dict[str, Any]:
        """Keyword arguments for ``name`` (``"Budget"``, ...): the options set by variables.

        Routes are added for Failover and Admin; ``store`` (when given) for the
        layers that take one; ``TIERCHAIN_SLOW_AFTER=allowance`` becomes an
        :class:`~tierchain.Allowance` built from the TIERCHAIN_ALLOWANCE_* variables.
        """
        layer = _BY_NAME.get(name)
        if layer is None or layer.kind == "general":
            raise KeyError(f"{name!r} is not a configurable tierchain piece")
        kwargs = dict(self.layers[name].options)
        if "routes" in layer.wired and self.routes is not None:
            kwargs["routes"] = self.routes
        if "store" in layer.wired and store is not None:
            kwargs["store"] = store
        if name == "SaturationWatchdog" and kwargs.get("slow_after") == _ALLOWANCE:
            kwargs["slow_after"] = layer_class("Allowance")(**self.layers["Allowance"].options)
        if name == "SaturationWatchdog" and kwargs.get("slow_after") == _AUTO:
            kwargs["slow_after"] = layer_class("Learned")(**self.layers["Learned"].options)
        return kwargs

    def __repr__(self) -> str:
        return (
            f"Settings(stack={list(self.stack)!r}, routes={self.routes!r}, "
            f"routes_file={self.routes_file!r}, store_url={mask_url(self.store_url)!r}, "
            f"admin_path={self.admin_path!r}, identity={self.identity!r}, "
            f"options={self.effective()['options']!r})"
        )

    @property
    def keys_on(self) -> bool:
        """Are caller keys configured (``TIERCHAIN_API_KEYS`` or ``_FILE``)? Off: anyone who
        reaches the port may use every route."""
        options = self.layers["CallerKeys"].options
        return bool(options.get("keys") or options.get("keys_file"))

    def make_store(self) -> Any:
        """A new store for ``store_url``: a MemoryStore, or a RedisStore."""
        return make_store(self)

    def effective(self) -> dict[str, Any]:
        """Everything in force, secrets masked: for logs, ``check-config`` and the identity line."""
        pieces: dict[str, Any] = {}
        for name, ls in self.layers.items():
            if ls.kind == "general":
                continue
            if ls.kind == "middleware" and not ls.enabled:
                continue
            if (
                name == "Allowance"
                and self.layers["SaturationWatchdog"].options.get("slow_after") != _ALLOWANCE
            ):
                continue
            if (
                name == "Learned"
                and self.layers["SaturationWatchdog"].options.get("slow_after") != _AUTO
            ):
                continue
            if name == "Admin" and not self.admin_enabled:
                continue
            if name == "MemoryStore" or (name == "RedisStore" and self.store_url == "memory://"):
                continue
            if name == "CallerKeys" and not self.keys_on:
                pieces[name] = {"keys": "off"}  # (not a masked "***": nothing is set)
                continue
            layer = _BY_NAME[name]
            values = {k: plain(v) for k, v in ls.defaults.items()}
            values.update({k: plain(v) for k, v in ls.options.items()})
            for opt in layer.options:
                if opt.secret and values.get(opt.name) is not None:
                    values[opt.name] = MASK
            pieces[name] = values
        return {
            "stack": list(self.stack),
            "routes_file": self.routes_file,
            "store_url": mask_url(self.store_url),
            "admin_path": self.admin_path if self.admin_enabled else None,
            "options": pieces,
        }


def display_value(layer: str, name: str, value: Any) -> Any:
    """Option ``name`` of ``layer`` for showing: a secret's value masked, URLs masked."""
    known = _BY_NAME.get(layer)
    if known is not None and any(o.name == name and o.secret for o in known.options):
        return MASK
    shown = plain(value)
    return mask_url(shown) if isinstance(shown, str) and "://" in shown else shown


def plain(value: Any) -> Any:
    """A JSON-friendly rendering of an option value."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, frozenset | set):
        return sorted(plain(v) for v in value)
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def make_store(settings: Settings) -> Any:
    """A new store for ``settings.store_url``: a MemoryStore, or a RedisStore.

    :class:`ConfigError` names the variables when RedisStore rejects them (or
    the ``redis`` package is not installed).
    """
    if settings.store_url == "memory://":
        return layer_class("MemoryStore")()
    layer = settings.layers["RedisStore"]
    try:
        return layer_class("RedisStore")(url=settings.store_url, **layer.options)
    except (ImportError, TypeError, ValueError) as exc:
        given = ", ".join(f"{env}={plain(layer.options[o])!r}" for o, env in layer.sources.items())
        raise ConfigError(
            [
                f"RedisStore rejected TIERCHAIN_STORE_URL={mask_url(settings.store_url)!r}"
                f"{', ' + given if given else ''}: {mask_text(str(exc), settings.store_url)}"
            ]
        ) from None
