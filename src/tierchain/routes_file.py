"""The routes file: a TOML file of routes, each a chain of backends and pools.

:func:`load_routes` reads one and :func:`routes_from_toml` checks parsed TOML; each lists
every problem at once in a :class:`~tierchain.errors.ConfigError`. Every key of a backend
table is one :class:`BackendKey` line in :data:`BACKEND_KEYS`, one per
:class:`~tierchain.Backend` option; :data:`ROUTE_TABLE_KEYS` and :data:`POOL_KEYS` are the
keys of a route's table and of a pool's. The file's path comes from
``TIERCHAIN_ROUTES_FILE`` (:mod:`tierchain.config`, which re-exports these names).

It is written against the public names of :mod:`tierchain.backend` only (``Backend``,
``Pool``, ``Routes``, ``BACKEND_NAME``, ``check_url``), and imports nothing that imports
it back.
"""

from __future__ import annotations

import difflib
import functools
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._checks import HEADER_NAME, text_seconds
from .backend import BACKEND_NAME, Backend, Pool, Routes, check_url
from .errors import ConfigError
from .masking import mask_url

__all__ = [
    "BACKEND_KEYS",
    "POOL_KEYS",
    "ROUTE_TABLE_KEYS",
    "BackendKey",
    "load_routes",
    "routes_from_toml",
]


def load_routes(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Routes:
    """Routes from a TOML file; :class:`ConfigError` lists every problem in it at once.

    Each problem names the file, the key path (which names the route, the
    backend's place and the key) and the backend's name::

        routes.toml: routes.echo.backends[1].stall_after='soon' (backend 'hosted'): expected ...

    ::

        [[routes.echo.backends]]
        name = "tower"
        url = "http://127.0.0.1:11434"
        regime = "local"
        status_url = "http://127.0.0.1:11434/_gate/status"
        max_in_flight = 1                 # more at once: skipped as busy (never the last tier)
        stall_after = "5m"                # this backend's own gap between data events
        first_token = "20s"               # the most a first token may take here

        [[routes.echo.backends]]
        name = "hosted"
        url = "https://api.example.com"
        regime = "hosted"
        model = "gpt-4o-mini"
        api_key_env = "HOSTED_API_KEY"    # sent as Authorization: Bearer <value>
    """
    source = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(
            [f"TIERCHAIN_ROUTES_FILE={source!r}: cannot read it ({exc.strerror})"]
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"TIERCHAIN_ROUTES_FILE={source!r}: not valid TOML ({exc})"]) from None
    return routes_from_toml(data, environ=environ, source=source)


# Each key of a [[routes.<name>.backends]] table: how its TOML value becomes the
# Backend keyword of the same name (or raises ValueError), and what is expected. A
# Backend option is offered in the routes file by one line here; ``headers`` and the
# api_key_* keys together make the Backend's headers.


def _toml_text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError
    return value


def _toml_name(value: Any) -> str:
    if not isinstance(value, str) or not BACKEND_NAME.fullmatch(value):
        raise ValueError
    return value


