"""Picking a pool's replica by its live state.

:class:`Failover` asks a :class:`Picker` for the order in which to try the
replicas of a :class:`~tierchain.Pool` each time the chain reaches the pool (and
again, among those left, after a replica failed). Everything it reads is what
the gateway already knows; nothing is asked of the backends on the way:

- the attempts in flight at each replica: this process's own count, or, for a
  replica with ``max_in_flight``, its leases in the store (every gateway
  replica's attempts);
- the replica's polled status, when a SaturationWatchdog polls its
  ``status_url`` (the SaturationWatchdog's status board): requests waiting,
  KV-cache use, busy slots;
- its time to first data, learned from this process's answers (the median of
  recent ones, once three were seen);
- its breaker: open in the store the Failover was given, or skipped as open
  here within its ``retry_in``.

Each replica falls into a class, tried in this order: free, then full (its
``max_in_flight`` reached, or its status past the watchdog's fullness
thresholds), then open. Within a class the lowest score goes first (each
filter and each term of the score is a piece of its own in
:mod:`tierchain.pick_policy`, and this policy is their composition)::

    score = in_flight  * attempts in flight
          + waiting    * requests waiting (status)
          + kv_cache   * KV-cache use, 0..1 (status)
          + slots      * share of slots busy, 0..1 (status)
          + first_data * learned time to first data, in seconds

with the weights of :class:`PickWeights` (``Failover(pick=PickWeights(...))``); a fact
that is not known adds nothing. Scores are compared in steps of ``resolution``
(0.1: a few milliseconds' difference in learned time to first data is no
difference), and equal steps are ordered at random, so equal idle replicas
share the load. A replica named by a preference or a pin is
tried first whatever its score.

Prefix affinity: a request's prompt is cut into blocks (the system prompt or
instructions, then each message; a plain prompt in pieces of 2 KiB), and each
leading run of blocks is hashed (no tokenizer needed). When a replica answered
a request with the same leading blocks recently (``AFFINITY_TTL``), it
probably still holds that prefix in its KV cache and skips its prefill: it goes
first while it is in the best class and its score is within ``affinity`` of the
least loaded replica's (Ray Serve's imbalance threshold); otherwise the least
loaded goes first. The hashes are keyed with the caller key's name (when CallerKeys
is in front), so a request only ever finds the prefixes its own key sent: another
key's system prompt cannot be guessed from which replica answers or from the
``hit`` count. The index lives in the Failover's store: a bounded map in
memory (:data:`~tierchain.store.AFFINITY_ENTRIES`) or, with a RedisStore, in
Redis, so every gateway replica sends a conversation to the same backend
replica.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from . import _json
from ._runtime import clock
from .backend import Backend
from .learned import Learned
from .pick_policy import Candidate, Ranking, default_policy
from .probes import auto_reader
from .status import StatusBoard, full
from .store import AffinityStore, MemoryStore, Store
from .telemetry import POOL_AFFINITY, POOL_PICKS, labelled, log_event

__all__ = ["AFFINITY_TTL", "PickWeights", "Picker", "Prefix", "prefix_keys"]

AFFINITY_TTL = 600.0
"""Seconds a replica stays the one for a prefix after it last answered it."""
_BLOCK = 2048  # characters of a plain prompt per block
_LOOKED_UP = 64  # the longest prefixes looked up
_RECORDED = 32  # the longest prefixes recorded (and the first, the system prompt's)


def _canon(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _blocks(body: bytes | None) -> list[bytes]:
    """A request's prompt as blocks, in order: system or instructions, then each message
    (OpenAI and Ollama ``messages``, Anthropic ``system`` and ``messages``, Responses
    ``instructions`` and ``input``), or a plain ``prompt`` in pieces."""
    if not body:
        return []
    try:
        data = _json.loads(body)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    blocks: list[bytes] = []
    for key in ("system", "instructions"):
        value = data.get(key)
        if value:
            blocks.append(_canon(value))
    turns = data.get("messages", data.get("input"))
    if isinstance(turns, list):
        blocks.extend(_canon(turn) for turn in turns)
    elif isinstance(turns, str):
        blocks.extend(turns[i : i + _BLOCK].encode() for i in range(0, len(turns), _BLOCK))
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        blocks.extend(prompt[i : i + _BLOCK].encode() for i in range(0, len(prompt), _BLOCK))
    return blocks


class Prefix(NamedTuple):
    """A prompt's leading runs of blocks: each one's hash and its size in bytes."""

    keys: list[str]
    sizes: list[int]


def prefix_keys(body: bytes | None, salt: bytes = b"") -> Prefix:
    """The hash (and the size) of each leading run of the prompt's blocks, shortest first.

    ``salt`` keys the hash: the caller key's name (see :mod:`tierchain.keys`), so one
    caller's prompts never match another's (no caller can learn, from which replica
    answers or from ``tierchain_pool_affinity_total``, what another key's prompts hold).
    """
    if len(salt) > 64:  # (blake2b's longest key)
        salt = hashlib.blake2b(salt, digest_size=32).digest()
    h = hashlib.blake2b(digest_size=16, key=salt)
    keys: list[str] = []
    sizes: list[int] = []
    size = 0
    for block in _blocks(body):
        h.update(len(block).to_bytes(8, "big"))
        h.update(block)
        size += len(block)
        keys.append(h.hexdigest())
        sizes.append(size)
    return Prefix(keys, sizes)


@dataclass(frozen=True, slots=True)
class PickWeights:
    """The weight of each fact in a replica's score (see :mod:`tierchain.picker`).

    Options: [how a replica is picked](pools.md#how-a-replica-is-picked).
    """

    in_flight: float = 1.0
    """Per attempt in flight at the replica."""
    waiting: float = 1.0
    """Per request its status says is waiting."""
    kv_cache: float = 2.0
    """Times its KV-cache use (0..1)."""
    slots: float = 1.0
    """Times the share of its slots that are busy (0..1)."""
    first_data: float = 0.1
    """Per second of its learned time to first data."""
    resolution: float = 0.1
    """Scores closer than this are compared as equal (ordered at random)."""
    affinity: float = 2.0
    """How far above the least loaded replica's score the replica holding the request's
    prompt prefix may be and still go first (0: only while it is the least loaded)."""
    affinity_match: float = 0.1
    """The least share of the prompt (in bytes) a recently served prefix must cover to
    count: a short system prompt alone in front of a long new question does not."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"pick weight {f.name} must be a finite number >= 0, got {value!r}"
                )
        if self.resolution <= 0:
            raise ValueError(f"pick resolution must be > 0, got {self.resolution!r}")


class Picker:
    """Orders a pool's replicas for one request; learns from each attempt's end.

    ``store`` is the store whose breakers and leases it reads (None: only what
    this process saw); ``admission`` the Failover's in-flight leases; ``board``
    the status board whose polled statuses it reads (None: none).
    """

    __slots__ = (
        "_admission",
        "_affinity",
        "_board",
        "_breakers",
        "_fallback",
        "_in_flight",
        "_learned",
        "_open",
        "_remote",
        "policy",
        "weights",
    )

    def __init__(
        self,
        weights: PickWeights,
        *,
        admission: Any,
        store: Any = None,
        board: StatusBoard | None = None,
        policy: Ranking | None = None,
    ) -> None:
        self.weights = weights
        # Built once: the filters and scorers. A policy of the user's is guarded by the
        # default one: should it raise or answer the wrong length, the pick goes on with it.
        self.policy: Ranking = default_policy(weights) if policy is None else policy
        self._fallback = None if policy is None else default_policy(weights)
        self._board = board
        self._admission = admission
        self._breakers: Store | None = store if isinstance(store, Store) else None
        if not isinstance(store, AffinityStore):  # the admission's own (a MemoryStore)
            store = getattr(admission, "store", None)
        self._affinity: AffinityStore = store if isinstance(store, AffinityStore) else MemoryStore()
        # A store across the network: the replicas' facts are asked for all at once.
        leases = getattr(admission, "store", None)
        self._remote = any(
            s is not None and not isinstance(s, MemoryStore) for s in (self._breakers, leases)
        )
        self._in_flight: dict[str, int] = {}
        self._open: dict[str, float] = {}  # replica -> when its breaker said to come back
        self._learned = Learned(
            maximum=3600.0, floor=0.001, quantile=0.5, margin=1.0, min_samples=3
        )

    async def order(
        self,
        route: str,
        replicas: Sequence[Backend],
        body: bytes | None,
        prefix: Prefix | None = None,
    ) -> list[Backend]:
        """``replicas`` best first; ``prefix`` is the request's :func:`prefix_keys`."""
        if len(replicas) == 1:
            return list(replicas)
        affine = await self._affine(route, prefix) if prefix and prefix.keys else None
        if self._remote:
            seen = await asyncio.gather(*(self._facts(route, b, body) for b in replicas))
        else:  # (in memory nothing waits: no task per replica)
            seen = [await self._facts(route, b, body) for b in replicas]
        ranked = self.policy.rank(seen) if self._fallback is None else self._guarded(seen)
        step = self.weights.resolution
        keyed = sorted(
            zip(ranked, [random.random() for _ in replicas], replicas, strict=True),
            key=lambda item: (item[0][0], math.floor(item[0][1] / step), item[1]),
        )
        out = [b for _, _, b in keyed]
        if prefix and prefix.keys:
            pool = replicas[0].pool or ""
            where = next((i for i, b in enumerate(out) if b.name == affine), None)
            if where is None:
                labelled(POOL_AFFINITY, route, pool, "miss").inc()
            else:
                best_class, least = keyed[0][0]
                its_class, its_score = keyed[where][0]
                if its_class == best_class and its_score <= least + self.weights.affinity:
                    out.insert(0, out.pop(where))
                    labelled(POOL_AFFINITY, route, pool, "hit").inc()
                else:
                    labelled(POOL_AFFINITY, route, pool, "loaded").inc()
        return out

    def _guarded(self, seen: list[Candidate]) -> list[tuple[int, float]]:
        """A user's policy's ranking, or the default one's when it raises or is malformed
        (as OpenTelemetry wraps a user's hooks: a broken scorer never breaks a request)."""
        assert self._fallback is not None
        try:
            ranked = [(int(c), float(s)) for c, s in self.policy.rank(seen)]
            if len(ranked) == len(seen) and all(math.isfinite(s) for _, s in ranked):
                return ranked
            problem = f"ranked {len(ranked)} of {len(seen)} replicas, or a score not finite"
        except Exception as exc:  # a user's code: logged, never raised into the request
            problem = f"{type(exc).__name__}: {exc}"
        log_event(
            "pool.policy_failed",
            logging.WARNING,
            policy=type(self.policy).__name__,
            error=problem,
            using="the default policy",
        )
        return self._fallback.rank(seen)

    async def _affine(self, route: str, prefix: Prefix) -> str | None:
        """The replica that last answered the longest of the request's prefixes, when
        that prefix covers at least ``affinity_match`` of the prompt."""
        keys, sizes = prefix
        whole = sizes[-1] or 1
        least = self.weights.affinity_match * whole
        # Longest first, and only those long enough to count.
        looked = [k for k, size in zip(keys, sizes, strict=True) if size >= least]
        if not looked:
            return None
        try:
            found = await self._affinity.affinity_get(route, looked[::-1][:_LOOKED_UP])
        except Exception:  # a store must never fail a request: no affinity
            return None
        return found

    async def remember(self, route: str, backend: Backend, prefix: Prefix) -> None:
        """``backend`` answered a request with these prefixes: it holds them now."""
        keys = prefix.keys[-_RECORDED:]
        if not keys:
            return
        if len(prefix.keys) > _RECORDED:
            keys.insert(0, prefix.keys[0])
        try:
            await self._affinity.affinity_set(route, keys, backend.name, AFFINITY_TTL)
        except Exception:  # a store must never fail a request
            pass

    async def _facts(self, route: str, backend: Backend, body: bytes | None) -> Candidate:
        """What is known of one replica now (the filters and scorers read it)."""
        name = backend.name
        seen = Candidate(backend, self._in_flight.get(name, 0))
        if backend.max_in_flight is not None:
            try:
                seen.in_flight = max(seen.in_flight, await self._admission.in_flight(name))
            except Exception:  # a store must never fail a request: this process's count
                pass
            seen.leases_full = seen.in_flight >= backend.max_in_flight
        url = backend.status_url
        board = self._board if url is not None else None
        if board is not None and url is not None:
            status = seen.status = board.peek(url, auto_reader)
            if status is not None:
                seen.status_full = full(status, board.limits) is not None
        seen.first_data = self._learned.normal(name, body)
        if self._open.get(name, -math.inf) > clock.now():
            seen.open = True
        elif self._breakers is not None:
            try:
                snap = await self._breakers.breaker_snapshot(route, name)
            except Exception:  # unknown: not open
                pass
            else:
                seen.open = snap.state == "open"
        return seen

    async def all_full(self, chain: Sequence[Backend]) -> bool:
        """True when every backend of ``chain`` is known to be full now: its
        ``max_in_flight`` leases are all taken, or its polled status says so. One
        that cannot say (no limit, no status, a status not read yet) has room."""
        board = self._board
        for backend in chain:
            limit = backend.max_in_flight
            if limit is not None:
                try:
                    taken = await self._admission.in_flight(backend.name)
                except Exception:  # a store must never fail a request: not known full
                    return False
                if taken >= limit:
                    continue
            url = backend.status_url
            if (
                url is not None
                and board is not None
                and full(board.peek(url, auto_reader), board.limits) is not None
            ):
                continue
            return False
        return True

    def started(self, route: str, backend: Backend) -> None:
        """An attempt at ``backend`` begins."""
        name = backend.name
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        labelled(POOL_PICKS, route, backend.pool or "", name).inc()

    def ended(
        self,
        backend: Backend,
        outcome: str,
        *,
        body: bytes | None,
        first_data_s: float | None = None,
        retry_in: float | None = None,
    ) -> None:
        """The attempt at ``backend`` ended with ``outcome``."""
        name = backend.name
        left = self._in_flight.get(name, 0) - 1
        if left > 0:
            self._in_flight[name] = left
        else:
            self._in_flight.pop(name, None)
        if outcome == "skipped":
            self._open[name] = clock.now() + (retry_in if retry_in is not None else 1.0)
        else:
            self._open.pop(name, None)
        if outcome == "ok" and first_data_s is not None:
            self._learned.observe(name, body, first_data_s)

    def in_flight(self, name: str) -> int:
        """Attempts in flight at replica ``name`` from this process."""
        return self._in_flight.get(name, 0)
