"""The Forwarder's HTTP connection pool (`tierchain._connections`), over real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
import struct

import httpcore
import httpx
import pytest

from tierchain._connections import FlatTransport, NotSent

ANSWER = b'{"ok":true}'


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """Read one request (headers and a Content-Length body); False at the end of the stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return True


async def test_a_reused_connection_reset_after_the_backend_read_the_request_is_not_sent_again():
    """A backend that read the request on a reused keep-alive connection and then reset it
    (a paid backend that worked on it, or its idle timeout racing ours: the two look the
    same from here) gets it once: the pool raises instead of sending it again (issue 31)."""
    connections = 0
    seen = 0
    handled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, seen
        connections += 1
        served = 0
        while await _read_request(reader):
            seen += 1
            if served == 1:
                # The second request on this connection: read whole, then reset.
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
                break
            served += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
            )
            await writer.drain()
        writer.close()
        await writer.wait_closed()
        handled.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = FlatTransport(limits=httpx.Limits(max_keepalive_connections=4))
    error: Exception | None = None
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            first = await client.post(url, content=b'{"model":"echo"}')
            try:
                await client.post(url, content=b'{"model":"echo"}')
            except httpx.TransportError as exc:
                error = exc
        await asyncio.wait_for(handled.wait(), 1)
    finally:
        server.close()
        await server.wait_closed()
    assert (first.status_code, first.content) == (200, ANSWER)
    assert isinstance(error, httpx.ReadError | httpx.RemoteProtocolError)
    assert (seen, connections) == (2, 1)  # each request seen once; no second connection


async def test_an_idle_connection_the_backend_closed_is_dropped_before_anything_is_written():
    """A stale keep-alive (the backend closed it while idle) is found before the request
    goes out: the request is written once, on a new connection, and answered."""
    connections = 0
    seen = 0
    closed = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, seen
        connections += 1
        if await _read_request(reader):
            seen += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
            )
            await writer.drain()
        writer.close()  # the backend's idle timeout: closed after one answer
        await writer.wait_closed()
        closed.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = FlatTransport(limits=httpx.Limits(max_keepalive_connections=4))
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            first = await client.post(url, content=b'{"model":"echo"}')
            await asyncio.wait_for(closed.wait(), 1)
            for _ in range(20):  # let the close reach our idle socket
                await asyncio.sleep(0.01)
            second = await client.post(url, content=b'{"model":"echo"}')
    finally:
        server.close()
        await server.wait_closed()
    assert (first.status_code, second.status_code) == (200, 200)
    assert (seen, connections) == (2, 2)


async def test_a_new_connection_that_is_reset_is_not_tried_again():
    """Only a reused connection gets a second try: a backend that resets every request fails."""
    connections = 0
    handled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        if await _read_request(reader):
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        writer.close()
        await writer.wait_closed()
        handled.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = FlatTransport(limits=httpx.Limits(max_keepalive_connections=4))
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            try:
                await client.post(url, content=b'{"model":"echo"}')
            except httpx.TransportError as exc:
                error: Exception | None = exc
            else:
                error = None
        await asyncio.wait_for(handled.wait(), 1)
    finally:
        server.close()
        await server.wait_closed()
    assert isinstance(error, httpx.ReadError | httpx.RemoteProtocolError)
    assert connections == 1


async def test_a_connection_reset_before_the_request_was_written_says_it_was_not_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race a stale check cannot close: the backend resets an idle keep-alive just
    after the pool looked at it. The request's first write fails, so the backend never
    had it: the pool raises NotSent (under httpx's ReadError) and sends nothing again."""
    seen = 0
    reset = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        if await _read_request(reader):
            seen += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER)
            )
            await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # the idle connection reset while in our pool
        reset.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = FlatTransport(limits=httpx.Limits(max_keepalive_connections=4))
    error: Exception | None = None
    # Every look at the idle connection happens before the reset reaches it: none sees it.
    monkeypatch.setattr(httpcore.AsyncHTTPConnection, "has_expired", lambda self: False)
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await client.post(url, content=b'{"model":"echo"}')
            await asyncio.wait_for(reset.wait(), 1)
            for _ in range(20):  # let the reset reach our idle socket
                await asyncio.sleep(0.01)
            try:
                await client.post(url, content=b'{"model":"echo"}')
            except httpx.TransportError as exc:
                error = exc
    finally:
        server.close()
        await server.wait_closed()
    assert isinstance(error, httpx.ReadError | httpx.RemoteProtocolError)
    assert isinstance(error.__cause__, NotSent)
    assert seen == 1
