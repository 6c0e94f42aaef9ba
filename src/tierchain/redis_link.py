"""The connection RedisStore works through, and what happens while Redis is away.

:class:`RedisLink` holds the client (one immediate retry of a broken connection, no backoff),
the calls that must finish even when their caller is cancelled (``_shielded``), the tasks
started on the side (``_spawn``, awaited by ``aclose``), and the outage machinery: when Redis
cannot be reached, ONE warning, a local :class:`~tierchain.MemoryStore` serving meanwhile
(``_local``, ``_went_away``), and Redis tried again at most every ``reconnect_every`` seconds;
an error *reply* is no outage (logged as ``store.redis_refused`` and raised). The operations
themselves are :class:`~tierchain.RedisStore`'s, the scripts they run
:mod:`tierchain.redis_scripts`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Self, TypeVar

from ._runtime import clock
from .errors import StoreUnavailable
from .masking import mask_text, mask_url
from .memory_store import MemoryStore
from .telemetry import log_event

__all__ = ["RedisLink"]

T = TypeVar("T")


class RedisLink:
    """A Redis client with its fallback to memory while Redis is away (see the module
    docstring); :class:`~tierchain.RedisStore` is built on it."""

    def __init__(
        self,
        url: str,
        prefix: str,
        timeout: float,
        reconnect_every: float,
        ttl: float,
        clock: Callable[[], float] | None,
    ) -> None:
        """``timeout``, ``reconnect_every`` and ``ttl`` are seconds, checked by the store."""
        try:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import ReadOnlyError, ResponseError
        except ImportError:
            raise ImportError(
                "RedisStore needs the redis package: install tierchain[redis]."
            ) from None
        self.url = url
        self.prefix = prefix
        self.timeout = timeout
        self.reconnect_every = reconnect_every
        self.ttl = ttl
        self._clock = clock
        # One immediate retry lets a pooled connection that died with a Redis
        # restart be replaced transparently; no backoff, so a dead Redis costs
        # two refused connects, not seconds. Only a broken connection is
        # retried: a reply that is late may belong to a script Redis already
        # ran, and sending it again would count one outcome twice.
        self._redis: Any = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            decode_responses=True,
        )
        self._refusals: tuple[type[BaseException], ...] = (ResponseError,)
        # A read-only replica (Redis failing over) refuses every write: an outage.
        self._outages: tuple[type[BaseException], ...] = (ReadOnlyError,)
        self._fallback: MemoryStore | None = None
        self._retry_at = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={mask_url(self.url)!r}, prefix={self.prefix!r})"

    # -- lifecycle ------------------------------------------------------------

    async def aclose(self) -> None:
        """Wait for in-flight records, then close the connection pool."""
        # Until none is left: a record's task may start another as it ends (a cancelled
        # acquire gives its probe slot back from its done-callback).
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._redis.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def degraded(self) -> bool:
        """True while Redis is unreachable and the local fallback is serving."""
        return self._fallback is not None

    # -- the outage machinery ---------------------------------------------------

    def _local(self) -> MemoryStore | None:
        """The fallback to use now, or None when Redis should be tried."""
        fallback = self._fallback
        if fallback is None:
            return None
        now = clock.now()
        if now < self._retry_at:
            return fallback
        self._retry_at = now + self.reconnect_every  # this caller tries; the rest wait
        return None

    def _went_away(self, exc: BaseException, what: str = "") -> MemoryStore:
        """The fallback for an outage; an error reply (Redis refused this one call: a
        script error, a value it cannot take) is no outage: it is logged and raised,
        and every other call goes on reaching Redis."""
        if isinstance(exc, self._refusals) and not isinstance(exc, self._outages):
            self._came_back()  # Redis answered
            log_event(
                "store.redis_refused",
                level=30,
                url=mask_url(self.url),
                call=what or None,
                error=mask_text(repr(exc), self.url),
            )
            raise exc
        self._retry_at = clock.now() + self.reconnect_every
        if self._fallback is None:
            self._fallback = MemoryStore(clock=self._clock or clock.wall)
            log_event(
                "store.redis_unavailable",
                level=30,
                url=mask_url(self.url),
                error=mask_text(repr(exc), self.url),
                fallback="local memory",
                reconnect_every_s=self.reconnect_every,
            )
        return self._fallback

    def _came_back(self) -> None:
        if self._fallback is not None:
            self._fallback = None
            log_event("store.redis_reconnected", url=mask_url(self.url))

    async def _call(self, make: Callable[[], Awaitable[T]]) -> T:
        async with asyncio.timeout(self.timeout * 4):
            result = await make()
        self._came_back()
        return result

    async def _shielded(
        self, make: Callable[[], Awaitable[T]], orphan: Callable[[T], None] | None = None
    ) -> T:
        """Run a Redis call that must finish even if its caller is cancelled meanwhile."""
        task = asyncio.ensure_future(self._call(make))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if orphan is not None:
                task.add_done_callback(
                    lambda t: (
                        orphan(t.result()) if not t.cancelled() and not t.exception() else None
                    )
                )
            raise

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _unreachable(self, what: str, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"{what}: Redis at {mask_url(self.url)} is unreachable "
            f"({mask_text(repr(exc), self.url)})"
        )
