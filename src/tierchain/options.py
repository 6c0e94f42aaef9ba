"""The option table: one :class:`Option` line per ``TIERCHAIN_*`` variable, in :data:`LAYERS`.

Each configurable piece (a middleware, a handler, an app, a component) is a :class:`Layer`:
its class, its options, and the arguments it gets otherwise (``wired`` by the stack,
``code_only`` objects). :func:`uncovered_options` finds a constructor argument no line
covers. The parsers the lines name are :mod:`tierchain.env_parsers`; reading the environment
with this table is :func:`tierchain.config.from_env`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Literal

from ._checks import TEXT_DURATION
from .env_parsers import (
    _AUTO,
    STACK_ORDER,
    Parser,
    backend_name,
    boolean,
    choice,
    count_or_none,
    fraction,
    header_name,
    import_path,
    integer,
    mount_path,
    name_list,
    number_above_zero,
    origin_list,
    path_list,
    pick_weights,
    prompt_rate,
    seconds,
    size,
    slow_after,
    slow_after_or_auto,
    stack_list,
    status_list,
    store_url,
    text,
    token,
)

__all__ = [
    "FOREIGN_VARIABLES",
    "LAYERS",
    "PREFIX",
    "SERVE_DEFAULTS",
    "STACK_ORDER",
    "Kind",
    "Layer",
    "Option",
    "find_layer",
    "layer_class",
    "uncovered_options",
]

PREFIX = "TIERCHAIN_"

# Variables with this prefix that other tools read (the test harness), not the gateway.
FOREIGN_VARIABLES = frozenset(
    {"TIERCHAIN_CHROMIUM", "TIERCHAIN_LLAMA_SERVER", "TIERCHAIN_SMOLLM2_GGUF"}
)
"""Variables the test harness reads (docs/benchmarks.md's ``eval`` line exports the last
two): never a problem, so a shell that ran it can still start ``tierchain serve``."""


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
    Layer("MemoryStore", "tierchain.memory_store", "component", (
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
