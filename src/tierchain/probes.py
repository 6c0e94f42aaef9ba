"""Ask a backend whether it is still working: the status probe and its readers.

A *reader* turns the body of a backend's status URL into a :class:`Status`
(busy or not, and a progress value when the format has one), or returns
``None`` when the body is not a shape it knows. A reader is a plain callable,
``reader(body: bytes) -> Status | None``; one that raises counts as ``None``.

:func:`judge` turns a status and the previous probe's progress into one of four
verdicts:

=============== ===========================================================
``working``     busy, and progress moved since the previous probe (or there
                is no previous probe, or the format has no progress value)
``no_progress`` busy, but the progress value is the same as last time:
                starved, not working (the starved-GPU outage)
``idle``        the backend says it is doing nothing: our request is not
                being worked on
``queued``      busy, and the backend says requests are waiting for room
                (or every slot is busy generating for others): the progress
                it reports is someone else's, so ours is saturated
``unknown``     any error, timeout, non-200 answer or body no reader knows
``too_slow``    moving, but far too slowly to produce a first token in the
                time left (a starved GPU): given by the SaturationWatchdog,
                which knows the time left, never by :func:`judge`
=============== ===========================================================

``unknown`` is never treated as working: the caller falls back to the plain
stopwatch.

Someone else's progress is not ours. A request that has sent no first chunk
while the backend reports a queue (llama.cpp ``requests_deferred``, vLLM
``num_requests_waiting``, every ``/slots`` slot busy and already generating)
is waiting behind other work, however fast the counters move: ``queued``.
"Working" needs evidence that our request may be the one in progress: a slot
still processing a prompt (it could be ours), or no queue at all. A request
that does not stream sends nothing until it is complete, so for it a queue
proves nothing: :func:`judge` takes ``streaming=False`` and then ignores it.

A status also carries the capacity facts the status-aware routing reads:
``waiting`` (requests queued), ``kv_cache`` (0..1) and ``slots``/``slots_busy``.

Built-in readers (see ``docs/watchdog.md`` for the formats):

- :func:`gate_status`: ``{"active_generation_count": N, "active_generations":
  [...]}`` (an ai-gate style proxy). A generation for another model still means
  busy: on a one-GPU host that model is being swapped in ahead of ours.
  No progress value.
- :func:`vllm_metrics`: vLLM's Prometheus ``/metrics``. Busy when
  ``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` > 0. Progress
  is the prompt and generation token counters together with the KV-cache
  usage gauge, because vLLM counts a prompt's tokens only when its prefill
  completes, while KV blocks are allocated chunk by chunk during the prefill.
- :func:`llamacpp_metrics`: llama.cpp server's ``/metrics`` (``--metrics``).
  Busy when ``llamacpp:requests_processing`` + ``llamacpp:requests_deferred``
  > 0. Progress is ``llamacpp:n_decode_total`` (one per ``llama_decode()``
  call, prompt batches included) with the token counters.
- :func:`llamacpp_slots`: llama.cpp server's ``/slots``. Busy when a slot has
  ``is_processing: true`` (older builds: ``state != 0``). Progress is each
  busy slot's ``next_token.n_decoded`` (``next_token`` is an object in older
  builds and a list of objects in current ones; current builds also count a
  prompt's processed tokens, ``n_prompt_tokens_processed``, which then make
  the progress of a prefilling slot), but only once every busy slot has
  started generating: a slot still processing its prompt shows no counter
  there, and reading a flat ``0`` as "starved" would kill a healthy prefill.
- :func:`auto_reader` (the default) tries the above by shape.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ._json import loads as load_json
from ._runtime import clock
from ._runtime.deadlines import EARLY
from ._runtime.loops import PerLoop

__all__ = [
    "Reader",
    "Status",
    "Verdict",
    "auto_reader",
    "end_flights",
    "fetch_status",
    "gate_status",
    "judge",
    "llamacpp_metrics",
    "llamacpp_slots",
    "parse_prometheus",
    "total_slots",
    "vllm_metrics",
]

Verdict = Literal["working", "idle", "unknown", "no_progress", "queued", "too_slow"]


@dataclass(frozen=True, slots=True)
class Status:
    """What a status URL said: ``busy``, and a ``progress`` value if it has one.

    ``progress`` is compared with ``==`` between two probes of the same
    attempt; any hashable value works (a number, a tuple). ``None`` means the
    format exposes no progress, so "busy" is taken at its word.
    """

    busy: bool
    progress: Hashable | None = None
    detail: str | None = None
    waiting: int | None = None
    """Requests the backend says are waiting for room (None: the format does not say)."""
    kv_cache: float | None = None
    """KV-cache use, 0..1 (None: the format does not say)."""
    slots: int | None = None
    """How many slots the backend has (``/slots`` only)."""
    slots_busy: int | None = None
    """How many of them are busy."""
    prefilling: int | None = None
    """Busy slots still processing a prompt: one of them may be a request of ours."""
    prompt_done: int | None = None
    """Prompt tokens processed so far by the one slot still processing a prompt
    (llama.cpp ``/slots`` ``n_prompt_tokens_processed``; None when the format does
    not say, or when no slot or several are prefilling)."""
    processing: int | None = None
    """Requests being processed now (llama.cpp ``requests_processing``): with a known
    slot count (``/props`` ``total_slots``) it says whether every slot is taken."""

    @property
    def queued(self) -> bool:
        """True when work is waiting for room and nothing reported can be a new request."""
        if self.waiting is not None and self.waiting > 0:
            return True
        return (
            self.slots is not None
            and self.slots > 0
            and self.slots_busy == self.slots
            and self.prefilling == 0
        )


Reader = Callable[[bytes], "Status | None"]


def judge(status: Status | None, previous: Hashable | None, *, streaming: bool = True) -> Verdict:
    """The verdict for ``status`` given the previous probe's progress value.

    ``streaming`` says the request would have sent a first chunk by now had it
    been admitted; then a queue at the backend means ours is in it (``queued``).
    """
    if status is None:
        return "unknown"
    if not status.busy:
        return "idle"
    if streaming and status.queued:
        return "queued"
    if status.progress is not None and previous is not None and status.progress == previous:
        return "no_progress"
    return "working"


# -- JSON shapes ---------------------------------------------------------------


def _json(body: bytes) -> Any:
    try:
        return load_json(body)
    except (UnicodeDecodeError, ValueError):
        return None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return int(value)


def gate_status(body: bytes) -> Status | None:
    """Read the gate shape: ``active_generation_count`` and/or ``active_generations``."""
    data = _json(body)
    if not isinstance(data, dict):
        return None
    has_count = "active_generation_count" in data
    has_list = "active_generations" in data
    if not (has_count or has_list):
        return None
    count = _count(data.get("active_generation_count")) if has_count else 0
    generations = data.get("active_generations") if has_list else []
    if count is None or not isinstance(generations, list):
        return None
    active = max(count, len(generations))
    models = sorted(
        {str(g.get("model")) for g in generations if isinstance(g, dict) and g.get("model")}
    )
    detail = f"{active} active" + (f" ({', '.join(models)})" if models else "")
    return Status(busy=active > 0, progress=None, detail=detail)


def _slot_busy(slot: dict[str, Any]) -> bool | None:
    flag = slot.get("is_processing")
    if isinstance(flag, bool):
        return flag
    state = slot.get("state")
    if isinstance(state, int) and not isinstance(state, bool):
        return state != 0
    return None


def llamacpp_slots(body: bytes) -> Status | None:
    """Read llama.cpp server's ``GET /slots`` (a JSON list of slots)."""
    data = _json(body)
    if not isinstance(data, list) or not data:
        return None
    busy_slots: list[tuple[Any, int | None]] = []
    prefill: list[int | None] = []
    for slot in data:
        if not isinstance(slot, dict):
            return None
        busy = _slot_busy(slot)
        if busy is None:
            return None
        if busy:
            busy_slots.append((slot.get("id"), _decoded(slot)))
            prefill.append(_count(slot.get("n_prompt_tokens_processed")))
    progress: Hashable | None = None
    if busy_slots and all(d is not None and d > 0 for _, d in busy_slots):
        progress = tuple(sorted((str(i), d) for i, d in busy_slots))
    elif busy_slots and all(p is not None for p in prefill):
        # Current builds count a prompt's tokens as they are processed: a
        # prefilling slot shows progress too.
        progress = tuple(
            sorted((str(i), d or 0, p) for (i, d), p in zip(busy_slots, prefill, strict=True))
        )
    prefilling = sum(1 for _, d in busy_slots if not d)
    prompt_done = None
    prefill_counts = [p for (_, d), p in zip(busy_slots, prefill, strict=True) if not d]
    if len(prefill_counts) == 1:
        prompt_done = prefill_counts[0]
    detail = f"{len(busy_slots)}/{len(data)} busy"
    if busy_slots and prefilling == 0 and len(busy_slots) == len(data):
        detail += ", all generating"
    return Status(
        busy=bool(busy_slots),
        progress=progress,
        detail=detail,
        slots=len(data),
        slots_busy=len(busy_slots),
        prefilling=prefilling,
        prompt_done=prompt_done,
    )


