"""The Forwarder's connection pool, over real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
import struct

import httpx

from tierchain._pool import FlatTransport

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


async def test_a_keepalive_connection_the_server_closed_on_reuse_is_tried_once_more_anew():
    """A server whose idle timeout races ours resets a reused connection: a new one answers."""
    connections = 0
    handled = asyncio.Event()  # the second connection ended (the client closed it)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        served = 0
        while await _read_request(reader):
            if served == 1:
                # The second request on this connection: reset it, answering nothing.
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
        if connections == 2:
            handled.set()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport = FlatTransport(limits=httpx.Limits(max_keepalive_connections=4))
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            first = await client.post(url, content=b'{"model":"echo"}')
            second = await client.post(url, content=b'{"model":"echo"}')
        await asyncio.wait_for(handled.wait(), 1)
    finally:
        server.close()
        await server.wait_closed()
    assert (first.status_code, first.content) == (200, ANSWER)
    assert (second.status_code, second.content) == (200, ANSWER)
    assert connections == 2  # the reused one was reset; the answer came on a new one


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
