"""SaturationWatchdog: a backend that accepts work and goes quiet is saturated.

It sits inside :class:`~tierchain.Failover` (one call per attempt), outside the
host handler, and bounds two waits, reading the attempt's
:class:`~tierchain.observer.Observer` (Failover's; alone, its own):

- the wait for the *first chunk*, ``slow_after`` (0: off). For an event stream
  that is the first complete event carrying ``data:``; a partial line,
  comments and pings are not progress and never restart the window. For
  anything else it is the first body bytes. A non-streaming completion sends
  nothing until it is complete, so there the window bounds the whole attempt,
  and ``slow_after`` must sit above the slowest legitimate completion on that
  route; inside a Failover such an answer is held until whole, so its first
  bytes do not end the window.
- the gap between data events once the stream has started, ``stall_after``
  (default ``"auto"``: on a tier with a later tier, each backend's own learned
  normal gap, at least ``stall_floor`` (2 s) and at most ``stall_ceiling``
  (120 s); until enough streams were seen, its regime's cold default (8 s for
  a local backend, 30 s otherwise); on the last tier ``stall_ceiling``;
  seconds: a fixed window; 0: off; a backend's own ``stall_after`` overrides it).
  A stream that is long is never cut; one that goes quiet for that long is
  ``stalled``: the attempt is cancelled (closing the upstream connection),
  the caller gets an error event, and the backend is charged a failure.
  Time spent waiting for the caller to take a chunk
  (``TierRequest.caller_blocked_since``: a caller that stopped reading) is not
  the upstream's silence: the gap is never judged while such a send is out, and
  is timed from when it came back at the earliest.

When the window expires on a tier that has a later tier behind it:

1. with no ``status_url`` the backend is saturated (the plain stopwatch);
2. with one, one GET asks it (bounded by ``probe_timeout`` and by the
   remaining budget): ``working`` extends the wait by one more window and
   emits ``still_working``; ``idle``, ``no_progress`` or ``queued`` (requests
   are waiting at the backend, so the progress it reports is someone else's)
   mean saturated; ``unknown`` is no evidence: at the first window it is the plain
   stopwatch, after a ``working`` answer the wait goes on (for ``progress_span`` at
   most) as that answer said.

Saturated means: the inner app is cancelled (so the upstream connection
closes) and :class:`~tierchain.errors.BackendSaturated` is raised for Failover
to record and advance; a Breaker wrapping this layer sees it pass.

Status-aware routing: a backend with a ``status_url`` is polled in the
background while traffic flows (every ``status_interval`` seconds, one poller
per status URL in the process, started on demand and stopped once idle; see
:mod:`tierchain.status`). When its latest status (no older than
``status_stale``) says it is full (``busy_waiting`` requests waiting, KV cache
at ``busy_kv_cache``, every slot busy) the attempt is skipped before anything
is sent, with :class:`~tierchain.errors.BackendBusy` and the reason. A stale,
slow or failing status never blocks: unknown means try it. The last tier is
never skipped.

The reserve: while a later tier exists and nothing is committed, no wait
before the first chunk (the window, every ``still_working`` extension, a held
answer's wait) runs past ``deadline - reserve``; ending there is a saturation
with reason ``reserve``. ``working`` is judged against the time left: a prompt
whose observed progress cannot finish in time, or a wait past
``normal_multiple`` times the learned normal, is ``too_slow``; no progress is
judged over ``progress_span``, not between two close probes.

The prompt rate: before any window, a streamed attempt with a later tier is judged
against its backend's normal prompt rate (learned, or its regime's default): past
``prompt_margin`` times the prompt's expected prefill with no first token it is
``too_slow``, whatever a status says (see :class:`~tierchain.learned.PromptRate`).

The last tier (or a request with no Failover) is never cut by the window: it
is recorded as slow and only the budget or the ceiling ends it. The ceiling
(``ceiling`` seconds after the attempt started, on the monotonic clock) is
never extended by any answer. A window that would end at or after the
request's budget is left to the Budget, so a spent budget is never mistaken
for a saturation.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any

import httpx
from opentelemetry import trace

from ._checks import count, duration
from ._responses import send_json_error
from ._runtime import clock, deadlines
from ._runtime.deadlines import EARLY, Deadline
from ._runtime.interrupt import Interruption
from ._types import ASGIApp, Message, Receive, Scope, Send
from .allowance import Allowance
from .decode import SPANS, DecodeWatch
from .errors import BackendBusy, BackendSaturated, BackendUnavailable, StreamError
from .learned import DecodeRate, Learned, LearnedGap, PromptRate, SharedNormals, cold
from .observer import Observer, nothing_sent, whole_events
from .probes import Reader, auto_reader, end_flights
from .progress import Progress, check_room
from .request import UNROUTED_KEY, Attempt, TierRequest
from .status import Fullness, StatusBoard
from .store import MemoryStore, NormalStore, Store, Suspect
from .telemetry import (
    ATTR_BACKEND,
    BACKEND_SATURATED,
    PROBE_ANSWERS,
    RESERVE_ENDED,
    SUSPECT_MARKS,
    labelled,
    log_event,
    tracing_enabled,
)
from .usage import read_usage
from .wire import recognise

__all__ = ["SaturationWatchdog", "SlowAfter", "window_warnings"]


def _prompt_rate(value: float | str | PromptRate, margin: float) -> PromptRate | None:
    """``prompt_rate``: ``"auto"`` (learned), a fixed rate in tokens/s, 0 (off), or one built."""
    if isinstance(value, PromptRate):
        return value
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"prompt_rate must be 'auto', tokens per second or 0, got {value!r}")
        return PromptRate(margin=margin)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"prompt_rate must be 'auto', tokens per second or 0, got {value!r}")
    return PromptRate(margin=margin, rate=float(value)) if value > 0 else None


def _decode_rate(
    value: float | str | DecodeRate, fraction: float, span: float | timedelta
) -> DecodeRate | None:
    """``decode_rate``: ``"auto"`` (learned), a fixed normal in tokens/s, 0 (off), or one built."""
    if isinstance(value, DecodeRate):
        return value
    seconds = duration("decode_span", span)
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"decode_rate must be 'auto', tokens per second or 0, got {value!r}")
        return DecodeRate(fraction=fraction, span=seconds)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"decode_rate must be 'auto', tokens per second or 0, got {value!r}")
    return DecodeRate(fraction=fraction, span=seconds, rate=float(value)) if value > 0 else None


_new = object.__new__
_BACKGROUND: set[asyncio.Task[None]] = set()  # store writes in flight (kept from the collector)
_SUSPECT_LEASE = 120.0  # the most one probe of a suspect backend holds its slot
_RESERVE_SHARE = 0.5  # a reserve never takes more than this share of the whole budget
_SILENT = 5.0  # a committed stream silent this long (or its stall window) when the budget ends it

SlowAfter = float | int | timedelta | Allowance | Callable[[bytes], float] | Learned | str
"""Seconds, a callable computing seconds from the request body (an :class:`Allowance`),
``"auto"`` or a :class:`~tierchain.learned.Learned`: each backend's own learned normal."""


