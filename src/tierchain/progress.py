"""The watchdog's status conversation: what a backend's status says, and what it means.

Two questions, apart from the watchdog's timer (:mod:`tierchain.watchdog`):

- before sending (:func:`check_room`): does the backend's polled status say it is
  full? A status never read, or stale, is asked first (:func:`ask_room`), and one that
  answers late (``status_late``) is itself the sign of a starved server: busy;
- when a window ends with no first chunk (:class:`Progress`, one per attempt that
  asks): one GET of its status URL (:meth:`Progress.probe`), and the verdict
  (:meth:`Progress.verdict`): the status's own word (:func:`tierchain.probes.judge`),
  then ``working`` judged against the time (no move within ``progress_span``, the
  prompt's rate against the time left, ``normal_multiple`` times the learned normal,
  the prompt rate's expected prefill).

See docs/watchdog.md.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Hashable
from typing import Protocol

import httpx

from ._runtime import clock
from ._runtime import lag as loop_lag
from ._runtime.deadlines import EARLY
from .allowance import estimate_tokens
from .backend import Backend
from .errors import BackendBusy
from .learned import Learned, PromptRate
from .probes import Reader, Status, fetch_status_once, judge, status_asked_at
from .status import StatusBoard, full
from .telemetry import ATTR_BACKEND, ATTR_ROUTE, tracer

__all__ = ["Asker", "Progress", "ask_room", "check_room"]

PROMPT_BATCH = 2048  # llama.cpp's default n_batch: its prompt progress moves this many at once


class Asker(Protocol):
    """What the status conversation needs of the watchdog that holds it."""

    board: StatusBoard | None
    ask_first: float
    status_late: float
    probe_timeout: float
    progress_span: float
    normal_multiple: float
    ceiling: float
    prompt_rate: PromptRate | None
    learned: Learned | None
    steps: dict[str, float]

    @property
    def client(self) -> httpx.AsyncClient: ...

    def reader_for(self, backend: str) -> Reader: ...


# -- before sending: is there room? ---------------------------------------------------


def check_room(asker: Asker, name: str, url: str) -> Awaitable[None] | None:
    """Raise BackendBusy when the backend's polled status says it is full; a status
    that is stale or was never read is asked first (the awaitable that does it)."""
    board = asker.board
    assert board is not None
    reader = asker.reader_for(name)
    status = board.peek(url, reader)
    if status is None and asker.ask_first > 0:
        return ask_room(asker, name, url, reader)
    _room(board, name, url, status)
    return None


async def ask_room(asker: Asker, name: str, url: str, reader: Reader) -> None:
    """Ask the status now (at most ``ask_first``, or ``status_late``, whichever is
    longer); a late answer is a busy backend."""
    board = asker.board
    assert board is not None
    late = asker.status_late
    # A GET already in flight (the poller's, another attempt's) is joined: the
    # backend has kept us waiting for its status since that GET was sent.
    started = status_asked_at(url) or clock.now()
    limit = max(asker.ask_first, late) - (clock.now() - started)
    loop_lag.hold()  # the gateway's own delay meanwhile is not the backend's
    try:
        status = await board.ask(url, reader, asker.client, limit) if limit > 0 else None
        took = clock.now() - started
        ours = loop_lag.lost_since(started)
    finally:
        loop_lag.release()
    if late > 0 and took - ours >= late - EARLY:
        # A local server answers its status in milliseconds: one that takes this
        # long (or never answers) is starved itself, and never "send it".
        why = f"status late ({took:.2f}s)"
        if ours >= EARLY:
            why = f"status late ({took:.2f}s, {ours:.2f}s of it the gateway's own delay)"
        if board.finishing_cut(url):
            why += ", finishing a prompt batch of a request we cut"
        raise BackendBusy(f"backend {name!r} is full ({why})", why=why)
    _room(board, name, url, status)


def _room(board: StatusBoard, name: str, url: str, status: Status | None) -> None:
    why = full(status, board.limits)
    if why is not None:
        if board.finishing_cut(url):
            why += ", finishing a prompt batch of a request we cut"
        raise BackendBusy(f"backend {name!r} is full ({why})", why=why)


# -- after a window: is it still working? ---------------------------------------------


class Progress:
    """One attempt's status conversation once a window ended: what the status said last
    (its progress), when it last moved, and our prompt's rate since the first answer."""

    __slots__ = (
        "asker",
        "backend",
        "body",
        "moved_at",
        "previous",
        "rate_from",
        "route",
        "start",
        "worked_at",
    )

    def __init__(
        self, asker: Asker, backend: Backend, route: str, body: bytes | None, start: float
    ) -> None:
        self.asker = asker
        self.backend = backend
        self.route = route
        self.body = body
        self.start = start  # the attempt's start
        self.previous: Hashable | None = None  # the progress a working answer showed
        self.moved_at = start
        self.rate_from: tuple[float, int] | None = None
        self.worked_at: float | None = None  # when a probe last said ``working``

    async def probe(self, limit: float) -> Status | None:
        """One GET of the backend's status URL, within ``limit`` seconds (None: no answer)."""
        backend = self.backend
        assert backend.status_url is not None
        with tracer.start_as_current_span(
            "tierchain.probe", attributes={ATTR_BACKEND: backend.name, ATTR_ROUTE: self.route}
        ) as span:
            status = await fetch_status_once(
                self.asker.client,
                backend.status_url,
                limit=limit,
                reader=self.asker.reader_for(backend.name),
            )
            if status is not None:
                span.set_attribute("tierchain.probe.busy", status.busy)
            return status

    def verdict(
        self,
        status: Status | None,
        now: float,
        end: float,
        prefill_end: float,
        *,
        streaming: bool,
        prompt_due: bool,
    ) -> tuple[str, float]:
        """The verdict on ``status`` at ``now`` (``end``: the soonest the attempt must end,
        math.inf if nothing bounds it), and the expected prefill's end (moved later when
        our prompt's batches go at the backend's normal rate)."""
        verdict: str = judge(status, self.previous, streaming=streaming)
        if status is not None and verdict in ("working", "no_progress"):
            verdict, prefill_end = self._against_time(status, verdict, now, end, prefill_end)
        if prompt_due and verdict == "working" and status is not None and status.prefilling:
            verdict = "too_slow"  # past its expected prefill, a slot still reads a prompt
        return verdict, prefill_end

    def working(self, status: Status) -> None:
        """A ``working`` answer extended the wait: its progress is the one to move from."""
        self.previous = status.progress
        self.worked_at = clock.now()

    def unknown_holds(self, now: float) -> bool:
        """An ``unknown`` answer (no answer in time, an error) is not evidence: True while
        the last real answer of this attempt said ``working`` less than ``progress_span``
        ago (a busy llama.cpp server may answer its status late between two that said it
        was working). The attempt is then judged as if that answer still held; a status
        that stays unknown for ``progress_span`` is the plain stopwatch again."""
        worked = self.worked_at
        return worked is not None and now - worked < self.asker.progress_span

    def _against_time(
        self, status: Status, verdict: str, now: float, end: float, prefill_end: float
    ) -> tuple[str, float]:
        """``working`` (or not moving yet) judged against the time: ``working``,
        ``no_progress`` or ``too_slow``.

        - Progress moves in steps (llama.cpp counts a prompt batch at a time):
          "no progress" needs no move for ``progress_span`` seconds (or 1.5 times
          the longest wait between two moves seen on this backend).
        - Where the format reports our slot's prompt progress, the rate since the
          first probe must finish the prompt before the time left runs out.
        - Where this backend's normal time to first data is learned, a wait past
          ``normal_multiple`` times it is too slow.
        """
        asker = self.asker
        name = self.backend.name
        if verdict == "no_progress":
            if not self._within_a_step(now):
                return verdict, prefill_end
            verdict = "working"  # not moved yet, within one step of its granularity
        elif status.progress is not None and self.previous is not None:
            if self.moved_at > self.start:  # a move after a move: one step of its granularity
                step = now - self.moved_at
                if step > asker.steps.get(name, 0.0):
                    asker.steps[name] = min(step, asker.ceiling)
            self.moved_at = now
        done = status.prompt_done
        if done:
            prefill_end = self._batches_at_normal_rate(done, now, prefill_end)
        if done is not None and self._too_slow_for(done, now, end):
            return "too_slow", prefill_end
        learned = asker.learned
        if learned is not None:
            normal = learned.normal(name, self.body)
            if normal is not None and now - self.start > asker.normal_multiple * normal:
                return "too_slow", prefill_end
        return verdict, prefill_end

    def _within_a_step(self, now: float) -> bool:
        """True while "no progress" is younger than one step of the backend's granularity."""
        asker = self.asker
        name = self.backend.name
        span = max(asker.progress_span, 1.5 * asker.steps.get(name, 0.0))
        prompt_rate = asker.prompt_rate
        normal = prompt_rate.normal_rate(name) if prompt_rate is not None else None
        if prompt_rate is not None and normal is not None:
            # One prompt batch at the normal rate (with the margin): no need to
            # wait progress_span for a move that should have come long before.
            step = prompt_rate.margin * PROMPT_BATCH / normal
            span = min(span, max(step, 1.5 * asker.steps.get(name, 0.0)))
        return now - self.moved_at < span

    def _too_slow_for(self, done: int, now: float, end: float) -> bool:
        """True when our prompt's rate since the first answer cannot finish it by ``end``."""
        if self.rate_from is None:
            self.rate_from = (now, done)
            return False
        then, before = self.rate_from
        if done > before and now > then and end != math.inf:
            rate = (done - before) / (now - then)
            left = estimate_tokens(self.body or b"") - done
            if left > 0 and left / rate > end - now:
                return True
        return False

    def _batches_at_normal_rate(self, done: int, now: float, prefill_end: float) -> float:
        """Our slot's prompt moved (a whole batch at a time) at least as fast as the
        backend's normal rate allows (its rate over the margin): the expected prefill
        is measured on this prompt itself, from the rate its batches went at."""
        rate = self.asker.prompt_rate
        if rate is None or prefill_end == math.inf or now <= self.start:
            return prefill_end
        observed = done / (now - self.start)
        if observed * rate.margin < rate.rate_for(self.backend.name, self.backend.regime):
            return prefill_end  # slower than the normal allows: a starved server's batches
        total = max(float(done), rate.tokens(self.backend.name, self.body))
        return max(prefill_end, self.start + rate.margin * total / observed)
