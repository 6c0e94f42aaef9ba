"""Helpers for testing a gateway built from tierchain.

:func:`virtual_time` switches the clock every tierchain layer reads (windows, budgets,
keepalive gaps, deadlines, leases) to a :class:`VirtualClock`, and restores the real one
when the block ends, as stamina's ``set_testing`` does for retries. Run the test on the
clock's own event loop, so that asyncio's timers (``asyncio.sleep``, ``asyncio.timeout``,
uvicorn's and httpx's timeouts) keep the same time::

    import asyncio
    from tierchain.testing import virtual_time

    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(600)  # ten virtual minutes, no real wait
        return loop.time() - started

    with virtual_time() as clock, asyncio.Runner(loop_factory=clock.new_event_loop) as runner:
        assert runner.run(scenario()) == 600

Time passes only while every coroutine waits: when the loop has nothing to run and no
real I/O is ready, the clock moves to its next timer. So a machine that is busy makes
the test slower, never makes a window close early. Keep servers in the test's own loop
(uvicorn on loopback, fake upstreams): a subprocess server cannot be waited for in
virtual time.
"""

from __future__ import annotations

from ._runtime.clock import VirtualClock, virtual_time

__all__ = ["VirtualClock", "virtual_time"]
