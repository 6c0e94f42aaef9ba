"""Spans, metrics and log events: the observability every layer reuses.

- Spans come from the OpenTelemetry API (``tracer``). With no SDK configured
  they are non-recording and cost a few hundred nanoseconds.
- Metrics are Prometheus collectors on the default registry, all defined here
  so that one file lists every name tierchain exports. The ones updated on
  every request or streamed line (:class:`LoopCounter`, :class:`LoopHistogram`)
  are counted with a plain add on the event loop's thread, without a lock,
  and read by the registry when it is scraped. Under prometheus-client's
  multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set) they are its own
  collectors instead, so that every worker's counts are summed.
- Log events go through stdlib :mod:`logging` on the ``tierchain`` logger, one
  record per event with a stable event name as the message's first word and the
  fields in ``record.tierchain`` (see :func:`log_event`). Nothing is formatted
  unless the level is enabled.
"""

from __future__ import annotations

import json
import logging
import os
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Generic, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import propagation as trace_propagation
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from .logs import one_line
from .masking import hidden, mask_text

try:
    VERSION = version("tierchain")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    VERSION = "0+unknown"

tracer = trace.get_tracer("tierchain", VERSION)
logger = logging.getLogger("tierchain")

# -- span attribute names ----------------------------------------------------
ATTR_ROUTE = "tierchain.route"
ATTR_BACKEND = "tierchain.backend"
ATTR_REGIME = "tierchain.backend.regime"
ATTR_POOL = "tierchain.pool"
ATTR_RETRY = "tierchain.attempt.retry"
ATTR_ATTEMPT_N = "tierchain.attempt.n"
ATTR_ATTEMPT_OF = "tierchain.attempt.of"
ATTR_OUTCOME = "tierchain.outcome"
ATTR_CONTINUES = "tierchain.continuation.from"
ATTR_AFTER_CHARS = "tierchain.continuation.after_chars"
ATTR_WRITTEN_BY = "tierchain.continuation.written_by"
ATTR_HEDGE_WITH = "tierchain.hedge.with"
ATTR_HEDGE_FOR = "tierchain.hedge.for"

# -- lock-free collectors ---------------------------------------------------------


_Child = TypeVar("_Child")