def _decoded(slot: dict[str, Any]) -> int | None:
    """A busy slot's generated-token count: ``next_token`` as an object or a list of them."""
    token = slot.get("next_token")
    if isinstance(token, list):
        counts = [_count(t.get("n_decoded")) for t in token if isinstance(t, dict)]
        known = [c for c in counts if c is not None]
        decoded = max(known) if known else None
    elif isinstance(token, dict):
        decoded = _count(token.get("n_decoded"))
    else:
        decoded = None
    return decoded if decoded is not None else _count(slot.get("n_decoded"))


# -- Prometheus text -------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum the samples of each metric name in Prometheus text exposition format.

    Labels are dropped (samples of one name are added up, e.g. across models),
    ``#`` lines are skipped, and unparsable lines are ignored.
    """
    totals: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            close = line.rfind("}")
            if close < brace:
                continue
            name, rest = line[:brace], line[close + 1 :]
        elif space != -1:
            name, rest = line[:space], line[space:]
        else:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isfinite(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


def _text(body: bytes) -> str | None:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _metrics_status(
    body: bytes,
    busy_names: Iterable[str],
    progress_names: Iterable[str],
    waiting_name: str,
    kv_names: Iterable[str],
    processing_name: str | None = None,
) -> Status | None:
    text = _text(body)
    if text is None:
        return None
    values = parse_prometheus(text)
    busy_names = tuple(busy_names)
    if busy_names[0] not in values:
        return None
    active = sum(values.get(name, 0.0) for name in busy_names)
    present = [name for name in progress_names if name in values]
    progress = tuple(round(values[name], 6) for name in present) if present else None
    waiting = int(values[waiting_name]) if waiting_name in values else None
    kv = next((values[name] for name in kv_names if name in values), None)
    detail = f"{active - waiting:g} running, {waiting} waiting" if waiting else f"{active:g} active"
    processing = None
    if processing_name is not None and processing_name in values:
        processing = int(values[processing_name])
    return Status(
        busy=active > 0,
        progress=progress,
        detail=detail,
        waiting=waiting,
        kv_cache=kv,
        processing=processing,
    )


def vllm_metrics(body: bytes) -> Status | None:
    """Read vLLM's Prometheus ``GET /metrics``."""
    return _metrics_status(
        body,
        ("vllm:num_requests_running", "vllm:num_requests_waiting"),
        (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:kv_cache_usage_perc",
            "vllm:gpu_cache_usage_perc",
        ),
        "vllm:num_requests_waiting",
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    )


