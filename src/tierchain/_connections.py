"""The Forwarder's HTTP connections: a pool whose cost stays flat as connections grow.

httpcore's ``AsyncConnectionPool`` walks every connection it holds on each
request start and each response close: with thousands of streams parked on a
saturated backend, admitting one more stream costs milliseconds of CPU, and
the event loop lags behind its own connect timeouts. :class:`FlatTransport`
is httpx's own ``AsyncHTTPTransport`` (same request and response mapping, same
exception mapping) over :class:`FlatPool`, which keeps only the *idle*
keep-alive connections, per origin, in a stack: taking one, or putting one
back, is O(1) however many requests are in flight. Connections are HTTP/1.1,
made with httpcore's own ``AsyncHTTPConnection``.

Idle connections are closed once they have been idle ``keepalive_expiry``
seconds, by a reaper task that runs only while some are idle, so a gateway's
open file descriptors return to where they were once the load is over.

A request is never sent twice from here. An idle connection the backend has
closed (or reset) is found before the request is written (httpcore's
``has_expired`` looks whether the idle socket has become readable: an end or a
reset waiting there) and dropped for a new one: nothing was sent on it. Once a
request has been handed to a connection the backend may have read it (a
connection closed just after that look, the backend's idle timeout racing
ours, cannot be told apart from a backend that read the request, worked on it
and then reset), so a failure goes up as it is: Failover decides whether to
try again, and that try is an attempt of its own (in the attempts header, the
log and the metrics).

Each connection counts the writes that failed on its socket (reads are not
wrapped: a streamed chunk costs nothing more). A request one of whose writes
failed (the backend had reset the connection before the request was out:
httpcore then reads for an early answer, and finds the reset) never reached
the backend whole, so the backend cannot have acted on it: the pool raises
:class:`NotSent`, the cause of httpx's ``ReadError``, and Failover may try it
again on the same backend, as an attempt of its own. A request written whole
and then met with a reset or an end is the other case above: it may have
been read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpcore
import httpx

from ._runtime import clock

__all__ = ["FlatPool", "FlatTransport", "NotSent", "trust_store"]

_AFTER_CONNECT = (httpcore.ReadError, httpcore.WriteError, httpcore.RemoteProtocolError)


@functools.cache
def trust_store() -> ssl.SSLContext:
    """The TLS context every client of the gateway verifies backends with, built once a
    process. httpx builds one for each client it makes (reading certifi's bundle: about
    45 ms of CPU on the 2-core machine), and the gateway makes clients for status polls,
    prefill questions and rest checks while a burst is on. One context serves any number
    of connections at once."""
    return httpx.create_ssl_context(trust_env=False)


class NotSent(httpcore.ReadError):
    """The connection failed before the request was written whole (a write of it failed)."""


class _Written(httpcore.AsyncNetworkStream):
    """A connection's socket stream, counting its writes that failed.

    Reads, ``aclose`` and ``get_extra_info`` are the wrapped stream's own bound
    methods, set on the instance: no extra call per read."""

    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self.failed = 0
        self._wrap(stream)

    def _wrap(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self.read = stream.read  # type: ignore[method-assign]
        self.aclose = stream.aclose  # type: ignore[method-assign]
        self.get_extra_info = stream.get_extra_info  # type: ignore[method-assign]

    # (The timeout parameters below are httpcore's network interface, not ours to change.)
    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        try:
            await self._stream.write(buffer, timeout)
        except BaseException:
            self.failed += 1
            raise

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore.AsyncNetworkStream:
        # The same wrapper over the TLS stream: the connection's count goes on.
        self._wrap(await self._stream.start_tls(ssl_context, server_hostname, timeout))
        return self


_NETWORK = httpcore.AnyIOBackend()  # what httpcore's own default picks on asyncio


class _Counted(httpcore.AsyncNetworkBackend):
    """One connection's network backend: it keeps the stream it made, to count writes."""

    def __init__(self) -> None:
        self.stream: _Written | None = None

    @property
    def failed(self) -> int:
        return 0 if self.stream is None else self.stream.failed

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await _NETWORK.connect_tcp(
            host=host,
            port=port,
            timeout=timeout,
            local_address=local_address,
            socket_options=socket_options,
        )
        self.stream = _Written(stream)
        return self.stream

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await _NETWORK.connect_unix_socket(
            path=path, timeout=timeout, socket_options=socket_options
        )
        self.stream = _Written(stream)
        return self.stream

    async def sleep(self, seconds: float) -> None:
        await _NETWORK.sleep(seconds)


class _Connection(httpcore.AsyncHTTPConnection):
    """httpcore's HTTP/1.1 connection over a network backend that counts its writes."""

    def __init__(self, origin: httpcore.Origin, **kwargs: Any) -> None:
        self.counted = _Counted()
        super().__init__(origin, network_backend=self.counted, **kwargs)


