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
  the caller gets an error event, and the backend is charged a failure. Time
  spent waiting for the caller to take a chunk (``TierRequest.caller_blocked_since``:
  a caller that stopped reading) is not the upstream's silence: the gap is never
  judged while such a send is out, and is timed from when it came back at the earliest.

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
import logging
import math
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import httpx

from ._checks import count, duration
from ._connections import trust_store
from ._types import ASGIApp, Message, Receive, Scope, Send
from .allowance import Allowance
from .learned import Cold, DecodeRate, Learned, LearnedGap, PromptRate, SharedNormals, cold
from .probes import Reader, auto_reader, end_flights
from .progress import check_room
from .request import UNROUTED_KEY, Attempt, TierRequest
from .status import Fullness, StatusBoard
from .store import MemoryStore, NormalStore, Store, Suspect
from .suspect_marks import SuspectMarks
from .telemetry import log_event
from .verdicts import verdict
from .watch import Watch
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


def _first_window(
    slow_after: SlowAfter,
) -> tuple[Learned | None, float | Callable[[bytes], float], bool]:
    """``slow_after``: the learned normal (or None), the window (seconds, or a callable of
    the body; a learned one's ``maximum``), and whether it is off."""
    if isinstance(slow_after, str) and slow_after == "auto":
        slow_after = Learned()
    if isinstance(slow_after, Learned):
        return slow_after, slow_after.maximum, False
    if callable(slow_after):
        return None, slow_after, False
    seconds = duration("slow_after", slow_after, allow_zero=True, also="a callable, or 'auto'")
    return None, seconds, seconds == 0


def _stall_window(
    stall_after: float | timedelta | str | LearnedGap,
    floor: float | timedelta,
    ceiling: float | timedelta,
) -> tuple[LearnedGap | None, float]:
    """``stall_after``: the learned gap (or None), and the window (a learned one's ``maximum``)."""
    if isinstance(stall_after, str) and stall_after == "auto":
        stall_after = LearnedGap(
            floor=duration("stall_floor", floor), maximum=duration("stall_ceiling", ceiling)
        )
    if isinstance(stall_after, LearnedGap):
        return stall_after, stall_after.maximum
    return None, duration("stall_after", stall_after, allow_zero=True, also="or 'auto'")


def _multiple(value: float) -> float:
    if isinstance(value, bool) or not (
        isinstance(value, int | float) and math.isfinite(value) and value >= 1
    ):
        raise ValueError(f"normal_multiple must be a number >= 1, got {value!r}")
    return float(value)


def _readers(readers: Mapping[str, Reader] | None) -> dict[str, Reader]:
    chosen = dict(readers or {})
    for name, reader in chosen.items():
        if not callable(reader):
            raise ValueError(f"the status reader for backend {name!r} is not callable")
    return chosen


def _board(
    board: StatusBoard | None,
    interval: float | timedelta,
    stale: float | timedelta,
    probe_timeout: float,
    limits: tuple[int, float, bool],
) -> StatusBoard | None:
    """The status board: the one given (a Breaker's or a Failover's, shared), else one of
    the watchdog's own (None when polling is off, ``status_interval=0``)."""
    interval = duration("status_interval", interval, allow_zero=True)
    stale = duration("status_stale", stale)
    waiting, kv_cache, all_slots = limits
    waiting = count("busy_waiting", waiting)
    if not (isinstance(kv_cache, int | float) and 0 < kv_cache <= 1):
        raise ValueError(f"busy_kv_cache must be a fraction in (0, 1], got {kv_cache!r}")
    if board is not None and not isinstance(board, StatusBoard):
        raise ValueError(f"status_board must be a tierchain.status.StatusBoard, got {board!r}")
    if board is not None or interval <= 0:
        return board
    return StatusBoard(
        interval=interval,
        stale_after=stale,
        timeout=min(probe_timeout, max(stale, interval)),
        limits=Fullness(waiting, float(kv_cache), bool(all_slots)),
    )