def llamacpp_metrics(body: bytes) -> Status | None:
    """Read llama.cpp server's Prometheus ``GET /metrics``.

    ``processing`` is ``llamacpp:requests_processing``: a server with that many
    slots (``/props`` ``total_slots``, read by the status board) is full.
    """
    return _metrics_status(
        body,
        ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
        (
            "llamacpp:n_decode_total",
            "llamacpp:prompt_tokens_total",
            "llamacpp:tokens_predicted_total",
        ),
        "llamacpp:requests_deferred",
        ("llamacpp:kv_cache_usage_ratio",),
        processing_name="llamacpp:requests_processing",
    )


def total_slots(body: bytes) -> int | None:
    """A server's slot count from llama.cpp's ``GET /props`` (``total_slots``), else None.

    The field is ``params.n_parallel`` in ``tools/server/server-context.cpp``
    (``get_props``); older builds have the same key in ``server.cpp``.
    """
    data = _json(body)
    if not isinstance(data, dict):
        return None
    count = _count(data.get("total_slots"))
    return count if count else None


_BUILT_IN: tuple[Reader, ...] = (gate_status, llamacpp_slots, vllm_metrics, llamacpp_metrics)


def auto_reader(body: bytes) -> Status | None:
    """Try every built-in reader; the first that knows the shape answers."""
    for reader in _BUILT_IN:
        status = reader(body)
        if status is not None:
            return status
    return None


MAX_STATUS_BYTES = 4 * 2**20
"""A status body larger than this is not read to the end: the answer is unknown."""


_Flight = tuple["asyncio.Task[tuple[Status | None, bool]]", httpx.AsyncClient]
_FLIGHTS: PerLoop[dict[str, _Flight]] = PerLoop(lambda loop: {})
"""The GET of each status URL in flight in this event loop, and the client it was sent on."""