class SaturationWatchdog:
    """Bound the wait for an attempt's first chunk; past it, the backend is saturated.

    It also ends a started stream that stalls, keeps time for the later tiers, and reads
    each backend's status URL to tell a working backend from a full or stuck one.
    ``slow_after`` takes seconds or a callable such as :class:`~tierchain.Allowance`.

    Options: [SaturationWatchdog options](watchdog.md#options).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        slow_after: SlowAfter = 0.0,
        ceiling: float | timedelta = 1800.0,
        probe_timeout: float | timedelta = 4.0,
        stall_after: float | timedelta | str | LearnedGap = "auto",
        stall_floor: float | timedelta = 2.0,
        stall_ceiling: float | timedelta = 120.0,
        reserve: float | timedelta | str = "auto",
        reserve_floor: float | timedelta = 5.0,
        progress_span: float | timedelta = 30.0,
        normal_multiple: float = 4.0,
        ask_first: float | timedelta = 0.1,
        readers: Mapping[str, Reader] | None = None,
        client: httpx.AsyncClient | None = None,
        status_interval: float | timedelta = 0.05,
        status_stale: float | timedelta = 0.2,
        busy_waiting: int = 5,
        busy_kv_cache: float = 0.8,
        busy_all_slots: bool = True,
        prompt_rate: float | str | PromptRate = "auto",
        prompt_margin: float = 2.0,
        status_late: float | timedelta = 0.25,
        status_board: StatusBoard | None = None,
        store: NormalStore | Store | None = None,
        suspect_for: float | timedelta = 10.0,
        decode_rate: float | str | DecodeRate = "auto",
        slow_decode: float = 0.25,
        decode_span: float | timedelta = 2.0,
    ) -> None:
        self.app = app
        self.decode = _decode_rate(decode_rate, slow_decode, decode_span)
        self.suspect_for = duration("suspect_for", suspect_for, allow_zero=True)
        # A store without normals (a Breaker's Store only): they are kept in this process.
        self.store: NormalStore = store if isinstance(store, NormalStore) else MemoryStore()
        # This process's own store (not a subclass): asked without a coroutine.
        self._memory = self.store if type(self.store) is MemoryStore else None
        self.prompt_rate = _prompt_rate(prompt_rate, prompt_margin)
        self.status_late = duration("status_late", status_late, allow_zero=True)
        self.learned: Learned | None = None
        if isinstance(slow_after, str) and slow_after == "auto":
            slow_after = Learned()
        if isinstance(slow_after, Learned):
            self.learned = slow_after
            self.slow_after: float | Callable[[bytes], float] = slow_after.maximum
            self.off = False
        elif callable(slow_after):
            self.slow_after = slow_after
            self.off = False
        else:
            self.slow_after = duration(
                "slow_after", slow_after, allow_zero=True, also="a callable, or 'auto'"
            )
            self.off = self.slow_after == 0
        self.ceiling = duration("ceiling", ceiling)
        self.probe_timeout = duration("probe_timeout", probe_timeout)
        self.learned_gap: LearnedGap | None = None
        if isinstance(stall_after, str) and stall_after == "auto":
            stall_after = LearnedGap(
                floor=duration("stall_floor", stall_floor),
                maximum=duration("stall_ceiling", stall_ceiling),
            )
        if isinstance(stall_after, LearnedGap):
            self.learned_gap = stall_after
            self.stall_after = stall_after.maximum
        else:
            self.stall_after = duration(
                "stall_after", stall_after, allow_zero=True, also="or 'auto'"
            )
        self.reserve_auto = reserve == "auto"
        self.reserve_floor = duration("reserve_floor", reserve_floor, allow_zero=True)
        self.reserve = (
            self.reserve_floor
            if self.reserve_auto
            else duration("reserve", reserve, allow_zero=True, also="or 'auto'")
        )
        self.progress_span = duration("progress_span", progress_span, allow_zero=True)
        if isinstance(normal_multiple, bool) or not (
            isinstance(normal_multiple, int | float)
            and math.isfinite(normal_multiple)
            and normal_multiple >= 1
        ):
            raise ValueError(f"normal_multiple must be a number >= 1, got {normal_multiple!r}")
        self.normal_multiple = float(normal_multiple)
        self.ask_first = duration("ask_first", ask_first, allow_zero=True)
        self.steps: dict[str, float] = {}  # per backend: the longest wait seen between two moves
        self.readers = dict(readers or {})
        for name, reader in self.readers.items():
            if not callable(reader):
                raise ValueError(f"the status reader for backend {name!r} is not callable")
        self._own_client = client is None
        self._client = client
        interval = duration("status_interval", status_interval, allow_zero=True)
        stale = duration("status_stale", status_stale)
        busy_waiting = count("busy_waiting", busy_waiting)
        if not (isinstance(busy_kv_cache, int | float) and 0 < busy_kv_cache <= 1):
            raise ValueError(f"busy_kv_cache must be a fraction in (0, 1], got {busy_kv_cache!r}")
        if status_board is not None and not isinstance(status_board, StatusBoard):
            raise ValueError(
                f"status_board must be a tierchain.status.StatusBoard, got {status_board!r}"
            )
        self.board: StatusBoard | None = status_board
        if status_board is None and interval > 0:
            self.board = StatusBoard(
                interval=interval,
                stale_after=stale,
                timeout=min(self.probe_timeout, max(stale, interval)),
                limits=Fullness(busy_waiting, float(busy_kv_cache), bool(busy_all_slots)),
            )
        parts: dict[str, Any] = {}
        if self.learned is not None:
            parts["first"] = self.learned
        if self.learned_gap is not None:
            parts["gap"] = self.learned_gap
        if self.decode is not None and self.decode.rate is None:
            parts["decode"] = self.decode
        if self.prompt_rate is not None and self.prompt_rate.rate is None:
            parts["rate"] = self.prompt_rate
        self.normals = SharedNormals(self.store, parts) if parts else None

    @property
    def client(self) -> httpx.AsyncClient:
        """The probe client, created on first use."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=None, follow_redirects=False, trust_env=False)
        return self._client

    async def aclose(self) -> None:
        """Stop the status pollers; close the probe client (if this watchdog created it);
        write the learned normals not yet written to the store."""
        if self.normals is not None:
            await self.normals.aclose()
        if self.board is not None:
            await self.board.aclose()
        client, self._client = self._client, None
        if client is not None:
            await end_flights(client)  # our status GETs (others may have joined them) end
            if self._own_client:
                await client.aclose()

    async def __aenter__(self) -> SaturationWatchdog:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def reader_for(self, backend: str) -> Reader:
        """The status reader used for ``backend``."""
        return self.readers.get(backend, auto_reader)

    def window(self, body: bytes | None) -> float:
        """The first window for a request with ``body`` (0: off), at most the ceiling."""
        if not callable(self.slow_after):
            return min(self.slow_after, self.ceiling)
        try:
            value = float(self.slow_after(body or b""))
        except Exception as exc:  # a broken allowance must not break a request
            log_event("watchdog.allowance_failed", level=logging.WARNING, error=repr(exc))
            return self.ceiling
        if not math.isfinite(value) or value <= 0:
            return self.ceiling if value == math.inf else 0.0
        return min(value, self.ceiling)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or UNROUTED_KEY in scope:
            if scope["type"] == "lifespan":
                return await self.app(scope, receive, self._lifespan_send(send))
            return await self.app(scope, receive, send)
        req = TierRequest.find(scope)
        attempt = req.attempt if req is not None else None
        passed: Suspect | None = None  # a suspect mark this attempt goes through (the probe)
        if attempt is not None:
            normals = self.normals
            if normals is not None:
                loading = normals.before(attempt.backend.name)
                if loading is not None:  # the first attempt at it in this process
                    await loading
            if self.suspect_for > 0 and not attempt.is_last:
                passed = await self._suspect(attempt)
        board_url = None
        if self.board is not None and attempt is not None and attempt.backend.status_url:
            board_url = attempt.backend.status_url
            if not attempt.is_last:
                room = check_room(self, attempt.backend.name, board_url)
                if room is not None:
                    await room
        watch = self._watch(req, attempt, send)
        # The attempt, in this frame (a waiting stream holds one frame of ours).
        try:
            if watch is None:
                await self.app(scope, receive, send)
                return
            # Told of the first chunk (one bound method, here: the finally removes the same).
            first_data = watch._first_data
            watch.observer.on_first_data.append(first_data)
            try:
                if watch.own:  # alone: judged by the request's own wire format
                    watch.observer.wire = recognise(scope.get("path", ""))
                await self.app(scope, receive, watch.send if watch.own else send)
            except asyncio.CancelledError:
                if not watch.cut.ours():
                    if watch.fired is None:
                        watch.cancelled()
                    raise
                await watch.verdict(send)
            except Exception as exc:
                if watch.fired is None:
                    watch.broke(exc)
                raise
            else:
                if watch.cut.interrupted and watch.cut.swallowed():  # the inner app returned anyway
                    await watch.verdict(send)
                else:
                    watch.learn()
                    if not watch.healthy and watch.fired is None:
                        watch.broke(None)  # (a break the handler left on the request)
            finally:
                # Over: stop timing. Our callback out of the observer, which outlives the
                # attempt (and a cycle between the two would wait for the garbage collector).
                try:
                    watch.observer.on_first_data.remove(first_data)
                except ValueError:
                    pass
                if watch._handle is not None:
                    deadlines.cancel(watch._handle)
                    watch._handle = None
                if watch._decode is not None:
                    watch._decode.cancel()
                    watch._decode = None  # (it holds the watch: no cycle outlives the attempt)
                prober = watch._prober
                if prober is not None:
                    prober.cancel()
                    await asyncio.wait([prober])
        finally:
            if board_url is not None and self.board is not None:
                self.board.outdated(board_url)  # the slot it showed busy may have been ours
                if watch is not None and watch.fired is not None and not watch.answered():
                    # Our own prefill was cut: the server finishes its prompt batch first.
                    self.board.cut(board_url, self.progress_span)
            if passed is not None and attempt is not None:
                # The probe of a suspect backend: its verdict (marked again) or health
                # (the mark dropped) decides; with neither, its slot is given back.
                self._passed(attempt.backend.name, watch)

    # -- suspect marks: one verdict spares the next caller -------------------------

    async def _suspect(self, attempt: Attempt) -> Suspect | None:
        """Skip a backend an earlier caller's attempt was judged on (``BackendBusy``), or
        return the mark this attempt passes as its one probe (None: not suspect)."""
        name = attempt.backend.name
        memory = self._memory
        try:
            if memory is not None:
                mark = memory.suspect_check_now(name, _SUSPECT_LEASE)
            else:
                mark = await self.store.suspect_check(name, _SUSPECT_LEASE)
        except Exception as exc:  # a store must never fail a request: not suspect
            log_event("watchdog.suspect_store_failed", level=logging.WARNING, error=repr(exc))
            return None
        if mark is None or mark.probe:
            if mark is not None:
                log_event("watchdog.suspect_probe", backend=name, why=mark.why)
            return mark
        why = f"suspect: {mark.why} on an earlier request, tried again in {mark.retry_in:.0f}s"
        raise BackendBusy(f"backend {name!r} is {why}", why=why)

    def mark_suspect(self, route: str, backend: str, why: str) -> None:
        """A verdict on ``backend`` (too slow, stalled, broke mid-stream): the callers after
        skip it for ``suspect_for`` seconds, then one probes it. Written to the store now,
        in the background for a remote one."""
        if self.suspect_for <= 0:
            return
        labelled(SUSPECT_MARKS, route, backend, why).inc()
        log_event("watchdog.backend_suspect", route=route, backend=backend, why=why)
        memory = self._memory
        if memory is not None:
            memory.suspect_mark_now(backend, why, self.suspect_for)
            return
        self._background(self.store.suspect_mark(backend, why, self.suspect_for))

    def _passed(self, backend: str, watch: _Watch | None) -> None:
        if watch is not None and watch.marked:
            return  # judged again: the mark is set anew (and its probe slot with it)
        healthy = watch is not None and watch.healthy
        memory = self._memory
        if memory is not None:
            memory.suspect_end_now(backend, healthy=healthy)
            return
        self._background(self.store.suspect_end(backend, healthy=healthy))

    def _background(self, call: Awaitable[Any]) -> None:
        """A store call nobody waits for (RedisStore finishes it even if the request ends)."""

        async def run() -> None:
            try:
                await call
            except Exception as exc:
                log_event("watchdog.suspect_store_failed", level=logging.WARNING, error=repr(exc))

        task = asyncio.ensure_future(run())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    def _watch(
        self, req: TierRequest | None, attempt: Attempt | None, send: Send | None = None
    ) -> _Watch | None:
        """The attempt's watch, or None when there is nothing to time. With ``send``, it
        starts timing the attempt (its task is the one the timer may interrupt) from
        whichever point comes first (the same delay for most attempts), or raises
        BackendBusy when the reserve's point has already passed."""
        learned = False
        body = req.body if req is not None else None
        ceiling = self.ceiling
        slow_after = self.slow_after
        if self.learned is not None and attempt is not None:
            window, learned = self.learned.window(attempt.backend.name, body)
            if ceiling < window:  # (min(), as a comparison: no call; so below)
                window = ceiling
        elif not callable(slow_after):
            window = ceiling if ceiling < slow_after else slow_after  # (0 when off)
        else:
            window = self.window(body)
        stall = self.stall_after
        prefill = math.inf
        first_token = False  # the backend's own first_token limit is the prefill's end
        reserve = 0.0
        last = True
        deadline = req.deadline if req is not None else None
        if attempt is not None:
            backend = attempt.backend
            last = attempt.n >= attempt.of
            if attempt.deadline is not None:
                deadline = attempt.deadline
            if backend.stall_after is not None:
                stall = backend.stall_after  # type: ignore[assignment]  # seconds once built
            elif self.learned_gap is not None and not last:
                # The backend's own rhythm where a later tier can take over (until learned,
                # its regime's cold default); the last tier has nothing to move on to, and
                # waits the ceiling (self.stall_after).
                stall = self.learned_gap.window_for(backend.name, backend.regime)[0]
            if not last and req is not None:
                if req.deadline is not None:
                    # The time this attempt leaves for the later tiers.
                    reserve = self.reserve
                    if (
                        self.reserve_auto
                        and self.learned is not None
                        and attempt.n < len(req.chain)
                    ):
                        later, learned_later = self.learned.window(req.chain[attempt.n].name, body)
                        if learned_later:
                            reserve = max(reserve, later)
                    if req.budget is not None and req.budget * _RESERVE_SHARE < reserve:
                        reserve = req.budget * _RESERVE_SHARE
                    attempt.reserve = reserve
                rate = self.prompt_rate
                # The first token's time at the backend's normal prompt rate (with the
                # margin), or the backend's own first_token limit, the smaller; not judged
                # for an answer that does not stream (its first bytes are the whole
                # answer) from a backend with no status URL to tell a prompt still read
                # from an answer written.
                if req.streaming is not False or backend.status_url:
                    if rate is not None:
                        prefill = rate.limit(backend.name, backend.regime, body)[0]
                    own = backend.first_token
                    if own is not None and own < prefill:  # type: ignore[operator]
                        prefill = own  # type: ignore[assignment]  # seconds once built
                        first_token = True
        if window <= 0 and stall <= 0 and reserve <= 0 and prefill == math.inf:
            return None
        watch = _new(_Watch)  # (no __init__: a frame less per attempt; its fields are set here)
        watch.watchdog = self
        watch.req = req
        watch.attempt = attempt
        watch.marked = watch.healthy = False
        watch.last = last
        watch.learned = learned
        watch.window = window
        watch.stall = stall
        watch.reserve = reserve
        shared = req.observer if req is not None and req.in_chain else None
        watch.own = shared is None
        watch.observer = shared if shared is not None else Observer()
        watch.start = start = clock.now()
        watch.fired = None
        ceiling_at = watch._ceiling_at = start + ceiling
        window_end = watch._window_end = start + window if window > 0 else math.inf
        prefill_end = watch._prefill_end = start + prefill
        watch._prompt_due = False
        watch._first_token = first_token
        cut = watch._cut = deadline - reserve if reserve > 0 and deadline is not None else math.inf
        watch._cut_passed = False
        watch._progress = None
        watch._slow_logged = False
        watch._decode = None
        watch._handle = None
        watch._prober = None
        if reserve > 0 and tracing_enabled():
            trace.get_current_span().set_attribute("tierchain.reserve_s", round(reserve, 3))
        if send is None:
            return watch
        if cut <= start:  # a later tier of a long chain, after the earlier ones took their time
            why = f"no time left for backend {watch.backend!r} before the reserve"
            raise BackendBusy(why, why="reserve")
        watch._send = send
        interruption = watch.cut = Interruption()
        interruption.arm()  # (the caller then adds watch._first_data to the observer)
        # watch._due(), inline (the one rule for which point comes first; `deadline` is
        # watch._deadline()): a frame less per attempt.
        due = ceiling_at if ceiling_at < cut else cut
        if prefill_end < due:
            due = prefill_end
        if window_end < due:
            due = window_end
        if due == math.inf or (deadline is not None and due >= deadline):
            return watch
        if due == window_end:
            delay = window
            # A computed window varies by request: not a recurring delay (a learned one
            # recurs: one of the sketch's bucket edges times the margin).
            fixed = not callable(slow_after)
        elif due == ceiling_at:
            delay, fixed = ceiling, True
        elif due == prefill_end and (first_token or self.prompt_rate is not None):
            delay = due - start  # (the watch starts as it is armed)
            fixed = first_token or (self.prompt_rate is not None and self.prompt_rate.recurs(delay))
        else:
            delay, fixed = max(0.0, due - clock.now()), False
        watch._handle = deadlines.schedule(  # watch._arm, inline
            delay, watch._expired, context=contextvars.copy_context(), fixed=fixed
        )
        return watch

    def _lifespan_send(self, send: Send) -> Send:
        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.aclose()
            await send(message)

        return lifespan_send