_RESERVE_SHARE = 0.5  # a reserve never takes more than this share of the whole budget

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
        self.ceiling = duration("ceiling", ceiling)
        self.probe_timeout = duration("probe_timeout", probe_timeout)
        self.learned, self.slow_after, self.off = _first_window(slow_after)
        self.learned_gap, self.stall_after = _stall_window(stall_after, stall_floor, stall_ceiling)
        self.reserve_auto = reserve == "auto"
        self.reserve_floor = duration("reserve_floor", reserve_floor, allow_zero=True)
        self.reserve = (
            self.reserve_floor
            if self.reserve_auto
            else duration("reserve", reserve, allow_zero=True, also="or 'auto'")
        )
        self.progress_span = duration("progress_span", progress_span, allow_zero=True)
        self.normal_multiple = _multiple(normal_multiple)
        self.ask_first = duration("ask_first", ask_first, allow_zero=True)
        self.steps: dict[str, float] = {}  # per backend: the longest wait seen between two moves
        self.readers = _readers(readers)
        self._own_client = client is None
        self._client = client
        self.board = _board(
            status_board,
            status_interval,
            status_stale,
            self.probe_timeout,
            (busy_waiting, busy_kv_cache, busy_all_slots),
        )
        self.prompt_rate = _prompt_rate(prompt_rate, prompt_margin)
        self.status_late = duration("status_late", status_late, allow_zero=True)
        self.decode = _decode_rate(decode_rate, slow_decode, decode_span)
        self.suspect_for = duration("suspect_for", suspect_for, allow_zero=True)
        # No store, or one without normals (a Breaker's Store only): a MemoryStore of our own.
        self.store: NormalStore = store if isinstance(store, NormalStore) else MemoryStore()
        self.suspects = SuspectMarks(self.store, self.suspect_for)
        self.normals = self._shared_normals() if self.store is store else None
        self._colds: dict[str | None, Cold] = {}  # per regime: cold(regime), found once

    def _shared_normals(self) -> SharedNormals | None:
        """``normals``: the learned values in step with the store given; None if nothing is
        learned or no store was given (then in the process alone; its readers check None)."""
        parts: dict[str, Any] = {}
        if self.learned is not None:
            parts["first"] = self.learned
        if self.learned_gap is not None:
            parts["gap"] = self.learned_gap
        if self.decode is not None and self.decode.rate is None:
            parts["decode"] = self.decode
        if self.prompt_rate is not None and self.prompt_rate.rate is None:
            parts["rate"] = self.prompt_rate
        return SharedNormals(self.store, parts) if parts else None

    @property
    def client(self) -> httpx.AsyncClient:
        """The probe client, created on first use."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=None, follow_redirects=False, trust_env=False, verify=trust_store()
            )
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
            return self.ceiling if self.ceiling < self.slow_after else self.slow_after  # min()
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
        last = attempt is None or attempt.is_last
        if attempt is not None:
            loading = self.normals.before(attempt.backend.name) if self.normals else None
            if loading is not None:  # the first attempt at its backend in this process
                await loading
            if self.suspect_for > 0 and not last:
                suspects = self.suspects
                passed = (
                    suspects.check_now(attempt) if suspects.local else await suspects.check(attempt)
                )
        board_url = None
        if self.board is not None and attempt is not None and attempt.backend.status_url:
            board_url = attempt.backend.status_url
            if not last:
                room = check_room(self, attempt.backend.name, board_url)
                if room is not None:
                    await room
        watch = self._watch(req, attempt, send, last=last)
        # The attempt, in this frame (a waiting stream holds one frame of ours).
        try:
            if watch is None:
                await self.app(scope, receive, send)
                return
            # Told of the first chunk (one bound method, here: the finally removes the same).
            first_data = watch.first_data
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
                await verdict(watch, send)
            except Exception as exc:
                if watch.fired is None:
                    watch.broke(exc)
                raise
            else:
                if watch.cut.interrupted and watch.cut.swallowed():  # the inner app returned anyway
                    await verdict(watch, send)
                else:
                    watch.learn()
                    if not watch.healthy and watch.fired is None:
                        watch.broke(None)  # (a break the handler left on the request)
            finally:
                # Over: our callback out of the observer, which outlives the attempt (and
                # a cycle between the two would wait for the garbage collector); no timer.
                try:
                    watch.observer.on_first_data.remove(first_data)
                except ValueError:
                    pass
                ending = watch.end()
                if ending is not None:
                    await ending
        finally:
            if board_url is not None:
                self._board_after(board_url, watch)
            if passed is not None and attempt is not None:
                # The probe of a suspect backend: its verdict (marked again) or health
                # (the mark dropped) decides; with neither, its slot is given back.
                marked, healthy = (watch.marked, watch.healthy) if watch else (False, False)
                self.suspects.passed(attempt.backend.name, marked=marked, healthy=healthy)

    def _board_after(self, url: str, watch: Watch | None) -> None:
        """The polled status after an attempt: outdated (its busy slot may have been ours);
        busy while a prefill we cut ends (the server finishes its prompt batch first)."""
        assert self.board is not None
        self.board.outdated(url)
        if watch is not None and watch.fired is not None and not watch.answered():
            self.board.cut(url, self.progress_span)

    # -- one attempt's watch --------------------------------------------------------

    def _watch(
        self,
        req: TierRequest | None,
        attempt: Attempt | None,
        send: Send | None = None,
        *,
        last: bool | None = None,
    ) -> Watch | None:
        """The attempt's watch, or None when there is nothing to time. With ``send``, it
        starts timing the attempt (its task is the one the timer may interrupt), or raises
        BackendBusy when the reserve's point has passed. ``last``: no later tier."""
        if last is None:
            last = attempt is None or attempt.is_last
        body = req.body if req is not None else None
        if self.learned is not None and attempt is not None:
            window, learned = self.learned.window(attempt.backend.name, body)
            window = min(window, self.ceiling)  # (each backend's own, at most the ceiling)
        else:
            window, learned = self.window(body), False
        if attempt is not None:
            stall, reserve, prefill, first_token = self._bounds(req, attempt, body, last)
        else:
            stall, reserve, prefill, first_token = self.stall_after, 0.0, math.inf, False
        if window <= 0 and stall <= 0 and reserve <= 0 and prefill == math.inf:
            return None
        watch = Watch(
            self,
            req,
            attempt,
            last=last,
            window=window,
            learned=learned,
            stall=stall,
            reserve=reserve,
            prefill=prefill,
            first_token=first_token,
            send=send,
        )
        if send is not None:
            watch.begin()
        return watch

    def _bounds(
        self, req: TierRequest | None, attempt: Attempt, body: bytes | None, last: bool
    ) -> tuple[float, float, float, bool]:
        """The attempt's other bounds, its backend read once (its regime's cold defaults
        found once a regime): the stall window, the reserve and the prefill's limit (True:
        the backend's own ``first_token``). The stall window: the backend's own
        ``stall_after``; else, where a later tier can take over, its learned rhythm (until
        learned, the cold default); the last tier waits ``stall_after`` (the ceiling).

        The reserve, the time this attempt leaves for the later tiers (0: no deadline):
        ``reserve``, or with ``"auto"`` the next tier's learned window if longer; at most
        ``_RESERVE_SHARE`` of the budget. Noted on the attempt.

        The prefill: the first token's time at the backend's normal prompt rate (with the
        margin), or the backend's own ``first_token`` limit, the smaller; not judged for an
        answer that does not stream from a backend with no status URL to tell a prompt
        still read from an answer written. The last tier has no reserve nor prefill limit."""
        backend = attempt.backend
        regime = backend.regime
        defaults = self._colds.get(regime) or self._colds.setdefault(regime, cold(regime))
        own_stall = backend.stall_after
        if own_stall is not None:
            stall: float = own_stall  # type: ignore[assignment]  # seconds once built
        elif self.learned_gap is not None and not last:
            stall = self.learned_gap.window_for(backend.name, regime, defaults)[0]
        else:
            stall = self.stall_after
        if last or req is None:
            return stall, 0.0, math.inf, False
        reserve = 0.0
        if req.deadline is not None:
            reserve = self.reserve
            if self.reserve_auto and self.learned is not None and attempt.n < len(req.chain):
                later, learned_later = self.learned.window(req.chain[attempt.n].name, body)
                if learned_later:
                    reserve = max(reserve, later)
            if req.budget is not None and (share := req.budget * _RESERVE_SHARE) < reserve:
                reserve = share  # (min(), with no call: the builtin parses its arguments)
            attempt.reserve = reserve
        if req.streaming is False and not backend.status_url:
            return stall, reserve, math.inf, False
        rate = self.prompt_rate
        prefill = rate.limit(backend.name, regime, body, defaults)[0] if rate else math.inf
        own = backend.first_token
        if own is not None and own < prefill:  # type: ignore[operator]
            return stall, reserve, own, True  # type: ignore[return-value]  # seconds once built
        return stall, reserve, prefill, False

    def _lifespan_send(self, send: Send) -> Send:
        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.aclose()
            await send(message)

        return lifespan_send


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
