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
the tables below (one :class:`Option` line each). Options that are objects
(clocks, clients, callables) are code-only and say so.

A problem message names the variable (or the file and the TOML key path, with
the backend's name), the value (a secret's value is never shown) and what was
expected. Every key of a routes file's backend table is one :class:`BackendKey`
line in :data:`BACKEND_KEYS`, one per :class:`~tierchain.Backend` option.

A configuration that loads but will not do what it looks like gets a warning
instead (:func:`config_warnings`: ``check-config`` prints them, ``serve`` logs
them); each check is a function of the :class:`Settings` listed in
:data:`WARNINGS`, so a new one is one function and one line.

This module reads and checks; :mod:`tierchain.stack` builds. ``build_stack`` is
still importable from here for code written against that path (the package puts it
here: this module never imports the stack). The routes file's parser is
:mod:`tierchain.routes_file`; its names are importable from here too.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

from ._checks import HEADER_NAME, TEXT_DURATION, text_seconds
from .backend import BACKEND_NAME, Backend, Pool, Routes
from .errors import ConfigError
from .masking import MASK, mask_text, mask_url
from .routes_file import (
    BACKEND_KEYS,
    POOL_KEYS,
    ROUTE_TABLE_KEYS,
    BackendKey,
    load_routes,
    routes_from_toml,
)

__all__ = [
    "BACKEND_KEYS",
    "LAYERS",
    "POOL_KEYS",
    "ROUTE_TABLE_KEYS",
    "STACK_ORDER",
    "WARNINGS",
    "BackendKey",
    "ConfigError",
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
    "mask_url",
    "routes_from_toml",
    "uncovered_options",
]

PREFIX = "TIERCHAIN_"

# Variables with this prefix that other tools read (the test harness), not the gateway.
FOREIGN_VARIABLES = frozenset(
    {"TIERCHAIN_CHROMIUM", "TIERCHAIN_LLAMA_SERVER", "TIERCHAIN_SMOLLM2_GGUF"}
)
"""Variables the test harness reads (docs/benchmarks.md's ``eval`` line exports the last
two): never a problem, so a shell that ran it can still start ``tierchain serve``."""


# -- parsers -----------------------------------------------------------------------
# A parser takes the raw string and returns the value, or raises ValueError; the
# problem message is built from the Option's ``expected`` (plus the error's text,
# when it has any).

Parser = Callable[[str], Any]