class _Watch:
    """One attempt under the watchdog: its timer, reading the attempt's observer.

    The waits are one deadline at a time in the loop's shared deadline queue,
    not a task: an attempt that answers in time costs one queue entry, and a
    streamed chunk costs the watchdog nothing. A task exists only while a
    status probe is out.

    Three points in time bound the wait for the first chunk: the window's end
    (extended by ``working`` answers), the ceiling (never extended) and the
    reserve's point (``deadline - reserve``: never extended, absent on the
    last tier). The timer is armed for the soonest.

    It has no ``__init__``: :meth:`SaturationWatchdog._watch` sets every field.
    """

    __slots__ = (
        "_ceiling_at",
        "_cut",
        "_cut_passed",
        "_decode",
        "_first_token",
        "_handle",
        "_prefill_end",
        "_prober",
        "_progress",
        "_prompt_due",
        "_send",
        "_slow_logged",
        "_window_end",
        "attempt",
        "cut",
        "fired",
        "healthy",
        "last",
        "learned",
        "marked",
        "observer",
        "own",
        "req",
        "reserve",
        "stall",
        "start",
        "watchdog",
        "window",
    )

    watchdog: SaturationWatchdog
    req: TierRequest | None
    attempt: Attempt | None
    last: bool
    learned: bool  # the window was learned (two saturations under it forget it)
    marked: bool  # this attempt's verdict marked its backend suspect
    healthy: bool  # it ended whole and taught the normals
    window: float
    stall: float
    reserve: float
    own: bool  # alone; inside a Failover a non-streaming answer is held until whole
    observer: Observer
    start: float
    fired: str | None
    _ceiling_at: float
    _window_end: float
    _prefill_end: float
    _prompt_due: bool
    _first_token: bool  # the prefill's end is the backend's own first_token limit
    _cut: float
    _cut_passed: bool  # a committed stream's reserve point passed (or cut it)
    _progress: Progress | None  # the status conversation, once asked
    _slow_logged: bool
    _decode: DecodeWatch | None  # a committed stream's decode rate, judged (with a later tier)
    _send: Send
    cut: Interruption
    _handle: Deadline | None
    _prober: asyncio.Task[None] | None

    @property
    def backend(self) -> str | None:
        return self.attempt.backend.name if self.attempt is not None else None

    @property
    def route(self) -> str:
        return (self.attempt.route if self.attempt is not None else None) or ""

    # -- the attempt -------------------------------------------------------

    def learn(self) -> None:
        """A successful attempt teaches the learned normals: its time to first data
        (a held answer: to the whole answer) and its stream's mean gap."""
        observer = self.observer
        first_at = observer.first_data_at
        attempt = self.attempt
        req = self.req
        status = observer.status
        if (
            attempt is None
            or first_at is None
            or (req is not None and req.attempt_error is not None)
            # observer.verdict() != "ok", inline (every attempt asks)
            or status is None
            or status >= 400
            or not observer.complete
        ):
            return
        name = attempt.backend.name
        self.healthy = True
        watchdog = self.watchdog
        body = req.body if req is not None else None
        learned = watchdog.learned
        if learned is not None:
            end = first_at if observer.framed or self.own else clock.now()
            learned.observe(name, body, end - self.start)
        rate = watchdog.prompt_rate
        if rate is not None:
            if rate.calibrating(name):  # the bytes per token its answers report
                rate.calibrate(name, body, read_usage(observer.wire, observer.tail_values())[0])
            if observer.framed:  # a first token's own time
                rate.observe(name, body, first_at - self.start)
        gaps = watchdog.learned_gap
        events = observer.data_events
        if gaps is not None and events > 2 and (observer.sse or observer.ndjson):
            last = observer.last_event_at or first_at
            gaps.observe(name, None, (last - first_at) / (events - 1))
        decode = watchdog.decode
        if decode is not None and (observer.sse or observer.ndjson):
            decode.observe(name, events, (observer.last_event_at or first_at) - first_at)
        if watchdog.normals is not None:
            watchdog.normals.taught(name)

    def suspect(self, why: str) -> None:
        """This attempt's verdict: its backend is suspect for the callers after (once)."""
        if self.attempt is None or self.marked:
            return
        self.marked = True
        self.watchdog.mark_suspect(self.route, self.attempt.backend.name, why)

    def broke(self, exc: BaseException | None) -> None:
        """The attempt ended in an error we did not cut: a stream that had reached the
        caller and broke (not the gateway's nor the caller's doing) makes it suspect."""
        req = self.req
        observer = self.observer
        if req is None or not req.committed or observer.reached_end():
            return
        cause = req.attempt_error if req.attempt_error is not None else exc
        if isinstance(cause, StreamError) or (
            isinstance(cause, BackendUnavailable) and not cause.gateway_fault
        ):
            self.suspect("broke_mid_stream")

    def cancelled(self) -> None:
        """Someone else cancelled the attempt (the budget, the caller): was it a stall?

        A committed stream that has been silent for its stall window (or
        ``_SILENT`` seconds, if shorter) when the budget ends it stalled: that
        is the backend's fault, and left as the attempt's error for the Breaker.
        Not while a send to the caller is out: then the caller was not reading,
        and the silence was ours.
        """
        req = self.req
        observer = self.observer
        error = req.attempt_error if req is not None else None
        if isinstance(error, BackendSaturated) and error.why == "hedge_lost":
            # The hedge on the next tier answered first: no first chunk in that time.
            self.suspect("hedge_lost")
            return
        if (
            req is None
            or req.cancel_reason != "budget_exhausted"
            or not req.committed
            or observer.first_data_at is None
            or observer.ended
            or self.stall <= 0
            or req.caller_blocked_since is not None  # the caller's backpressure, not a stall
        ):
            return
        gap = clock.now() - self._quiet_since()
        if gap < min(self.stall, _SILENT):
            return
        self._log_stall(gap)
        req.attempt_error = StreamError(
            f"backend {self.backend!r} sent no data event for {gap:.1f}s when the budget ended",
            reason="stalled",
        )
        self.suspect("stalled")

    def send(self, message: Message) -> Awaitable[None]:
        """Alone: feed the watchdog's own observer and pass on whole events."""
        observer = self.observer
        kind = message["type"]
        if kind == "http.response.body":
            if observer.sse:
                out = whole_events(observer, message)
                return self._send(out) if out is not None else nothing_sent()
            observer.body(message.get("body", b""))
            if not message.get("more_body", False):
                observer.end()
        elif kind == "http.response.start":
            observer.start(int(message["status"]), list(message.get("headers", ())))
        return self._send(message)

    def _first_data(self) -> None:
        """The first chunk arrived: the window is over; time the gaps (and, with a later
        tier, the decode rate) from here."""
        if not self.own and not self.observer.framed:
            return  # a held answer's first bytes: its window runs on until it is whole
        decode = self.watchdog.decode
        if decode is not None and not self.last and self.attempt is not None:
            backend = self.attempt.backend
            limit, learned = decode.limit(backend.name, backend.regime)
            self._decode = DecodeWatch(self, limit, learned, decode.span)
        handle = self._handle
        cut = self._cut
        stall = self.stall
        now = clock.now()
        if cut < math.inf and not self._cut_passed and (stall <= 0 or cut < now + stall):
            # The reserve's point comes before the first stall window ends: a committed
            # stream that could be continued on the next tier is cut there (_expired).
            # (Otherwise the stall timer comes first, and the cut is timed from it.)
            if handle is not None:
                if deadlines.due(handle) <= cut:
                    return  # the window's timer comes first; _expired times the rest from it
                deadlines.cancel(handle)
                self._handle = None
            if self.fired is None:
                self._schedule()
            return
        if handle is not None:
            if stall > 0 and deadlines.due(handle) <= now + stall:
                return  # the window's timer comes first; it times the gap from there
            deadlines.cancel(handle)
            self._handle = None
        if stall > 0 and self.fired is None:
            self._handle = deadlines.schedule(  # self._arm, inline
                stall, self._expired, context=contextvars.copy_context()
            )

    def answered(self) -> bool:
        """True once the first chunk has arrived (for a held answer: all of it, or
        so much that Failover sent it on)."""
        observer = self.observer
        if observer.first_data_at is None:
            return False
        if observer.framed or self.own:
            return True
        return observer.ended or (self.req is not None and self.req.committed)

    # -- the timer ---------------------------------------------------------

    def _deadline(self) -> float | None:
        if self.attempt is not None and self.attempt.deadline is not None:
            return self.attempt.deadline
        return self.req.deadline if self.req is not None else None

    def _due(self, *, window: bool = True) -> float:
        """When the wait for the first chunk must next be looked at: the first of the
        window's end (unless ``window`` is False: a probe is out), the expected prefill,
        the reserve's point and the ceiling. math.inf when nothing bounds it, or when the
        request's deadline comes first: the budget ends this attempt then, a deadline,
        not a saturation."""
        due = min(self._ceiling_at, self._cut, self._prefill_end)
        if window and self._window_end < due:
            due = self._window_end
        deadline = self._deadline()
        if deadline is not None and due >= deadline:
            return math.inf
        return due

    def _end(self) -> float:
        """The latest this attempt may wait, whatever a status says: the first of the
        reserve's point, the ceiling and the request's deadline (math.inf: none)."""
        deadline = self._deadline()
        end = min(self._cut, self._ceiling_at)
        return end if deadline is None or end <= deadline else deadline

    def _schedule(self) -> None:
        """Arm the timer for the next thing that may fall due."""
        observer = self.observer
        if self.answered():
            if observer.ended:
                return
            due = self._quiet_since() + self.stall if self.stall > 0 else math.inf
            if not self._cut_passed:
                due = min(due, self._cut)
        else:
            due = self._due()
        if due == math.inf:
            return
        self._arm(max(0.0, due - clock.now()), fixed=False)

    def _quiet_since(self) -> float:
        """Since when the upstream has sent nothing that we read: its last data event,
        or the moment the caller took our last send back if that came later (while a
        send to the caller is out, nothing is read from the upstream)."""
        observer = self.observer
        last = observer.last_event_at or observer.first_data_at or self.start
        req = self.req
        if req is not None and req.caller_unblocked_at > last:
            return req.caller_unblocked_at
        return last

    def _arm(self, delay: float, *, fixed: bool) -> None:
        # Our callbacks log, emit and may start a probe: in the request's context.
        self._handle = deadlines.schedule(
            delay, self._expired, context=contextvars.copy_context(), fixed=fixed
        )

    def _expired(self) -> None:
        self._handle = None
        if self.fired is not None:
            return
        now = clock.now()
        observer = self.observer
        if self.answered():
            req = self.req
            if not self._cut_passed and now >= self._cut - EARLY:
                self._cut_passed = True
                if (
                    req is not None
                    and req.committed
                    and req.continuable
                    and req.caller_blocked_since is None  # (not reading: the caller's time)
                    and not observer.ended
                ):
                    # The reserve's point: the next tier finishes the answer (Failover).
                    self._fire("reserve")
                    return
            if req is not None and req.caller_blocked_since is not None and not observer.ended:
                # The caller is not reading, so neither are we: the upstream's silence
                # is not its own (Failover's send_timeout judges the caller). Look again
                # one stall window later.
                self._arm(self.stall or _SILENT, fixed=True)
                return
            last = self._quiet_since()
            if self.stall > 0 and not observer.ended and now >= last + self.stall - EARLY:
                self._log_stall(now - last)
                self._fire("stalled")
            else:
                self._schedule()  # data arrived since: wait for the new gap
            return
        if now >= self._ceiling_at - EARLY:
            self._fire("ceiling")
            return
        if now >= self._cut - EARLY:
            self._fire("reserve")
            return
        if now >= self._prefill_end - EARLY:
            if self.req is None or self.req.streaming is not False:
                # The expected prefill at the backend's normal prompt rate (or its own
                # first_token limit) is over, with no first token: too slow, whatever a
                # status says.
                if self.attempt is not None:
                    self.attempt.verdict = "too_slow"
                self._fire("first_token" if self._first_token else "too_slow")
                return
            # A held answer has no first token to wait for: its status says whether a
            # slot still reads a prompt (too slow) or the answer is being written.
            self._prefill_end = math.inf
            self._prompt_due = True
            if self._prober is None or self._prober.done():
                self._prober = asyncio.create_task(
                    self._ask(now, window=False), name="tierchain-watchdog-probe"
                )
            self._schedule_probe_out(now)
            return
        if self._prober is not None and not self._prober.done():
            self._schedule_probe_out(now)
            return
        if now < self._window_end - EARLY:
            self._schedule()
            return
        if self.last:
            if not self._slow_logged:
                self._slow_logged = True
                self._slow(now)
            self._window_end = self._ceiling_at
            self._schedule()
            return
        backend = self.attempt.backend if self.attempt is not None else None
        if backend is None or backend.status_url is None:
            self._fire("no_first_chunk" if observer.first_data_at is None else "incomplete")
            return
        self._prober = asyncio.create_task(self._ask(now), name="tierchain-watchdog-probe")
        self._schedule_probe_out(now)

    def _schedule_probe_out(self, now: float) -> None:
        # A starved server answers its status slowly too: the reserve's point, the
        # ceiling and the expected prefill stay on the timer while the probe is out.
        due = self._due(window=False)
        if due != math.inf:
            self._arm(max(0.0, due - now), fixed=False)

    def _log_stall(self, gap: float) -> None:
        log_event(
            "dispatch.backend_stalled",
            level=logging.WARNING,
            route=self.route,
            backend=self.backend,
            idle_s=round(gap, 3),
            stall_after_s=self.stall,
        )
        trace.get_current_span().add_event(
            "tierchain.backend_stalled", {ATTR_BACKEND: self.backend or "", "idle_s": gap}
        )

    async def _ask(self, now: float, *, window: bool = True) -> None:
        """Ask the backend whether it is still working; extend, or call it saturated.
        ``window``: asked at a window's end (a ``working`` answer extends it by one)."""
        assert self.attempt is not None
        backend = self.attempt.backend
        assert backend.status_url is not None
        progress = self._progress
        if progress is None:
            body = self.req.body if self.req is not None else None
            progress = self._progress = Progress(
                self.watchdog, backend, self.route, body, self.start
            )
        deadline = self._deadline()
        status = await progress.probe(min(self.watchdog.probe_timeout, self._end() - now))
        now = clock.now()
        if status is None and (self.fired is not None or now >= self._cut - EARLY):
            # Cut short at the reserve's point (a starved server answers its status
            # slowly too): no answer, so no verdict; the reserve ends the attempt.
            if self.fired is None and not self.answered():
                self._fire("reserve")
            return
        streaming = self.req is None or self.req.streaming is not False
        prompt_due, self._prompt_due = self._prompt_due, False
        verdict, self._prefill_end = progress.verdict(
            status, now, self._end(), self._prefill_end, streaming=streaming, prompt_due=prompt_due
        )
        labelled(PROBE_ANSWERS, backend.name, verdict).inc()
        self.attempt.verdict = verdict
        if self.fired is not None or self.answered():
            return  # the reserve or the ceiling fell due, or the first chunk arrived
        if deadline is not None and now >= deadline:
            return
        if self._handle is not None:  # the reserve's or the ceiling's timer
            deadlines.cancel(self._handle)
            self._handle = None
        if verdict == "unknown" and (not window or progress.unknown_holds(now)):
            # No answer is not evidence. At the expected prefill of an answer that does
            # not stream, the plain stopwatch does not judge (the window goes on); after
            # a ``working`` answer, the wait goes on as that answer said (one more window).
            if window:
                self._window_end += self.window
            self._schedule()
            return
        if verdict == "working":
            assert status is not None
            progress.working(status)
            if window:
                self._window_end += self.window
            elapsed = round(now - self.start, 1)
            log_event(
                "dispatch.backend_still_working",
                route=self.route,
                backend=backend.name,
                elapsed_s=elapsed,
                detail=status.detail,
                reserve_s=round(self.reserve, 3) if self.reserve else None,
            )
            if self.req is not None:
                pool = {"pool": backend.pool} if backend.pool is not None else {}
                self.req.emit("still_working", backend=backend.name, **pool, elapsed_s=elapsed)
            self._schedule()
            return
        self._fire("probe_unknown" if verdict == "unknown" else verdict)

    def starved(self, decode: DecodeWatch) -> None:
        """A committed stream's decode rate fell below its limit (:mod:`tierchain.decode`)."""
        self._fire("slow_decode")

    def _fire(self, reason: str) -> None:
        self.fired = reason
        self.cut.interrupt(f"tierchain: backend saturated ({reason})")

    def _slow(self, now: float) -> None:
        waited = round(now - self.start, 1)
        log_event(
            "dispatch.backend_slow",
            level=logging.WARNING,
            route=self.route,
            backend=self.backend,
            waited_s=waited,
            window_s=self.window,
            last_tier=True,
        )
        trace.get_current_span().add_event(
            "tierchain.backend_slow", {ATTR_BACKEND: self.backend or "", "waited_s": waited}
        )
        if self.req is not None and self.attempt is not None:
            backend = self.attempt.backend
            named: dict[str, Any] = {"backend": backend.name}
            if backend.pool is not None:
                named["pool"] = backend.pool
            self.req.emit("backend_slow", **named, waited_s=waited, failing_over=False)

    # -- the verdict -------------------------------------------------------

    async def verdict(self, send: Send) -> None:
        """Our cancellation landed: say why, as an exception or (alone) an answer."""
        if self.fired == "stalled":
            self.suspect("stalled")
            message = f"backend {self.backend!r} sent no data event for {self.stall:g}s"
            if self.own and self.attempt is None and self.observer.framed:
                self.observer.drop_pending()
                await send(
                    {
                        "type": "http.response.body",
                        "body": self.observer.error_bytes(message, "upstream_error", "stalled")
                        or b"",
                        "more_body": False,
                    }
                )
                return
            raise StreamError(message, reason="stalled")
        if self.fired == "slow_decode" and self._decode is not None:
            self._starved(self._decode)  # raises
        if self.fired == "reserve" and self.answered() and self.attempt is not None:
            # A committed stream cut at the reserve's point for the next tier to finish:
            # the budget's doing, not the backend's (no breaker counts it).
            raise BackendUnavailable(
                f"backend {self.backend!r} was still streaming {self.reserve:g}s before the "
                "budget ends (the reserve kept for the next tier)",
                reason="reserve",
                gateway_fault=True,
            )
        if not self.answered():
            await self._saturated(send)

    def _starved(self, decode: DecodeWatch) -> None:
        """Say that a committed stream was starved, and raise for Failover to continue it
        on the next tier (a saturation: the Breaker counts it as one)."""
        backend = self.backend or ""
        rate, limit = round(decode.rate, 2), round(decode.limit, 2)
        labelled(BACKEND_SATURATED, self.route, backend).inc()
        log_event(
            "dispatch.backend_starved",
            level=logging.WARNING,
            route=self.route,
            backend=backend,
            tokens_per_s=rate,
            limit_tokens_per_s=limit,
            learned=decode.learned,
            span_s=decode.span,
        )
        trace.get_current_span().add_event(
            "tierchain.backend_starved", {ATTR_BACKEND: backend, "tokens_per_s": rate}
        )
        if self.req is not None and self.attempt is not None:
            named: dict[str, Any] = {"backend": backend}
            if self.attempt.backend.pool is not None:
                named["pool"] = self.attempt.backend.pool
            self.req.emit(
                "backend_starved",
                **named,
                reason="slow_decode",
                tokens_per_s=rate,
                limit_tokens_per_s=limit,
                failing_over=True,
            )
        self.suspect("slow_decode")
        raise BackendSaturated(
            f"backend {backend!r} wrote {rate:g} tokens/s over {SPANS} spans of "
            f"{decode.span:g}s, under its limit of {limit:g} (starved)",
            waited=clock.now() - self.start,
            why="slow_decode",
        )

    async def _saturated(self, send: Send) -> None:
        waited = clock.now() - self.start
        reason = self.fired or "no_first_chunk"
        backend = self.backend or ""
        labelled(BACKEND_SATURATED, self.route, backend).inc()
        if reason == "reserve":
            labelled(RESERVE_ENDED, self.route, backend).inc()
        verdict = self.attempt.verdict if self.attempt is not None else None
        log_event(
            "dispatch.backend_saturated",
            level=logging.WARNING,
            route=self.route,
            backend=backend,
            waited_s=round(waited, 3),
            reason=reason,
            failing_over=not self.last,
            n=self.attempt.n if self.attempt is not None else None,
            of=self.attempt.of if self.attempt is not None else None,
            reserve_s=round(self.reserve, 3) if self.reserve else None,
            verdict=verdict,
        )
        span = trace.get_current_span()
        span.add_event(
            "tierchain.backend_saturated",
            {ATTR_BACKEND: backend, "reason": reason, "waited_s": round(waited, 3)},
        )
        span.set_attribute("tierchain.saturated_reason", reason)
        if verdict is not None:
            span.set_attribute("tierchain.verdict", verdict)
        learned = self.watchdog.learned
        if learned is not None and self.backend is not None and reason != "reserve":
            learned.saturated(self.backend, self.req.body if self.req else None, self.learned)
        self.suspect(reason)
        what = "no first chunk" if self.observer.first_data_at is None else "no whole answer"
        message = f"backend {backend!r} produced {what} in {waited:.1f}s ({reason})"
        if self.attempt is not None:
            raise BackendSaturated(message, waited=waited, why=reason)
        # Alone (no Failover): only the ceiling ends an attempt; answer it ourselves.
        observer = self.observer
        if observer.status is None:
            await send_json_error(send, 504, message, "backend_saturated", reason)
        elif observer.framed:
            observer.drop_pending()
            await send(
                {
                    "type": "http.response.body",
                    "body": observer.error_bytes(message, "backend_saturated", reason) or b"",
                    "more_body": False,
                }
            )
        else:
            raise BackendSaturated(message, waited=waited, why=reason)