async def _flight(
    client: httpx.AsyncClient, url: str, limit: float, reader: Reader
) -> tuple[Status | None, bool]:
    """The status, and whether the GET ran out of its ``limit`` (rather than failed)."""
    sent = clock.now()
    try:
        status = await fetch_status(client, url, limit=limit, reader=reader)
    except asyncio.CancelledError:  # (only at shut-down: nobody waits on a flight then)
        return None, False
    return status, status is None and clock.now() - sent >= limit - EARLY


_SENT_AT: PerLoop[dict[str, float]] = PerLoop(lambda loop: {})
"""When the GET in flight for each status URL was sent (:func:`clock.now`'s time)."""
_LAST_SENT: PerLoop[dict[str, float]] = PerLoop(lambda loop: {})
"""When the latest GET of each status URL was sent, in flight or landed."""


def _landed(flights: dict[str, _Flight], url: str, task: asyncio.Task[Any]) -> None:
    flight = flights.get(url)
    if flight is not None and flight[0] is task:
        del flights[url]
        _SENT_AT.get().pop(url, None)


async def end_flights(client: httpx.AsyncClient) -> None:
    """Cancel the status GETs in flight on ``client`` in this event loop and wait for them.

    Called before ``client`` closes: a GET joined by several callers goes on when its
    sender stops waiting, and one that outlived its client would leave the connection
    it opened to the garbage collector. A caller still waiting on it reads "unknown".
    """
    tasks = [t for t, used in _FLIGHTS.get().values() if used is client and not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)


def status_sent_at(url: str) -> float | None:
    """When the latest GET of ``url`` was sent in this event loop, whether it is still in
    flight or has landed (None: never)."""
    return _LAST_SENT.get().get(url)


def status_asked_at(url: str) -> float | None:
    """When the GET of ``url`` now in flight was sent (None: none is): a caller that
    joins it has waited for the status since then, not since it joined."""
    return _SENT_AT.get().get(url)


async def fetch_status_once(
    client: httpx.AsyncClient, url: str, *, limit: float, reader: Reader
) -> Status | None:
    """:func:`fetch_status`, with at most one GET of ``url`` in flight in this event loop.

    A caller that finds a GET of ``url`` in flight waits for its answer (within its own
    ``limit``) instead of sending another: a burst of requests that each want a fresh
    status (the poller's turn, every attempt's ``ask_first``, every stalled attempt's
    probe) sends one GET, not one each. The GET is read by the ``reader`` of the caller
    that sent it (one status URL is one backend's). A GET joined that ran out of its own
    (shorter) limit is followed by one of ours for the time we have left: a status that
    is late is late for our own limit, never "unknown" sooner.
    """
    end = clock.now() + limit
    flights = _FLIGHTS.get()
    while (left := end - clock.now()) > 0:
        flight = flights.get(url)
        if flight is None:
            task = asyncio.get_running_loop().create_task(
                _flight(client, url, left, reader), name="tierchain-status-get"
            )
            flights[url] = (task, client)  # (ended with the client: end_flights)
            _SENT_AT.get()[url] = _LAST_SENT.get()[url] = clock.now()
            task.add_done_callback(functools.partial(_landed, flights, url))
        else:
            task = flight[0]
        try:
            async with asyncio.timeout(left):
                status, timed_out = await asyncio.shield(task)
        except TimeoutError:
            return None
        if status is not None or not timed_out:
            return status
    return None


async def fetch_status(
    client: httpx.AsyncClient, url: str, *, limit: float, reader: Reader
) -> Status | None:
    """One GET of ``url`` within ``limit`` seconds, read by ``reader``.

    Any error, timeout, non-200 answer, compressed or oversized body, or body the reader
    does not know (or raises on) gives ``None``: unknown.
    """
    if limit <= 0:
        return None
    try:
        async with asyncio.timeout(limit):
            headers = {"accept": "*/*", "accept-encoding": "identity"}
            async with client.stream("GET", url, headers=headers) as response:
                if response.status_code != 200:
                    return None
                if response.headers.get("content-encoding", "identity").lower() != "identity":
                    # Asked for none: a compressed answer is not read (a gzip bomb inflates
                    # a whole raw chunk at once, past any bound on what it decodes to).
                    return None
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.aiter_raw():
                    size += len(chunk)
                    if size > MAX_STATUS_BYTES:
                        return None
                    chunks.append(chunk)
        body = b"".join(chunks)
    except (TimeoutError, httpx.HTTPError, OSError, ValueError):
        return None
    try:
        return reader(body)
    except Exception:  # a broken reader is an unknown answer, never a failed request
        return None