def _toml_url(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError
    check_url("url", value)
    return value


def _toml_seconds(*, zero_ok: bool) -> Callable[[Any], float]:
    """A TOML number of seconds (``30``, ``2.5``) or a string with a unit (``"500ms"``, ``"5m"``),
    read by the one duration parser the variables use."""

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError
        if isinstance(value, str):
            raw = value
        elif isinstance(value, int):
            raw = str(value)
        else:  # a float as plain digits: the parser takes no exponent (1e-07)
            raw = f"{value:.17f}"
        return text_seconds(raw, zero_ok=zero_ok)

    return check


def _toml_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError
    return value


def _toml_count_or_zero(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError
    return value


def _toml_price(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1e6:
        raise ValueError
    return float(value)


def _toml_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError
    return value


def _toml_stream_end(value: Any) -> str | None:
    if value is False:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError
    return value


def _toml_header_name(value: Any) -> str:
    if not isinstance(value, str) or not HEADER_NAME.fullmatch(value):
        raise ValueError
    return value


def _toml_wire_format(value: Any) -> str:
    from .wire import FORMATS  # (imported when used: this module's own imports stay leaves)

    if not isinstance(value, str) or value not in FORMATS:
        raise ValueError
    return value


def _toml_prefix(value: Any) -> str:
    if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
        raise ValueError
    return value


@dataclass(frozen=True, slots=True)
class BackendKey:
    """One key of a backend table in the routes file."""

    name: str
    check: Callable[[Any], Any]
    expected: str
    field: bool = True  # False: not a Backend keyword of its own (headers, api_key_*)


_TOML_SECS = 'seconds: a number such as 30 or 2.5, or a string such as "500ms", "90s" or "5m"'

# fmt: off
BACKEND_KEYS: tuple[BackendKey, ...] = (
    BackendKey("name", _toml_name, "a backend name: 1-64 characters from A-Z a-z 0-9 . _ -"),
    BackendKey("url", _toml_url,
               "an http or https base URL with a host, such as http://127.0.0.1:11434"),
    BackendKey("regime", _toml_text, "a non-empty string such as local or hosted"),
    BackendKey("status_url", _toml_url,
               "an http or https URL with a host, such as http://127.0.0.1:11434/metrics"),
    BackendKey("model", _toml_text, "a non-empty string: the model name this backend is sent"),
    BackendKey("stream_end", _toml_stream_end,
               'a non-empty string such as "openai", or false (any clean end is complete)'),
    BackendKey("stall_after", _toml_seconds(zero_ok=False), f"{_TOML_SECS}, > 0"),
    BackendKey("first_token", _toml_seconds(zero_ok=False), f"{_TOML_SECS}, > 0"),
    BackendKey("forward_caller_auth", _toml_bool, "true or false (no quotes)"),
    BackendKey("max_in_flight", _toml_count, "a whole number >= 1"),
    BackendKey("wire_format", _toml_wire_format,
               "one of openai, responses, anthropic, ollama, plain"),
    BackendKey("shares", _toml_text, "a non-empty string naming the hardware, such as gpu0"),
    BackendKey("retries", _toml_count_or_zero, "a whole number >= 0"),
    BackendKey("prefill", _toml_bool, "true or false (no quotes)"),
    BackendKey("hedge", _toml_bool, "true or false (no quotes)"),
    BackendKey("price_input", _toml_price,
               "a price per million input tokens: a number from 0 to 1000000"),
    BackendKey("price_output", _toml_price,
               "a price per million output tokens: a number from 0 to 1000000"),
    BackendKey("headers", lambda v: v, "a table of HTTP header names to strings", field=False),
    BackendKey("api_key_env", _toml_text, "the name of a variable", field=False),
    BackendKey("api_key_header", _toml_header_name,
               'an HTTP header name such as "Authorization" or "x-api-key"', field=False),
    BackendKey("api_key_prefix", _toml_prefix,
               'a string put before the key, such as "Bearer " or ""', field=False),
)
# fmt: on

_BACKEND_KEYS = {key.name: key for key in BACKEND_KEYS}
ROUTE_TABLE_KEYS = ("backends", "wire_format", "continuations")
"""The keys of a ``[routes.<name>]`` table."""
_REQUIRED = ("name", "url")


def routes_from_toml(
    data: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    source: str | None = None,
) -> Routes:
    """Routes from parsed TOML (see :func:`load_routes`); ``source`` names the file."""
    env = os.environ if environ is None else environ
    problems: list[str] = []
    for key in data:
        if key != "routes":
            problems.append(f"{key}: unknown top-level key; expected only [routes.<name>] tables")
    table = data.get("routes")
    built: dict[str, list[Backend | Pool]] = {}
    if not isinstance(table, Mapping) or not table:
        problems.append("routes: expected at least one [routes.<name>] table")
        table = {}
    formats: dict[str, str] = {}
    continuations: dict[str, int] = {}
    for route, spec in table.items():
        where = f"routes.{route}"
        if not isinstance(spec, Mapping):
            problems.append(f"{where}: expected a table with a backends array")
            continue
        for key in spec:
            if key not in ROUTE_TABLE_KEYS:
                problems.append(
                    f"{where}.{key}: unknown key; expected one of {', '.join(ROUTE_TABLE_KEYS)}"
                )
        if "wire_format" in spec:
            try:
                formats[route] = _toml_wire_format(spec["wire_format"])
            except ValueError:
                problems.append(
                    f"{where}.wire_format={spec['wire_format']!r}: expected "
                    f"{_BACKEND_KEYS['wire_format'].expected}"
                )
        if "continuations" in spec:
            given = spec["continuations"]
            if isinstance(given, int) and not isinstance(given, bool) and given >= 0:
                continuations[route] = given
            else:
                problems.append(
                    f"{where}.continuations={given!r}: expected a whole number >= 0 (0: never)"
                )
        backends = spec.get("backends")
        if not isinstance(backends, list) or not backends:
            problems.append(f"{where}.backends: expected at least one [[{where}.backends]] table")
            continue
        chain: list[Backend | Pool] = []
        named = functools.partial(_note_name, problems, where, {})
        for i, entry in enumerate(backends):
            at = f"{where}.backends[{i}]"
            if isinstance(entry, Mapping) and "pool" in entry:
                pool = _pool(at, entry, env, problems, named)
                if pool is not None:
                    chain.append(pool)
                continue
            named(at, entry.get("name") if isinstance(entry, Mapping) else None)
            backend = _backend(at, entry, env, problems)
            if backend is not None:
                chain.append(backend)
        built[route] = chain
    if problems:
        prefix = f"{source}: " if source else ""
        raise ConfigError([prefix + p for p in problems])
    try:
        return Routes(built, wire_formats=formats, continuations=continuations)
    except ValueError as exc:  # pragma: no cover - checked above
        raise ConfigError([f"{source or 'routes'}: {exc}"]) from None


def _note_name(problems: list[str], where: str, names: dict[str, str], at: str, name: Any) -> None:
    """Note a backend's or pool's name in a route; a second of the same is a problem."""
    if isinstance(name, str) and name in names:
        problems.append(
            f"{at}.name={name!r}: this name is already in {where} "
            f"({names[name]}); expected each backend and pool of a route to have its own name"
        )
    elif isinstance(name, str):
        names[name] = at[len(where) + 1 :]


POOL_KEYS = ("pool", "backends")
"""The keys of a pool's entry in a route's ``backends`` array."""


def _pool(
    where: str,
    entry: Mapping[str, Any],
    env: Mapping[str, str],
    problems: list[str],
    named: Callable[[str, Any], None],
) -> Pool | None:
    """A pool entry (``pool = "tower"`` and its own ``backends`` array), checked whole."""
    found = len(problems)
    name = entry.get("pool")
    who = f" (pool {name!r})" if isinstance(name, str) else ""
    for key in entry:
        if key not in POOL_KEYS:
            problems.append(
                f"{where}.{key}{who}: unknown key for a pool; expected {', '.join(POOL_KEYS)} "
                "(a replica's own keys go in its [[...backends]] table)"
            )
    if not isinstance(name, str) or not BACKEND_NAME.fullmatch(name):
        problems.append(f"{where}.pool={name!r}: expected {_BACKEND_KEYS['name'].expected}")
    else:
        named(where, name)
    replicas = entry.get("backends")
    members: list[Backend] = []
    if not isinstance(replicas, list) or not replicas:
        problems.append(f"{where}.backends{who}: expected at least one backend table in the pool")
    else:
        for i, replica in enumerate(replicas):
            at = f"{where}.backends[{i}]"
            named(at, replica.get("name") if isinstance(replica, Mapping) else None)
            backend = _backend(at, replica, env, problems)
            if backend is not None:
                members.append(backend)
    if len(problems) > found or not isinstance(name, str):
        return None
    try:
        return Pool(name=name, backends=members)
    except ValueError as exc:
        problems.append(f"{where}{who}: {exc}")
        return None


def _shown_toml(key: str, value: Any) -> str:
    if isinstance(value, str) and key.endswith("url"):
        return repr(mask_url(value))
    return repr(value)


def _backend(where: str, entry: Any, env: Mapping[str, str], problems: list[str]) -> Backend | None:
    """One backend table checked key by key: every problem in it is listed, not the first."""
    if not isinstance(entry, Mapping):
        problems.append(f"{where}: expected a table with name and url")
        return None
    name = entry.get("name")
    who = f" (backend {name!r})" if isinstance(name, str) and BACKEND_NAME.fullmatch(name) else ""
    found = len(problems)
    for key in entry:
        if key not in _BACKEND_KEYS:
            close = difflib.get_close_matches(key, list(_BACKEND_KEYS), n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(
                f"{where}.{key}{who}: unknown key{hint}; expected one of {', '.join(_BACKEND_KEYS)}"
            )
    for key in _REQUIRED:
        if key not in entry:
            problems.append(f"{where}.{key}{who}: missing; every backend needs a name and a url")
    values: dict[str, Any] = {}
    for key, value in entry.items():
        spec = _BACKEND_KEYS.get(key)
        if spec is None or key == "headers":
            continue
        try:
            values[key] = spec.check(value)
        except ValueError:
            problems.append(
                f"{where}.{key}={_shown_toml(key, value)}{who}: expected {spec.expected}"
            )
    headers = _backend_headers(where, who, entry, values, env, problems)
    if len(problems) > found:
        return None
    fields = {k: v for k, v in values.items() if _BACKEND_KEYS[k].field}
    try:
        return Backend(headers=headers, **fields)
    except ValueError as exc:  # a rule of Backend's own that the checks above do not know
        problems.append(f"{where}{who}: {exc}")
        return None


def _backend_headers(
    where: str,
    who: str,
    entry: Mapping[str, Any],
    values: Mapping[str, Any],
    env: Mapping[str, str],
    problems: list[str],
) -> dict[str, str]:
    """``headers`` plus the API key from ``api_key_env``, in ``api_key_header``."""
    headers: dict[str, str] = {}
    raw_headers = entry.get("headers", {})
    if not isinstance(raw_headers, Mapping):
        problems.append(f"{where}.headers{who}: expected {_BACKEND_KEYS['headers'].expected}")
    else:
        for name, value in raw_headers.items():
            if not HEADER_NAME.fullmatch(name) or not isinstance(value, str):
                problems.append(  # the value may be a key: never shown
                    f"{where}.headers.{name}{who}: expected an HTTP header name with a string value"
                )
            else:
                headers[name] = value
    var = values.get("api_key_env")
    if "api_key_env" not in entry:
        for key in ("api_key_header", "api_key_prefix"):
            if key in entry:
                problems.append(
                    f"{where}.{key}={entry[key]!r}{who}: has no effect without api_key_env; "
                    "expected api_key_env to name the variable holding the key"
                )
        return headers
    header = values.get("api_key_header", "Authorization")
    prefix = values.get("api_key_prefix", "Bearer " if header.lower() == "authorization" else "")
    if var is not None and not env.get(var):
        problems.append(
            f"{where}.api_key_env={var!r}{who}: the variable {var} is not set or empty; "
            "expected it to hold the API key"
        )
    clash = next((h for h in headers if h.lower() == str(header).lower()), None)
    if clash is not None:
        problems.append(
            f"{where}.headers.{clash}{who}: api_key_env already sends the key in {header}; "
            "expected the header in one place only"
        )
    if var is not None and env.get(var):
        headers[header] = f"{prefix}{env[var]}"
    return headers
