"""Failover on a chain with a pool or shared hardware (``shares``).

The pool's replicas side by side (:func:`gathered`), each time the chain reaches the
pool ordered by the :class:`~tierchain.picker.Picker` (:meth:`PoolPlan.picked`), the
backends of a taken ``shares`` group passed over (:meth:`PoolPlan.next_after`), and the
picker told how each attempt at a replica ended (:meth:`PoolPlan.ended`). Only such
chains take this path. See docs/pools.md.
"""

from __future__ import annotations

from ..backend import Backend
from ..picker import Picker, Prefix, prefix_keys
from ..request import (
    Attempt,
    TierRequest,
)
from ..telemetry import (
    BACKEND_BUSY,
    labelled,
)
from .plan import Fault, FaultKind, named, next_attempt, record

__all__ = ["PoolPlan", "gathered", "sibling_left"]


class PoolPlan:
    """A request's plan on a chain with a pool or shared hardware: the ``shares``
    groups known taken, the replicas preferred, the prompt's prefix for the picker."""

    __slots__ = ("held", "picker", "preferred", "prefix", "salt")

    def __init__(self, req: TierRequest, picker: Picker, salt: bytes = b"") -> None:
        self.picker = picker
        self.held: set[str] = set()  # the shares groups known taken
        self.prefix: Prefix | None = None  # the prompt's prefix hashes, once a pool needs them
        self.salt = salt  # the caller key's name: prefixes never match across keys
        preferred = set()
        if req.pin is not None:
            preferred.add(req.pin)
        if req.preference is not None and req.preference.applied:
            preferred.add(req.preference.requested)
        self.preferred = frozenset(preferred)

    async def next_after(
        self, req: TierRequest, attempt: Attempt, fault: Fault | None
    ) -> Attempt | None:
        """The next attempt of a chain with a pool or shared hardware: the next replica
        picked by live state, past every backend whose hardware is known taken."""
        if fault is not None and fault.kind is FaultKind.HOLDS:
            self.held.add(fault.reason)
        nxt = next_attempt(req, attempt)
        while nxt is not None and not nxt.force:
            if nxt.backend.pool is not None:
                nxt = await self.picked(req, nxt)
            shares = nxt.backend.shares
            if shares is None or shares not in self.held:
                break
            record(req, nxt, "busy")
            labelled(BACKEND_BUSY, req.route or "", nxt.backend.name, "shares").inc()
            req.emit(
                "backend_busy",
                **named(nxt.backend),
                reason="shares",
                shares=shares,
                failing_over=not nxt.is_last,
            )
            nxt = next_attempt(req, nxt)
        return nxt

    async def picked(self, req: TierRequest, attempt: Attempt) -> Attempt:
        """``attempt`` at the best replica left of its pool (the chain reordered to say so)."""
        chain = req.chain
        i = attempt.n - 1
        pool = chain[i].pool
        j = i + 1
        while j < len(chain) and chain[j].pool == pool:
            j += 1
        run = chain[i:j]
        if len(run) < 2:
            return attempt
        entering = i == 0 or chain[i - 1].pool != pool
        if self.prefix is None:
            self.prefix = prefix_keys(req.body, self.salt)
        route = req.route or ""
        if entering and run[0].name in self.preferred:
            # A preferred or pinned replica leads; the rest are ordered after it.
            order = [run[0], *await self.picker.order(route, run[1:], req.body, self.prefix)]
        else:
            order = await self.picker.order(route, run, req.body, self.prefix)
        req.chain = (*chain[:i], *order, *chain[j:])
        return Attempt(attempt.n, attempt.of, order[0], attempt.route, force=attempt.force)

    async def ended(
        self,
        req: TierRequest,
        attempt: Attempt,
        outcome: str,
        first: float | None,
        recorded: int,
    ) -> None:
        """Tell the picker how an attempt at a replica ended (and, when it answered,
        that the replica now holds the request's prompt prefix). ``outcome`` is the
        responder's, ``first`` its first data event's time, ``recorded`` the trail's length
        when it began."""
        record = req.attempts[recorded] if len(req.attempts) > recorded else None
        if record is not None:
            outcome = record.outcome
        self.picker.ended(
            attempt.backend,
            outcome,
            body=req.body,
            first_data_s=None if first is None else first - attempt.started,
            retry_in=record.retry_after if record is not None else None,
        )
        if outcome == "ok" and self.prefix is not None:
            await self.picker.remember(req.route or "", attempt.backend, self.prefix)


def gathered(chain: tuple[Backend, ...]) -> tuple[Backend, ...]:
    """``chain`` with each pool's replicas side by side, where its first one stands
    (a preference may have moved one replica ahead of the rest)."""
    out: list[Backend] = []
    done: set[str] = set()
    for backend in chain:
        pool = backend.pool
        if pool is None:
            out.append(backend)
        elif pool not in done:
            done.add(pool)
            out.extend(b for b in chain if b.pool == pool)
    return tuple(out)


def sibling_left(req: TierRequest, attempt: Attempt) -> bool:
    """True when another replica of the attempt's pool comes next: it is the retry."""
    pool = attempt.backend.pool
    return pool is not None and attempt.n < len(req.chain) and req.chain[attempt.n].pool == pool
