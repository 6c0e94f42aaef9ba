"""Reading the request body (tierchain._body.read_body): a body that is there at once
is read with no deadline, and one that must be waited for has its deadline, counted
from the first read, whichever way the server's ``receive`` answers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tierchain._body import BodyTimeout, CallerGone, read_body
from tierchain.errors import BodyTooLarge

from .support import now, on_virtual_time

SCOPE: dict[str, Any] = {"type": "http", "headers": []}


def messages(*script: Any) -> Any:
    """A ``receive`` playing ``script``: a message, or a number of seconds to wait first."""
    queue = list(script)

    async def receive() -> Any:
        if queue and not isinstance(queue[0], dict):
            await asyncio.sleep(queue.pop(0))
        if not queue:
            await asyncio.Event().wait()  # nothing more, ever
        return queue.pop(0)

    return receive


def part(body: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


@on_virtual_time
async def test_a_body_in_one_message_at_once_is_read_whole() -> None:
    assert await read_body(SCOPE, messages(part(b"hello")), 100, within=5.0) == b"hello"
    assert await read_body(SCOPE, messages(part(b"")), 100, within=5.0) == b""
    assert await read_body(SCOPE, messages({"type": "http.request"}), 100, within=5.0) == b""


@on_virtual_time
async def test_a_body_that_is_waited_for_or_comes_in_parts_is_read_whole() -> None:
    for receive in (
        messages(1.0, part(b"hello")),
        messages(part(b"he", True), 1.0, part(b"llo")),
        messages(1.0, part(b"he", True), {"type": "http.other"}, part(b"llo")),
    ):
        assert await read_body(SCOPE, receive, 100, within=5.0) == b"hello"


@on_virtual_time
@pytest.mark.parametrize(
    "script",
    [
        (),  # nothing at all
        (part(b"he", True),),  # a first part at once, then nothing
        (1.0, part(b"he", True)),  # a first part after a wait, then nothing
    ],
)
async def test_a_body_not_whole_in_time_times_out_from_the_first_read(script: Any) -> None:
    started = now()
    with pytest.raises(BodyTimeout):
        await read_body(SCOPE, messages(*script), 100, within=5.0)
    assert now() - started == pytest.approx(5.0)


@on_virtual_time
async def test_no_deadline_without_within() -> None:
    task = asyncio.ensure_future(read_body(SCOPE, messages(100.0, part(b"late")), 100))
    assert await task == b"late"


@on_virtual_time
async def test_too_large_and_gone_whether_at_once_or_waited_for() -> None:
    for receive in (messages(part(b"x" * 11)), messages(1.0, part(b"x" * 11))):
        with pytest.raises(BodyTooLarge):
            await read_body(SCOPE, receive, 10, within=5.0)
    gone = {"type": "http.disconnect"}
    for receive in (messages(gone), messages(1.0, gone)):
        with pytest.raises(CallerGone):
            await read_body(SCOPE, receive, 10, within=5.0)


@on_virtual_time
async def test_a_cancellation_while_waiting_reaches_the_servers_receive() -> None:
    seen: list[str] = []

    async def receive() -> Any:
        try:
            await asyncio.sleep(10.0)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return part(b"never")

    task = asyncio.ensure_future(read_body(SCOPE, receive, 100, within=60.0))
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]


@on_virtual_time
async def test_a_receive_that_is_not_a_coroutine_is_awaited_as_it_is() -> None:
    def receive() -> Any:
        future = asyncio.get_running_loop().create_future()
        future.set_result(part(b"hello"))
        return future

    assert await read_body(SCOPE, receive, 100, within=5.0) == b"hello"