def window_warnings(
    watchdog: SaturationWatchdog | None,
    chains: Mapping[str, Any],
    budget: float | None,
) -> list[str]:
    """What ``tierchain check-config`` warns about the first-chunk windows.

    ``chains`` maps each route to its chain; ``budget`` is the default budget
    in seconds (None: none). A chain with a later tier and ``slow_after`` off
    waits for a quiet first tier until the reserve ends it; a window longer
    than the budget minus the reserve is always ended by the reserve instead.
    """
    later = sorted(route for route, chain in chains.items() if len(chain) > 1)
    if not later:
        return []
    warnings: list[str] = []
    if watchdog is None:
        return [
            "SaturationWatchdog is not in the stack: a quiet first tier on route(s) "
            f"{', '.join(map(repr, later))} is waited on until the budget ends the request"
        ]
    rate = watchdog.prompt_rate
    if rate is None:
        warnings.append(
            f"prompt_rate is off (0) while route(s) {', '.join(map(repr, later))} have a later "
            "tier: a working status keeps a starved first tier until its window, the reserve "
            "or the ceiling ends it; set prompt_rate='auto' (TIERCHAIN_WATCHDOG_PROMPT_RATE=auto)"
        )
    if watchdog.off and watchdog.learned is None and rate is None:
        warnings.append(
            f"slow_after is off (0) while route(s) {', '.join(map(repr, later))} have a later "
            "tier: a quiet first tier is waited on until the reserve (or, without a budget, "
            "the ceiling) ends it; set slow_after (TIERCHAIN_SLOW_AFTER=auto)"
        )
    if rate is not None and rate.rate is None:
        unmarked = sorted(
            {
                str(getattr(chain[0], "name", chain[0]))
                for route, chain in chains.items()
                if route in later and getattr(chain[0], "regime", "local") in (None, "")
            }
        )
        if unmarked:
            least = rate.limit("", None, b"")[0]
            stall = cold(None).stall, cold("local").stall
            warnings.append(
                f"first tier(s) {', '.join(map(repr, unmarked))} have no regime: a quiet one is "
                f"waited on for {least:g}s at least before anything is learned (local: "
                f"{rate.limit('', 'local', b'')[0]:g}s), and a stream that goes quiet for "
                f'{stall[0]:g}s (local: {stall[1]:g}s); set regime = "local" on a local '
                "server's backend"
            )
    if budget is not None:
        reserve = min(watchdog.reserve, budget * _RESERVE_SHARE)
        if watchdog.learned is not None:
            window, what = watchdog.learned.maximum, "slow_after=auto's window until learned"
        else:
            window, what = watchdog.window(b""), "slow_after's smallest window"
        if window > budget - reserve and not watchdog.off:
            ends = "the prompt rate or the reserve" if rate is not None else "the reserve"
            warnings.append(
                f"{what} ({window:g}s) is longer than the budget minus the reserve "
                f"({budget:g}s - {reserve:g}s): {ends}, not the window, ends a quiet "
                f"first tier's attempt; set slow_after below {budget - reserve:g}s "
                f"(TIERCHAIN_SLOW_AFTER=auto, or a number of seconds), or the budget above "
                f"{window + reserve:g}s (TIERCHAIN_BUDGET_DEFAULT)"
            )
    return warnings
