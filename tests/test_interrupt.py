"""Interruption: cancel one task with a reason, and own only that cancellation."""

from __future__ import annotations

import asyncio

import pytest

from tierchain._runtime.interrupt import Interruption


async def test_its_own_interruption_is_undone_and_the_reason_is_the_message():
    messages: list[object] = []

    async def work(interruption: Interruption) -> str:
        interruption.arm()
        asyncio.get_running_loop().call_soon(interruption.interrupt, "tierchain: why")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            messages.append(exc.args[0] if exc.args else None)
            assert interruption.ours()
            return "answered instead"
        return "not reached"

    interruption = Interruption()
    task = asyncio.create_task(work(interruption))
    assert await task == "answered instead"
    assert messages == ["tierchain: why"]
    assert task.cancelling() == 0


async def test_another_cancellation_pending_goes_on():
    async def work(interruption: Interruption) -> None:
        interruption.arm()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            assert not interruption.ours()  # the outer one is pending too
            raise

    interruption = Interruption()
    task = asyncio.create_task(work(interruption))
    await asyncio.sleep(0)
    task.cancel("an outer layer")  # (say, a shutdown)
    interruption.interrupt("tierchain: ours")
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_count_already_there_on_entry_is_the_baseline():
    # A task that arrives counting a cancellation someone swallowed without uncancel():
    # compared with 0, ours would look like someone else's.
    async def work() -> str:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # swallowed, never uncancelled
        assert task.cancelling() == 1
        interruption = Interruption.on()
        asyncio.get_running_loop().call_soon(interruption.interrupt, "tierchain: ours")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "ours" if interruption.ours() else "someone else's"
        return "not reached"

    assert await asyncio.create_task(work()) == "ours"


async def test_a_swallowed_interruption_is_undone_on_the_way_out_and_fires_once():
    async def work() -> tuple[bool, bool, int]:
        interruption = Interruption.on()
        interruption.interrupt("tierchain: first")
        interruption.interrupt("tierchain: second")  # a no-op: it fired already
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # the inner code swallowed it and returned
        task = asyncio.current_task()
        assert task is not None
        return interruption.swallowed(), interruption.swallowed(), task.cancelling()

    assert await asyncio.create_task(work()) == (True, False, 0)


async def test_one_beside_another_shares_its_task_and_baseline_but_not_its_state():
    async def work() -> tuple[bool, bool]:
        guard = Interruption.on()
        abort = Interruption.beside(guard)
        abort.interrupt("tierchain: the stream broke")
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            return guard.ours(), abort.ours()
        return False, False

    assert await asyncio.create_task(work()) == (False, True)