class _CountChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` (from the event loop's thread)."""
        self.value += amount


class _LoopMetric(Generic[_Child]):
    """What the two hot-path collectors share: their name, labels and children."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        if not self._labelnames:
            self._children[()] = self._child()
        if registry is not None:
            registry.register(self)

    def _child(self) -> _Child:
        raise NotImplementedError

    def collect(self) -> Iterator[Metric]:
        """The samples, when the registry is scraped."""
        raise NotImplementedError

    def labels(self, *values: str) -> _Child:
        """The child for these label values (created on first use)."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name} takes labels {self._labelnames}, got {values!r}")
            child = self._children[values] = self._child()
        return child


class LoopCounter(_LoopMetric[_CountChild]):
    """A Prometheus counter for the hot path: ``labels(...).inc()`` is a plain add.

    prometheus-client's own counter takes a lock on every increment; this one is
    meant to be updated from one event loop's thread (as every tierchain layer
    is) and exposes the same samples (``<name>_total`` and ``<name>_created``).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> _CountChild:
        return _CountChild()

    def inc(self, amount: float = 1.0) -> None:
        """Add ``amount`` to a counter without labels."""
        self._children[()].value += amount

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value, created=child.created)
        yield family


class _HistogramChild:
    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        """Count one observation (from the event loop's thread)."""
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class LoopHistogram(_LoopMetric[_HistogramChild]):
    """A Prometheus histogram for the hot path, the counterpart of :class:`LoopCounter`."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None = REGISTRY,
    ) -> None:
        self._bounds = tuple(sorted(float(b) for b in buckets))
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        names = self._labelnames
        for values, child in list(self._children.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*self._bounds, float("inf")), child.counts, strict=True):
                cumulative += count
                buckets.append((_le(bound), float(cumulative)))
            family.add_metric(values, buckets, child.sum)
            family.add_sample(
                self._name + "_created", dict(zip(names, values, strict=True)), child.created
            )
        yield family


def _le(bound: float) -> str:
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


# Multiprocess mode keeps its values in files shared by the workers: only
# prometheus-client's own collectors write there.
_MULTIPROCESS = bool(
    os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")  # noqa: SIM112 (the older spelling)
)
_HotCounter: Any = Counter if _MULTIPROCESS else LoopCounter
_HotHistogram: Any = Histogram if _MULTIPROCESS else LoopHistogram

# -- metrics -------------------------------------------------------------------
ATTEMPTS = _HotCounter(
    "tierchain_attempts",
    "Attempts by route, backend and outcome.",
    ["route", "backend", "outcome"],
)
TIME_TO_FIRST_CHUNK = _HotHistogram(
    "tierchain_time_to_first_chunk_seconds",
    "Seconds from the start of an attempt to its first chunk (first data event for SSE).",
    ["route", "backend"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280),
)
BACKEND_SATURATED = Counter(
    "tierchain_backend_saturated",
    "Attempts abandoned because the backend produced no first chunk in time.",
    ["route", "backend"],
)
PROBE_ANSWERS = Counter(
    "tierchain_probe_answers",
    "Status-probe answers by verdict (working, idle, unknown, no_progress, queued, too_slow).",
    ["backend", "verdict"],
)
BUDGET_EXHAUSTED = Counter(
    "tierchain_budget_exhausted",
    "Requests answered 504 because their budget was spent.",
    ["route"],
)
SHED_REQUESTS = Counter(
    "tierchain_shed_requests",
    "Requests answered 503 by Shed because the process was at capacity.",
)
STREAM_HEARTBEATS = _HotCounter(
    "tierchain_stream_heartbeats",
    "Heartbeat comment lines written into streams, by state.",
    ["state"],
)
BREAKER_STATE = Gauge(
    "tierchain_breaker_state",
    "Breaker state per route and backend: 0 closed, 1 half-open, 2 open.",
    ["route", "backend"],
)
BREAKER_TRANSITIONS = Counter(
    "tierchain_breaker_transitions",
    "Breaker transitions by the state entered.",
    ["route", "backend", "to"],
)
BREAKER_RECOVERY_PROBES = Counter(
    "tierchain_breaker_recovery_probes",
    "Requests a half-open breaker let through as its recovery probe.",
    ["route", "backend"],
)
BREAKER_REST_CHECKS = Counter(
    "tierchain_breaker_rest_checks",
    "The gateway's own checks of a backend its breaker opened for saturation, by result.",
    ["route", "backend", "result"],
)
BACKEND_SKIPPED = Counter(
    "tierchain_backend_skipped",
    "Attempts skipped because the backend's breaker was open.",
    ["route", "backend"],
)
BACKEND_IN_FLIGHT = Gauge(
    "tierchain_backend_in_flight",
    "Attempts this process has in flight at a backend with max_in_flight (sum over replicas).",
    ["backend"],
)
BACKEND_BUSY = Counter(
    "tierchain_backend_busy",
    "Attempts skipped before sending because the backend had no room, by why "
    "(max_in_flight, status).",
    ["route", "backend", "why"],
)
LEARNED_SLOW_AFTER = Gauge(
    "tierchain_learned_slow_after_seconds",
    "The learned first-chunk window in force (slow_after=auto), by backend and prompt size.",
    ["backend", "bucket"],
)
LEARNED_PROMPT_RATE = Gauge(
    "tierchain_learned_prompt_rate",
    "The learned normal prompt rate in tokens per second (the slow end), by backend.",
    ["backend"],
)
LEARNED_DECODE_RATE = Gauge(
    "tierchain_learned_decode_rate",
    "The learned normal decode rate in tokens per second once generating (the slow end), "
    "by backend.",
    ["backend"],
)
LEARNED_BYTES_PER_TOKEN = Gauge(
    "tierchain_learned_bytes_per_token",
    "Request body bytes per prompt token, learned from the usage the answers reported.",
    ["backend"],
)
SUSPECT_MARKS = Counter(
    "tierchain_backend_suspect",
    "Verdicts that marked a backend suspect (the callers after skip it), by why.",
    ["route", "backend", "why"],
)
LEARNED_STALL_AFTER = Gauge(
    "tierchain_learned_stall_after_seconds",
    "The learned gap allowed between data events (stall_after=auto), by backend.",
    ["backend", "bucket"],
)
POOL_PICKS = Counter(
    "tierchain_pool_picks",
    "Attempts at a pool's replicas, by route, pool and the replica picked.",
    ["route", "pool", "backend"],
)
POOL_AFFINITY = Counter(
    "tierchain_pool_affinity",
    "Pool picks for a request with a prompt prefix: hit (the replica that holds it went "
    "first), loaded (it was too loaded or full), miss (no replica known).",
    ["route", "pool", "result"],
)
WAITING_ROOM_REQUESTS = Gauge(
    "tierchain_waiting_room_requests",
    "Requests waiting in the waiting room for a backend with room.",
    ["route"],
)
WAITING_ROOM_WAIT = Histogram(
    "tierchain_waiting_room_wait_seconds",
    "Seconds each request waited in the waiting room, by how the wait ended "
    "(released, max_wait, cancelled).",
    ["route", "outcome"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
HEDGES = Counter(
    "tierchain_hedges",
    "Quiet attempts hedged with the next tier, by which side produced data first "
    "(first, hedge, none).",
    ["route", "backend", "winner"],
)
CONTINUATIONS = Counter(
    "tierchain_continuations",
    "Committed streams that broke and were (or could not be) finished on a later tier.",
    ["route", "from", "to", "outcome"],
)
WAITING_ROOM_REFUSED = Counter(
    "tierchain_waiting_room_refused",
    "Requests the waiting room turned away, by why: full (503), key_share (429, one key's "
    "share of the room taken) or max_wait (503, every backend still full after max_wait).",
    ["route", "reason"],
)
SAME_TIER_RETRIES = Counter(
    "tierchain_same_tier_retries",
    "Attempts sent again to the same backend after a transient fault, by the fault.",
    ["route", "backend", "reason"],
)
RESERVE_ENDED = Counter(
    "tierchain_reserve_ended",
    "Attempts ended to keep the reserve for the later tiers (outcome saturated, reason reserve).",
    ["route", "backend"],
)
BACKEND_PREFERENCE = Counter(
    "tierchain_backend_preference",
    "Requests that carried a backend preference, by whether it applied.",
    ["applied"],
)
TARGET_REJECTED = Counter(
    "tierchain_target_rejected",
    "Requests answered 400 because their target could steer the upstream URL, by reason.",
    ["reason"],
)

TOKENS = Counter(
    "tierchain_tokens",
    "Tokens by caller key name, route, backend and kind: input and output as the answering "
    "backend reported them, input_estimated and output_estimated where it reported none, "
    "failed_input and failed_output for an attempt that failed after it began answering.",
    ["key_name", "route", "backend", "kind"],
)
COST = Counter(
    "tierchain_cost",
    "What the answering backends' tokens cost, by caller key name, route and backend, in the "
    "currency of the backends' prices (price_input and price_output, per million tokens).",
    ["key_name", "route", "backend"],
)
GEN_AI_TOKEN_USAGE = Histogram(
    "gen_ai_client_token_usage",
    "OpenTelemetry GenAI's gen_ai.client.token.usage: tokens per answered request, by "
    "operation, requested model (the route) and token type (input, output).",
    ["gen_ai_operation_name", "gen_ai_request_model", "gen_ai_token_type"],
    buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216),
)
GEN_AI_TIME_TO_FIRST_TOKEN = _HotHistogram(
    "gen_ai_server_time_to_first_token_seconds",
    "OpenTelemetry GenAI's gen_ai.server.time_to_first_token: seconds from the start of the "
    "answering attempt to its first data, by requested model (the route).",
    ["gen_ai_request_model"],
    buckets=(0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30, 120, 600),
)
REQUESTS_REFUSED = Counter(
    "tierchain_requests_refused",
    "Requests refused before any backend for what the caller sent (headers, framing, a slow "
    "body, a missing key), by status and reason.",
    ["status", "reason"],
)

CALLERS_CUT = Counter(
    "tierchain_callers_cut",
    "Requests cut because the caller stopped reading (a send to it was out past Failover's "
    "send_timeout), by route and the backend whose answer it was not taking; never counted "
    "against that backend.",
    ["route", "backend"],
)


def labelled(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, memoised: the hot path pays a dict lookup, not a lock."""
    key = (id(metric), values)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*values)
    return child


_CHILDREN: dict[tuple[int, tuple[str, ...]], Any] = {}


class AttemptMetrics:
    """The labelled children an attempt at one backend on one route updates, resolved once
    for the pair (:func:`attempt_metrics`) instead of one :func:`labelled` look-up each:
    ``first_chunk`` (``tierchain_time_to_first_chunk_seconds``), ``first_token``
    (``gen_ai_server_time_to_first_token``) and :meth:`attempts` by outcome."""

    __slots__ = ("_attempts", "_pair", "first_chunk", "first_token")

    def __init__(self, route: str, backend: str) -> None:
        self._pair = (route, backend)
        self.first_chunk = labelled(TIME_TO_FIRST_CHUNK, route, backend)
        self.first_token = labelled(GEN_AI_TIME_TO_FIRST_TOKEN, route)
        self._attempts: dict[str, Any] = {}

    def attempts(self, outcome: str) -> Any:
        """``tierchain_attempts_total``'s child for ``outcome``."""
        child = self._attempts.get(outcome)
        if child is None:
            child = self._attempts[outcome] = labelled(ATTEMPTS, *self._pair, outcome)
        return child


def attempt_metrics(route: str, backend: str) -> AttemptMetrics:
    """The :class:`AttemptMetrics` of ``backend`` on ``route``, made once for the pair (the
    pairs are the routes and backends of the configuration, and the refused requests'
    empty route: a bounded table, as :func:`labelled`'s)."""
    metrics = _ATTEMPT_METRICS.get((route, backend))
    if metrics is None:
        metrics = _ATTEMPT_METRICS[route, backend] = AttemptMetrics(route, backend)
    return metrics


_ATTEMPT_METRICS: dict[tuple[str, str], AttemptMetrics] = {}


def tracing_enabled() -> bool:
    """True once a tracer provider has been installed (by an OpenTelemetry SDK)."""
    # The API keeps the installed provider in a module global; reading it is far
    # cheaper than get_tracer_provider(), which consults os.environ every call. A private
    # name, on purpose (docs/internals.md; tests/test_dependency_internals.py guards it):
    # were it gone, spans stay on. (Read as an attribute: getattr() with a default is a
    # builtin's call a request.)
    return trace._TRACER_PROVIDER is not None if _PROVIDER_KEPT else True


_PROVIDER_KEPT = hasattr(trace, "_TRACER_PROVIDER")


def _span_slot() -> tuple[ContextVar[Any], str] | None:
    """Where OpenTelemetry keeps the current span: its runtime context's ``ContextVar`` and
    the span's key in the context it holds (private names: docs/internals.md,
    tests/test_dependency_internals.py). None when either is not where it was (another
    runtime context configured, or a new API): then :func:`current_span` asks the API."""
    runtime = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    var = getattr(runtime, "_current_context", None)
    key = getattr(trace_propagation, "_SPAN_KEY", None)
    if isinstance(var, ContextVar) and isinstance(key, str):
        return var, key
    return None


_SPAN_SLOT = _span_slot()


def current_span() -> trace.Span:
    """``trace.get_current_span()`` in one call instead of four (Heartbeats asks once per
    request): the same span, or ``INVALID_SPAN`` when none is current."""
    if _SPAN_SLOT is None:
        return trace.get_current_span()
    var, key = _SPAN_SLOT
    span = var.get().get(key)
    if span is None:
        return trace.INVALID_SPAN
    # ``trace.Span`` is an ABC, whose isinstance is costly: a span class seen once is known.
    if type(span) in _SPAN_TYPES:
        return span  # type: ignore[no-any-return]
    if isinstance(span, trace.Span):
        if len(_SPAN_TYPES) < 16:
            _SPAN_TYPES.add(type(span))
        return span
    return trace.INVALID_SPAN


_SPAN_TYPES: set[type] = set()  # classes of spans current_span has returned (a few)


def start_span(name: str, attributes: dict[str, Any] | None = None) -> trace.Span:
    """A span when tracing is configured, else the shared non-recording span (no cost)."""
    if not tracing_enabled():
        return trace.INVALID_SPAN
    return tracer.start_span(name, attributes=attributes)


_OPERATIONS = (
    ("/chat/completions", "chat"),
    ("/completions", "text_completion"),
    ("/embeddings", "embeddings"),
    ("/embed", "embeddings"),
    ("/api/generate", "text_completion"),
)


def gen_ai_operation(path: str) -> str:
    """OpenTelemetry GenAI's ``gen_ai.operation.name`` for a request path (``chat`` else)."""
    for suffix, name in _OPERATIONS:
        if path.endswith(suffix):
            return name
    return "chat"


def observe_usage(
    path: str, route: str, input_tokens: int, output_tokens: int, begun: float
) -> None:
    """One answered request's usage in OpenTelemetry GenAI's terms: the
    ``gen_ai.client.token.usage`` histogram and, when tracing, a span named
    ``<operation> <model>`` (from ``begun``, epoch seconds, to now) with
    ``gen_ai.operation.name``, ``gen_ai.request.model`` and ``gen_ai.usage.input_tokens``
    / ``output_tokens``."""
    operation = gen_ai_operation(path)
    labelled(GEN_AI_TOKEN_USAGE, operation, route, "input").observe(input_tokens)
    labelled(GEN_AI_TOKEN_USAGE, operation, route, "output").observe(output_tokens)
    if tracing_enabled():
        span = tracer.start_span(
            f"{operation} {route}",
            start_time=int(begun * 1e9),
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": route,
                "gen_ai.usage.input_tokens": input_tokens,
                "gen_ai.usage.output_tokens": output_tokens,
            },
        )
        span.end()


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured event: ``event key=value ...``.

    A URL in a string field is masked (:func:`tierchain.masking.mask_text`), and
    so is any string field once caller keys are registered (:func:`~tierchain.masking.hide`).
    The fields are also attached as ``record.tierchain`` (a dict) and the event
    name as ``record.event``, for JSON formatters.
    """
    if not logger.isEnabledFor(level):
        return
    every = hidden()  # caller keys registered: every string field is checked
    for key, value in fields.items():
        if isinstance(value, str) and (every or "://" in value):
            fields[key] = mask_text(value)
    text = one_line(
        " ".join(
            f"{key}={json.dumps(value, ensure_ascii=False, default=str)}"
            for key, value in fields.items()
        )
    )
    logger.log(
        level,
        "%s %s",
        event,
        text,
        extra={"event": event, "tierchain": fields},
    )