_SIZE = re.compile(r"([0-9]+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_NONE_WORDS = frozenset({"", "none", "off", "no"})


def seconds(*, zero_ok: bool = True, optional: bool = False) -> Parser:
    """Seconds as ``30``, ``2.5``, ``250ms``, ``15m``, ``2h`` (the package's one text grammar
    for durations, :func:`tierchain._checks.parse_duration`); ``none`` too when optional."""

    def parse(raw: str) -> float | None:
        if optional and raw.strip().lower() in _NONE_WORDS:
            return None
        return text_seconds(raw, zero_ok=zero_ok)

    return parse


def integer(minimum: int, maximum: int | None = None) -> Parser:
    """A whole number in [minimum, maximum]."""

    def parse(raw: str) -> int:
        value = int(raw.strip(), 10)
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError
        return value

    return parse


def count_or_none(raw: str) -> int | None:
    """A whole number >= 1, or ``none`` (no limit)."""
    if raw.strip().lower() in _NONE_WORDS:
        return None
    value: int = integer(1)(raw)
    return value


def fraction(raw: str) -> float:
    """A number in (0, 1], such as ``0.8``."""
    value = float(raw.strip())
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError
    return value


def number_above_zero(raw: str) -> float:
    """A finite number > 0, such as ``2`` or ``1.5``."""
    value = float(raw.strip())
    if not (math.isfinite(value) and value > 0):
        raise ValueError
    return value


def size(raw: str) -> int:
    """Bytes as ``33554432``, ``512k``, ``32MiB``, ``1g`` (binary multiples)."""
    match = _SIZE.fullmatch(raw.strip())
    if match is None:
        raise ValueError
    unit = (match[2] or "").lower()[:1]
    return int(match[1]) * _SIZE_UNITS[unit]


def boolean(raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``."""
    text = raw.strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError


def header_name(raw: str) -> str:
    """An HTTP header name such as ``X-Request-Timeout``."""
    text = raw.strip()
    if not HEADER_NAME.fullmatch(text):
        raise ValueError
    return text


def name_list(raw: str) -> tuple[str, ...]:
    """Names separated by commas: ``high,normal,low``."""
    names = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not names or len({n.lower() for n in names}) != len(names):
        raise ValueError
    return names


def text(raw: str) -> str:
    """Any non-empty text."""
    if not raw.strip():
        raise ValueError
    return raw.strip()


def status_list(raw: str) -> frozenset[int]:
    """HTTP statuses separated by commas: ``429,500,502``."""
    values = [p.strip() for p in raw.split(",") if p.strip()]
    statuses = frozenset(int(v, 10) for v in values)
    if not all(100 <= s <= 599 for s in statuses):
        raise ValueError
    return statuses


def choice(*choices: str) -> Parser:
    """One of ``choices`` (case-insensitive)."""

    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError
        return value

    return parse


def backend_name(raw: str) -> str:
    """A backend name: 1-64 characters from ``A-Z a-z 0-9 . _ -``."""
    if not BACKEND_NAME.fullmatch(raw.strip()):
        raise ValueError
    return raw.strip()


def token(raw: str) -> str:
    """A secret of 16 to 512 printable ASCII characters, no spaces."""
    if not re.fullmatch(r"[\x21-\x7e]{16,512}", raw):
        raise ValueError
    return raw


def pick_weights(raw: str) -> Any:
    """Pick weights as ``name=number`` pairs separated by commas:
    ``in_flight=1,waiting=1,kv_cache=2,slots=1,first_data=0.1`` (a name left out
    keeps its default)."""
    from .picker import PickWeights  # (the picker's own check, imported when used)

    values: dict[str, float] = {}
    for part in raw.split(","):
        if not part.strip():
            continue
        name, eq, number = part.partition("=")
        if not eq:
            raise ValueError
        values[name.strip()] = float(number.strip())
    try:
        return PickWeights(**values)
    except TypeError:  # a name that is not a weight
        raise ValueError from None


def import_path(raw: str) -> str:
    """An import path ``package.module:name`` of something that can be imported now (so that
    ``check-config`` finds a typo; the layer imports it again when it is built)."""
    text = raw.strip()
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", text):
        raise ValueError
    module, _, name = text.partition(":")
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot be imported: {exc}") from None
    return text


def path_list(raw: str) -> tuple[str, ...]:
    """URL path prefixes separated by commas, each starting with ``/``."""
    paths = tuple(p.strip() for p in raw.split(",") if p.strip())
    if not paths or not all(p.startswith("/") for p in paths):
        raise ValueError
    return paths


def origin_list(raw: str) -> tuple[str, ...]:
    """Origins separated by commas: ``https://ops.example,https://other.example``."""
    origins = tuple(p.strip() for p in raw.split(",") if p.strip())
    for origin in origins:
        parts = urlsplit(origin)
        if parts.scheme not in {"http", "https"} or not parts.netloc or parts.path:
            raise ValueError(f"{origin!r} is not an origin")
    return origins


def mount_path(raw: str) -> str:
    """A path prefix such as ``/admin/tierchain`` (no trailing slash)."""
    path = raw.strip().rstrip("/")
    if not path.startswith("/") or any(c in path for c in "?# "):
        raise ValueError
    return path


def stack_list(raw: str) -> tuple[str, ...]:
    """Middleware names separated by commas, in the fixed order (outermost first)."""
    names: list[str] = []
    by_lower = {n.lower(): n for n in STACK_ORDER}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        name = by_lower.get(part.lower())
        if name is None:
            raise ValueError(f"{part!r} is not one of {', '.join(STACK_ORDER)}")
        if name in names:
            raise ValueError(f"{name} is listed twice")
        names.append(name)
    order = [n for n in STACK_ORDER if n in names]
    if names != order:
        raise ValueError(f"the order is fixed, outermost first: list them as {','.join(order)}")
    return tuple(names)


def store_url(raw: str) -> str:
    """``memory://`` or a redis URL (``redis://``, ``rediss://``, ``unix://``)."""
    url = raw.strip()
    parts = urlsplit(url)
    if url in {"memory", "memory://"}:
        return "memory://"
    if parts.scheme in {"redis", "rediss"} and parts.hostname:
        return url
    if parts.scheme == "unix" and parts.path:
        return url
    raise ValueError


_ALLOWANCE = "allowance"
_AUTO = "auto"


def slow_after(raw: str) -> float | str:
    """Seconds (0: off), ``allowance`` (TIERCHAIN_ALLOWANCE_*) or ``auto`` (TIERCHAIN_LEARNED_*)."""
    if raw.strip().lower() == _ALLOWANCE:
        return _ALLOWANCE
    if raw.strip().lower() == _AUTO:
        return _AUTO
    value: float = seconds(zero_ok=True)(raw)
    return value


def slow_after_or_auto(raw: str) -> float | str:
    """Seconds, or the word ``auto``."""
    if raw.strip().lower() == _AUTO:
        return _AUTO
    value: float = seconds(zero_ok=True)(raw)
    return value


def prompt_rate(raw: str) -> float | str:
    """``auto`` (learned per backend), a rate in prompt tokens per second, or 0 (off)."""
    if raw.strip().lower() == _AUTO:
        return _AUTO
    value = float(raw.strip())
    if not (math.isfinite(value) and value >= 0):
        raise ValueError
    return value


SERVE_DEFAULTS: dict[str, dict[str, Any]] = {
    "SaturationWatchdog": {"slow_after": _AUTO},
    "Failover": {"hedge_after": 5.0},
}
"""Where ``tierchain serve`` differs from the classes' own defaults: a quiet first tier
must be caught without any variable set."""


# -- the tables ---------------------------------------------------------------------

Kind = Literal["middleware", "handler", "app", "component", "general"]


@dataclass(frozen=True, slots=True)
class Option:
    """One keyword argument and the variable it comes from."""

    name: str
    env: str
    parse: Parser
    expected: str
    secret: bool = False
    help: str = ""


@dataclass(frozen=True, slots=True)
class Layer:
    """A configurable piece: its class, its options, and the arguments it gets otherwise.

    ``wired`` arguments are filled in by :func:`build_stack` (routes, the shared
    store, the watchdog's status board); ``code_only`` ones are objects a
    deployment passes in code (clocks, clients, callables).
    """

    name: str
    module: str
    kind: Kind
    options: tuple[Option, ...]
    wired: frozenset[str] = frozenset()
    code_only: frozenset[str] = frozenset()
    help: str = ""


def _api_keys(raw: str) -> Any:
    from .keys import key_list  # the middleware's own parser (imported when used)

    return key_list(raw)


def _o(name: str, env: str, parse: Parser, expected: str, **kw: Any) -> Option:
    return Option(name, PREFIX + env, parse, expected, **kw)


# Expected-value phrases, shared by the table.
_SECS = TEXT_DURATION
_SECS_POS = f"{_SECS}, > 0"
_SECS_NONNEG = f"{_SECS}, >= 0"
_COUNT = "a whole number >= 1"
_BOOL = "1/true/yes/on or 0/false/no/off"

STACK_ORDER = (
    "Heartbeats",
    "Budget",
    "PreferBackend",
    "Failover",
    "Breaker",
    "SaturationWatchdog",
)

# One line per option: Option(keyword, TIERCHAIN_<variable>, parser, what is expected).
# fmt: off
LAYERS: tuple[Layer, ...] = (
    Layer("tierchain", "tierchain", "general", (
        _o("stack", "STACK", stack_list, "middleware names separated by commas, outermost first",
           help="Which middlewares to stack (default: every one)."),
        _o("routes_file", "ROUTES_FILE", text, "the path of a TOML file of [routes.<name>] tables",
           help="The routes file (see Routes file)."),
        _o("store_url", "STORE_URL", store_url, "memory:// or a redis URL (redis://host:6379/0)",
           help="Where breaker ledgers and pins live (default memory://). A password is masked."),
        _o("admin_path", "ADMIN_PATH", mount_path, "a path prefix such as /admin/tierchain",
           help="Where Admin is mounted when TIERCHAIN_ADMIN_TOKEN is set."),
        _o("identity", "IDENTITY", boolean, _BOOL,
           help="Write the tierchain.started identity line at start-up (default on)."),
    )),
    Layer("serve", "tierchain.serve", "general", (
        _o("host", "HOST", text, "an address to listen on, such as 127.0.0.1 or 0.0.0.0"),
        _o("port", "PORT", integer(0, 65535), "a port number from 0 to 65535 (0: any free one)"),
        _o("drain_timeout", "DRAIN_TIMEOUT", seconds(), _SECS_NONNEG,
           help="On SIGTERM or SIGINT, how long requests in flight may take to finish."),
        _o("log_format", "LOG_FORMAT", choice("text", "json"), "text or json"),
        _o("log_level", "LOG_LEVEL", choice("debug", "info", "warning", "error"),
           "debug, info, warning or error"),
        _o("access_log", "ACCESS_LOG", boolean, _BOOL,
           help="One uvicorn.access line per request (default off)."),
    ), help="Read by tierchain serve only."),
    Layer("Shed", "tierchain.shed", "middleware", (
        _o("max_concurrent", "SHED_MAX_CONCURRENT", count_or_none,
           f"{_COUNT}, or none (no limit)",
           help="Requests in flight in this process beyond which new ones get 503."),
        _o("retry_after", "SHED_RETRY_AFTER", seconds(), _SECS_NONNEG,
           help="The Retry-After a shed request is given."),
    )),
    Layer("CallerKeys", "tierchain.keys", "middleware", (
        _o("keys", "API_KEYS", _api_keys, "keys of 16 to 512 printable ASCII characters, "
           "separated by commas", secret=True,
           help="Caller keys: without one, 401 on the routed paths (see Caller keys)."),
        _o("keys_file", "API_KEYS_FILE", text, "the path of a TOML file of [[keys]] tables",
           help="Caller keys with what each may steer (see Caller keys)."),
        _o("open_paths", "API_KEYS_OPEN_PATHS", path_list,
           "path prefixes separated by commas, such as /api/",
           help="Where a request without a key goes on all the same (see Caller keys)."),
    ), wired=frozenset({"header"}),
       help="In front of the routed stack when TIERCHAIN_API_KEYS or _FILE is set."),
    Layer("Heartbeats", "tierchain.heartbeats", "middleware", (
        _o("interval", "HEARTBEAT_INTERVAL", seconds(), f"{_SECS} (0: no keepalives)"),
        _o("commit_after", "HEARTBEAT_COMMIT_AFTER", seconds(), _SECS_NONNEG),
        _o("max_queued", "HEARTBEAT_MAX_QUEUED", integer(1), _COUNT),
    )),
    Layer("Budget", "tierchain.budget", "middleware", (
        _o("default", "BUDGET_DEFAULT", seconds(zero_ok=False, optional=True),
           f"{_SECS_POS}, or none"),
        _o("max", "BUDGET_MAX", seconds(zero_ok=False, optional=True), f"{_SECS_POS}, or none"),
        _o("header", "BUDGET_HEADER", header_name, "an HTTP header name such as X-Request-Timeout"),
    )),
    Layer("PreferBackend", "tierchain.prefer", "middleware", (
        _o("header", "PREFER_HEADER", header_name, "an HTTP header name such as X-Prefer-Backend"),
        _o("pin_timeout", "PREFER_PIN_TIMEOUT", seconds(zero_ok=False), _SECS_POS),
    ), wired=frozenset({"store"}), code_only=frozenset({"allow"})),
    Layer("Failover", "tierchain.failover", "middleware", (
        _o("max_body", "FAILOVER_MAX_BODY", size, "a size in bytes such as 512k or 32MiB"),
        _o("retry_statuses", "FAILOVER_RETRY_STATUSES", status_list,
           "HTTP statuses separated by commas, such as 429,500,502,503,504"),
        _o("paths", "FAILOVER_PATHS", path_list, "path prefixes separated by commas, such as /v1/"),
        _o("hold_limit", "FAILOVER_HOLD_LIMIT", size, "a size in bytes such as 16MiB"),
        _o("lease", "FAILOVER_LEASE", seconds(zero_ok=False), _SECS_POS,
           help="How long an in-flight lease lives unless renewed (max_in_flight)."),
        _o("max_headers", "FAILOVER_MAX_HEADERS", integer(1), _COUNT,
           help="Header fields beyond which a request gets 431."),
        _o("max_header_bytes", "FAILOVER_MAX_HEADER_BYTES", size, "a size in bytes such as 32k",
           help="Header bytes beyond which a request gets 431."),
        _o("body_timeout", "FAILOVER_BODY_TIMEOUT", seconds(zero_ok=False, optional=True),
           f"{_SECS_POS}, or none", help="How long a request body may take to arrive (408)."),
        _o("send_timeout", "FAILOVER_SEND_TIMEOUT", seconds(zero_ok=False, optional=True),
           f"{_SECS_POS}, or none",
           help="How long a send to a caller that stopped reading may wait before it is cut."),
        _o("pick", "FAILOVER_PICK", pick_weights,
           "weights name=number separated by commas, such as in_flight=1,waiting=1,kv_cache=2,"
           "slots=1,first_data=0.1",
           help="The weights of a pool replica's score (see Pools)."),
        _o("pick_policy", "FAILOVER_PICK_POLICY", import_path,
           "an import path such as mypackage.scoring:policy",
           help="A pool's replica-picking policy of your own, or a function of the weights "
           "that builds one (see Pools, adding a scorer)."),
        _o("retries", "FAILOVER_RETRIES", integer(0), "a whole number >= 0",
           help="Tries of the same backend again after a transient fault, per request."),
        _o("max_retry_wait", "FAILOVER_MAX_RETRY_WAIT", seconds(), _SECS_NONNEG,
           help="The longest Retry-After waited out once before the same backend is retried."),
        _o("continuations", "FAILOVER_CONTINUATIONS", integer(0), "a whole number >= 0",
           help="Times per request a broken stream is finished on a later tier (0: never)."),
        _o("waiting_room", "FAILOVER_WAITING_ROOM", boolean, _BOOL,
           help="Wait at the gateway while every backend of the chain is full (see Pools)."),
        _o("max_wait", "FAILOVER_MAX_WAIT", seconds(zero_ok=False), _SECS_POS,
           help="How long a request waits in the waiting room at most."),
        _o("priority_header", "FAILOVER_PRIORITY_HEADER", header_name,
           "an HTTP header name such as X-Priority",
           help="The header naming a request's priority band in the waiting room."),
        _o("priority_bands", "FAILOVER_PRIORITY_BANDS", name_list,
           "names separated by commas, highest first, such as high,normal,low"),
        _o("max_waiting", "FAILOVER_MAX_WAITING", integer(1), _COUNT,
           help="Requests waiting in the waiting room beyond which new ones get 503."),
        _o("waiting_key_share", "FAILOVER_WAITING_KEY_SHARE", fraction,
           "a fraction above 0 and at most 1, such as 0.25",
           help="The share of the waiting room one caller key may hold (429 past it)."),
        _o("hedge_after", "FAILOVER_HEDGE_AFTER", seconds(optional=True),
           f"{_SECS_NONNEG}, or none (0 or none: never hedge)",
           help="Seconds without a first chunk after which a local or hedge-marked tier, "
           "still in doubt, is hedged with the next (see Hedging)."),
    ), wired=frozenset({"routes", "store", "status_board"}), code_only=frozenset({"resolve"})),
    Layer("Breaker", "tierchain.breaker", "middleware", (
        _o("failure_threshold", "BREAKER_FAILURE_THRESHOLD", integer(1), _COUNT),
        _o("failure_cooldown", "BREAKER_FAILURE_COOLDOWN", seconds(), _SECS_NONNEG),
        _o("stream_failure_threshold", "BREAKER_STREAM_FAILURE_THRESHOLD", integer(1), _COUNT,
           help="Mid-stream deaths in a row that open the breaker."),
        _o("probe_every", "BREAKER_PROBE_EVERY", seconds(), f"{_SECS} (0: off)",
           help="First recovery probe this long after failures open the breaker; each failed "
           "probe waits one more, up to the failure cooldown."),
        _o("saturation_threshold", "BREAKER_SATURATION_THRESHOLD", integer(1), _COUNT),
        _o("saturation_cooldown", "BREAKER_SATURATION_COOLDOWN", seconds(), _SECS_NONNEG),
        _o("saturation_backoff", "BREAKER_SATURATION_BACKOFF", seconds(), _SECS_NONNEG,
           help="First cooldown after a saturated half-open probe; doubles per re-open."),
        _o("retry_after_cap", "BREAKER_RETRY_AFTER_CAP", seconds(), _SECS_NONNEG),
        _o("probe_lease", "BREAKER_PROBE_LEASE", seconds(zero_ok=False), _SECS_POS),
        _o("rest_check_every", "BREAKER_REST_CHECK_EVERY", seconds(), f"{_SECS} (0: off)",
           help="How often the gateway re-checks a backend its breaker opened for saturation."),
        _o("rest_check_timeout", "BREAKER_REST_CHECK_TIMEOUT", seconds(zero_ok=False), _SECS_POS,
           help="How soon the gateway's own one-token check must see its first data."),
        _o("when_all_open", "BREAKER_WHEN_ALL_OPEN", choice("reject", "try_soonest"),
           "reject or try_soonest"),
        _o("backend", "BREAKER_BACKEND", backend_name,
           "a backend name (A-Z a-z 0-9 . _ -, 1-64 characters), used when no Failover runs"),
    ), wired=frozenset({"store", "status_board"})),
    Layer("SaturationWatchdog", "tierchain.watchdog", "middleware", (
        _o("slow_after", "SLOW_AFTER", slow_after,
           f"{_SECS} (0: off), or the word allowance, or the word auto"),
        _o("ceiling", "WATCHDOG_CEILING", seconds(zero_ok=False), _SECS_POS),
        _o("probe_timeout", "WATCHDOG_PROBE_TIMEOUT", seconds(zero_ok=False), _SECS_POS),
        _o("stall_after", "WATCHDOG_STALL_AFTER", slow_after_or_auto, f"{_SECS} (0: off), or auto"),
        _o("stall_floor", "WATCHDOG_STALL_FLOOR", seconds(zero_ok=False), _SECS_POS,
           help="The least learned stall window (stall_after=auto)."),
        _o("stall_ceiling", "WATCHDOG_STALL_CEILING", seconds(zero_ok=False), _SECS_POS,
           help="The stall window on the last tier, and the most any may be (auto)."),
        _o("reserve", "WATCHDOG_RESERVE", slow_after_or_auto, f"{_SECS}, or auto",
           help="Time kept for the later tiers while nothing is committed."),
        _o("reserve_floor", "WATCHDOG_RESERVE_FLOOR", seconds(), _SECS_NONNEG),
        _o("progress_span", "WATCHDOG_PROGRESS_SPAN", seconds(), _SECS_NONNEG,
           help="How long progress may not move before a status says no progress."),
        _o("normal_multiple", "WATCHDOG_NORMAL_MULTIPLE", number_above_zero, "a number >= 1",
           help="A working answer extends no further than this times the learned normal."),
        _o("ask_first", "WATCHDOG_ASK_FIRST", seconds(), f"{_SECS} (0: off)",
           help="Bound on asking a stale status before an attempt is sent."),
        _o("status_interval", "WATCHDOG_STATUS_INTERVAL", seconds(), f"{_SECS} (0: off)",
           help="How often a status URL is polled while traffic flows."),
        _o("status_stale", "WATCHDOG_STATUS_STALE", seconds(zero_ok=False), _SECS_POS,
           help="A polled status older than this is unknown."),
        _o("busy_waiting", "WATCHDOG_BUSY_WAITING", integer(1), _COUNT,
           help="Waiting requests at which a backend is full."),
        _o("busy_kv_cache", "WATCHDOG_BUSY_KV_CACHE", fraction, "a fraction such as 0.8",
           help="KV-cache use at which a backend is full."),
        _o("busy_all_slots", "WATCHDOG_BUSY_ALL_SLOTS", boolean, _BOOL,
           help="Every /slots slot busy means full."),
        _o("prompt_rate", "WATCHDOG_PROMPT_RATE", prompt_rate,
           "auto, a number of prompt tokens per second, or 0 (off)",
           help="A first token later than the prompt needs at this rate (times the margin) "
           "is too_slow, whatever a status says."),
        _o("prompt_margin", "WATCHDOG_PROMPT_MARGIN", number_above_zero, "a number >= 1",
           help="How many times the expected prefill a first token may take."),
        _o("status_late", "WATCHDOG_STATUS_LATE", seconds(), f"{_SECS} (0: off)",
           help="A status answer slower than this counts as full, never as room."),
        _o("suspect_for", "WATCHDOG_SUSPECT_FOR", seconds(), f"{_SECS} (0: off)",
           help="After a verdict on a backend, the callers after skip it this long, "
           "then one probes it."),
        _o("decode_rate", "WATCHDOG_DECODE_RATE", prompt_rate,
           "auto, a number of tokens per second, or 0 (off)",
           help="A committed stream with a later tier whose decode rate stays under "
           "slow_decode times this normal is starved and continued on the next tier."),
        _o("slow_decode", "WATCHDOG_SLOW_DECODE", fraction, "a fraction such as 0.25",
           help="The share of the normal decode rate under which a stream is starved."),
        _o("decode_span", "WATCHDOG_DECODE_SPAN", seconds(), _SECS,
           help="Seconds over which the decode rate is judged (two spans in a row)."),
    ), wired=frozenset({"store"}), code_only=frozenset({"readers", "client", "status_board"})),
    Layer("Allowance", "tierchain.allowance", "component", (
        _o("cold_start", "ALLOWANCE_COLD_START", seconds(), _SECS_NONNEG),
        _o("base", "ALLOWANCE_BASE", seconds(), _SECS_NONNEG),
        _o("per_1k_tokens", "ALLOWANCE_PER_1K_TOKENS", seconds(), _SECS_NONNEG),
        _o("ceiling", "ALLOWANCE_CEILING", seconds(zero_ok=False), _SECS_POS),
    ), code_only=frozenset({"tokenizer"}), help="Used when TIERCHAIN_SLOW_AFTER=allowance."),
    Layer("Learned", "tierchain.learned", "component", (
        _o("maximum", "LEARNED_MAXIMUM", seconds(zero_ok=False), _SECS_POS,
           help="The window until enough samples, and its upper bound."),
        _o("floor", "LEARNED_FLOOR", seconds(zero_ok=False), _SECS_POS),
        _o("quantile", "LEARNED_QUANTILE", fraction, "a fraction such as 0.99"),
        _o("margin", "LEARNED_MARGIN", number_above_zero, "a number > 0 such as 2"),
        _o("min_samples", "LEARNED_MIN_SAMPLES", integer(1), _COUNT),
        _o("half_life", "LEARNED_HALF_LIFE", number_above_zero, "a number of samples > 0"),
    ), help="Used when TIERCHAIN_SLOW_AFTER=auto."),
    Layer("Forwarder", "tierchain.forwarder", "handler", (
        _o("connect_timeout", "FORWARDER_CONNECT_TIMEOUT", seconds(zero_ok=False), _SECS_POS),
        _o("max_keepalive", "FORWARDER_MAX_KEEPALIVE", integer(0), "a whole number >= 0"),
        _o("max_body", "FORWARDER_MAX_BODY", size, "a size in bytes such as 512k or 32MiB",
           help="Alone (no Failover in the stack): the body size beyond which 413."),
        _o("body_timeout", "FORWARDER_BODY_TIMEOUT", seconds(zero_ok=False, optional=True),
           f"{_SECS_POS}, or none", help="Alone: how long a request body may take (408)."),
        _o("max_headers", "FORWARDER_MAX_HEADERS", integer(1), _COUNT,
           help="Alone: header fields beyond which 431."),
        _o("max_header_bytes", "FORWARDER_MAX_HEADER_BYTES", size, "a size in bytes such as 32k",
           help="Alone: header bytes beyond which 431."),
    ), code_only=frozenset({"backend", "client"}),
       help="The handler build_stack uses when it is given none."),
    Layer("Admin", "tierchain.admin", "app", (
        _o("token", "ADMIN_TOKEN", token, "16 to 512 printable ASCII characters, no spaces",
           secret=True),
        _o("max_ttl", "ADMIN_MAX_TTL", seconds(zero_ok=False), _SECS_POS),
        _o("session_ttl", "ADMIN_SESSION_TTL", seconds(zero_ok=False), _SECS_POS),
        _o("allowed_origins", "ADMIN_ALLOWED_ORIGINS", origin_list,
           "origins separated by commas, such as https://ops.example"),
        _o("max_body", "ADMIN_MAX_BODY", size, "a size in bytes such as 16384 or 16k"),
    ), wired=frozenset({"routes", "store", "keys"}), code_only=frozenset({"clock"}),
       help="Mounted at TIERCHAIN_ADMIN_PATH when TIERCHAIN_ADMIN_TOKEN is set."),
    Layer("Endpoints", "tierchain.endpoints", "app", (
        _o("metrics_key", "METRICS_KEY", token, "16 to 512 printable ASCII characters, no spaces",
           secret=True,
           help="When set, /metrics answers only Authorization: Bearer <key> (401 otherwise)."),
    ), wired=frozenset({"routes", "store", "prompt_metrics"}),
       code_only=frozenset({"owned_by", "created", "registry", "snapshot_timeout"}),
       help="/v1/models, /api/tags, /api/ps, /healthz, /readyz and /metrics, in front."),
    Layer("RedisStore", "tierchain.redis_store", "component", (
        _o("prefix", "REDIS_PREFIX", text, "a key prefix such as tierchain:"),
        _o("timeout", "REDIS_TIMEOUT", seconds(zero_ok=False), _SECS_POS),
        _o("reconnect_every", "REDIS_RECONNECT_EVERY", seconds(zero_ok=False), _SECS_POS),
        _o("ttl", "REDIS_TTL", seconds(zero_ok=False), f"{_SECS}, >= 1"),
    ), wired=frozenset({"url"}), code_only=frozenset({"clock"}),
       help="Used when TIERCHAIN_STORE_URL is a redis URL."),
    Layer("MemoryStore", "tierchain.store", "component", (
    ), code_only=frozenset({"clock"}), help="Used when TIERCHAIN_STORE_URL is memory://."),
)
# fmt: on

_BY_NAME = {layer.name: layer for layer in LAYERS}
_BY_ENV = {opt.env: (layer, opt) for layer in LAYERS for opt in layer.options}


def find_layer(name: str) -> Layer:
    """The table entry of the piece called ``name``; KeyError for an unknown name."""
    return _BY_NAME[name]


def layer_class(name: str) -> Any:
    """The class of the piece called ``name`` (``"Budget"``, ``"RedisStore"``, ...).

    Imported on first use, so that reading the configuration imports no middleware.
    """
    layer = _BY_NAME[name]
    return getattr(importlib.import_module(layer.module), layer.name)


def _keyword_params(cls: Any) -> dict[str, inspect.Parameter]:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # pragma: no cover - every layer is a class
        return {}
    return {
        name: p
        for name, p in signature.parameters.items()
        if name != "app" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def uncovered_options() -> dict[str, list[str]]:
    """Constructor arguments that no table line covers (should be empty)."""
    missing: dict[str, list[str]] = {}
    for layer in LAYERS:
        if layer.kind == "general":
            continue
        cls = layer_class(layer.name)
        known = {o.name for o in layer.options} | layer.wired | layer.code_only
        extra = [name for name in _keyword_params(cls) if name not in known]
        if extra:
            missing[layer.name] = extra
    return missing


# -- settings ----------------------------------------------------------------------


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

    general = parsed["tierchain"]
    explicit_stack: tuple[str, ...] | None = general.get("stack")

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

    # Allowance variables only mean something with TIERCHAIN_SLOW_AFTER=allowance.
    if parsed["SaturationWatchdog"].get("slow_after") != _ALLOWANCE:
        for env_name in sources["Allowance"].values():
            problems.append(
                f"{env_name} is set but has no effect: set TIERCHAIN_SLOW_AFTER=allowance to use it"
            )

    if parsed["SaturationWatchdog"].get("slow_after") != _AUTO:
        for env_name in sources["Learned"].values():
            problems.append(
                f"{env_name} is set but has no effect: set TIERCHAIN_SLOW_AFTER=auto to use it"
            )

    # Routes.
    routes_file = general.get("routes_file")
    routes: Routes | None = None
    if routes_file is not None:
        try:
            routes = load_routes(routes_file, environ=env)
        except ConfigError as exc:
            problems.extend(exc.problems)
    elif layers["Failover"].enabled or "token" in parsed["Admin"]:
        who = "Failover" if layers["Failover"].enabled else "Admin"
        problems.append(
            f"TIERCHAIN_ROUTES_FILE is not set: {who} needs routes; expected the path of a "
            "TOML file with [routes.<name>] tables (or leave Failover out with TIERCHAIN_STACK)"
        )

    store = general.get("store_url", "memory://")
    if store == "memory://":
        for env_name in sources["RedisStore"].values():
            problems.append(
                f"{env_name} is set but has no effect: TIERCHAIN_STORE_URL is not a redis URL"
            )

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


# -- warnings: a configuration that loads, but will not do what it looks like ----------

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


build_stack: Callable[..., Any]
"""The old path of :func:`tierchain.stack.build_stack`: the same function, put here by the
package's ``__init__`` once both modules are imported, so that this module never imports the
stack that imports it (docs/internals.md, the floors)."""
