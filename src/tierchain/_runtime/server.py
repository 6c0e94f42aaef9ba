"""Did the server put a chunked request's trailer fields among its headers already?

uvicorn's own httptools protocol (``HttpToolsProtocol``) appends a chunked request's trailer
fields to the very list it handed the app as ``scope["headers"]``. When the whole request
came in one read, that happened before the app ran: nothing in the scope tells the trailers
from the head's fields, and a trailer (``Authorization``, ``X-Forwarded-For``) would be
forwarded as a header. :func:`trailers_merged` tells when that may have happened to the
current request, so that the caller's head can be refused rather than forwarded: the task
runs uvicorn's httptools request cycle (its ``run_asgi`` coroutine, whose ``self`` is the
cycle), the connection's protocol does not drop trailers itself (``drops_trailers``, as
``tierchain.httptools_protocol.HttpToolsWithoutTrailers`` does), and the message was already
complete. A request whose body was still arriving when the app started gets its trailers
appended to the server's list after the head was copied (``tierchain._head``): harmless.

It reads uvicorn's undocumented cycle through the task's coroutine frame: a deliberate
divergence (docs/internals.md, private parts of other packages), asked only for a chunked
request; ``tests/test_dependency_internals.py`` fails if the cycle moves.
"""

from __future__ import annotations

import asyncio

__all__ = ["trailers_merged"]

_CYCLE_MODULE = "uvicorn.protocols.http.httptools_impl"


def trailers_merged() -> bool:
    """True when the current request is served by uvicorn's own httptools protocol and was
    read whole before the app ran: its trailer fields, if it had any, are in its headers."""
    task = asyncio.current_task()
    coro = task.get_coro() if task is not None else None
    if getattr(coro, "__qualname__", "") != "RequestResponseCycle.run_asgi":
        return False
    frame = getattr(coro, "cr_frame", None)
    cycle = frame.f_locals.get("self") if frame is not None else None
    if type(cycle).__module__ != _CYCLE_MODULE:
        return False
    transport = getattr(cycle, "transport", None)
    protocol = transport.get_protocol() if transport is not None else None
    if getattr(protocol, "drops_trailers", False):
        return False
    return getattr(cycle, "more_body", True) is False