class FlatPool:
    """HTTP/1.1 connections, no cap on how many, at most ``max_keepalive`` idle per origin."""

    def __init__(
        self,
        *,
        ssl_context: Any = None,
        max_keepalive: int | None = 64,
        keepalive_expiry: float | None = 5.0,
        socket_options: Any = None,
    ) -> None:
        self._ssl_context = ssl_context
        self._max_keepalive = max_keepalive
        self._expiry = keepalive_expiry
        self._socket_options = socket_options
        # Per origin, idle connections with the time each became idle, oldest first.
        self._idle: dict[_Key, list[tuple[float, _Connection]]] = {}
        self._busy: set[_Connection] = set()
        self._closing: list[_Connection] = []
        self._reaper: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def connections(self) -> int:
        """Open connections: in use and idle."""
        return len(self._busy) + sum(len(v) for v in self._idle.values())

    def _take(self, origin: httpcore.Origin) -> _Connection | None:
        idle = self._idle.get(_key(origin))
        while idle:
            _, conn = idle.pop()  # the most recently used: the least likely to be stale
            if conn.is_available() and not conn.has_expired():
                return conn
            self._drop(conn)
        return None

    def _drop(self, conn: _Connection) -> None:
        """Close a connection that is not in use, soon (the reaper awaits the close)."""
        self._closing.append(conn)
        self._ensure_reaper()

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        if self._closed:
            raise httpcore.PoolTimeout("the connection pool is closed")  # pragma: no cover
        origin = request.url.origin
        conn = self._take(origin)  # (a stale idle connection is dropped here, unused)
        if conn is None:
            conn = _Connection(
                origin,
                ssl_context=self._ssl_context,
                keepalive_expiry=self._expiry,
                socket_options=self._socket_options,
            )
        self._busy.add(conn)
        counted = conn.counted
        failed = counted.failed
        try:
            response = await conn.handle_async_request(request)
        except BaseException as exc:
            # Never sent again from here: the backend may have read it (see the module
            # docstring). Failover's own retry, if any, is an attempt of its own.
            self._busy.discard(conn)
            await _close_quietly(conn)
            if isinstance(exc, _AFTER_CONNECT) and counted.failed != failed:
                raise NotSent(f"the request was not written whole: {exc!r}") from exc
            raise
        return httpcore.Response(
            status=response.status,
            headers=response.headers,
            content=_Released(response.stream, self, conn),
            extensions=response.extensions,
        )

    async def _release(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if self._closed or not conn.is_idle() or conn.has_expired():
            await _close_quietly(conn)
            return
        # httpcore's private ``_origin`` (a connection has no public one): a deliberate
        # divergence, see docs/internals.md; tests/test_dependency_internals.py guards it.
        idle = self._idle.setdefault(_key(conn._origin), [])
        if self._max_keepalive is not None and len(idle) >= self._max_keepalive:
            await _close_quietly(conn)
            return
        idle.append((clock.now(), conn))
        self._ensure_reaper()

    # -- closing idle connections --------------------------------------------------

    def _ensure_reaper(self) -> None:
        if (
            self._reaper is None
            and not self._closed
            and (self._expiry is not None or self._closing)
        ):
            self._reaper = asyncio.get_running_loop().create_task(
                self._reap(), name="tierchain-pool-reaper"
            )

    async def _reap(self) -> None:
        """Close idle connections past their expiry; end when none is idle."""
        expiry = self._expiry
        try:
            while True:
                closing, self._closing = self._closing, []
                for conn in closing:
                    await _close_quietly(conn)
                now = clock.now()
                oldest: float | None = None
                for origin, idle in list(self._idle.items()):
                    while idle and expiry is not None and now - idle[0][0] >= expiry:
                        _, conn = idle.pop(0)
                        await _close_quietly(conn)
                    if idle:
                        oldest = idle[0][0] if oldest is None else min(oldest, idle[0][0])
                    else:
                        del self._idle[origin]
                if self._closing:
                    continue
                if oldest is None or expiry is None:
                    return
                await asyncio.sleep(max(0.0, oldest + expiry - now))
        finally:
            self._reaper = None

    async def aclose(self) -> None:
        """Close every connection, idle or in use."""
        self._closed = True
        reaper = self._reaper
        if reaper is not None:
            reaper.cancel()
            await asyncio.wait([reaper])
        conns = [c for idle in self._idle.values() for _, c in idle]
        conns += [*self._busy, *self._closing]
        self._closing = []
        self._idle.clear()
        self._busy.clear()
        for conn in conns:
            await _close_quietly(conn)

    async def __aenter__(self) -> FlatPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


_Key = tuple[bytes, bytes, int]


def _key(origin: httpcore.Origin) -> _Key:
    return (origin.scheme, origin.host, origin.port)


class _Released:
    """A response body that gives its connection back to the pool once closed."""

    def __init__(self, stream: Any, pool: FlatPool, conn: _Connection) -> None:
        self._stream = stream
        self._pool = pool
        self._conn: _Connection | None = conn

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        try:
            if hasattr(self._stream, "aclose"):
                await self._stream.aclose()
        finally:
            conn, self._conn = self._conn, None
            if conn is not None:
                await self._pool._release(conn)


async def _close_quietly(conn: httpcore.AsyncHTTPConnection) -> None:
    with contextlib.suppress(Exception):
        await conn.aclose()


class FlatTransport(httpx.AsyncHTTPTransport):
    """httpx's ``AsyncHTTPTransport`` over a :class:`FlatPool` (HTTP/1.1, no proxy)."""

    def __init__(
        self, *, limits: httpx.Limits, verify: Any = True, trust_env: bool = False
    ) -> None:
        if verify is True:
            verify = trust_store()
        super().__init__(verify=verify, trust_env=trust_env, limits=limits)
        # Two private attributes, on purpose (docs/internals.md, "Private parts of other
        # packages"; tests/test_dependency_internals.py fails if they move): the SSL context
        # httpcore's pool holds, and httpx's ``_pool`` itself, replaced so that httpx's own
        # request and exception mapping runs over the flat pool.
        ssl_context = getattr(self._pool, "_ssl_context", None)
        self._pool = FlatPool(  # type: ignore[assignment]
            ssl_context=ssl_context,
            max_keepalive=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
        )
