"""What the benchmark scripts share: the README's gateway, a wait for a server to listen,
and a process's CPU time."""

from __future__ import annotations

import asyncio
import os
from typing import Any


def readme_gateway(
    tower: str,
    hosted: str,
    *,
    slow_after: float,
    stall_after: float,
    budget: float,
    interval: float,
    prompt_rate: float | str = "auto",
    **breaker: Any,
) -> Any:
    """The README's FastAPI stack in front of a Forwarder: ``tower``, then ``hosted``.

    ``prompt_rate`` is the watchdog's (0: off, for a tower that must be waited on however
    long its first token takes)."""
    from fastapi import FastAPI

    from tierchain import (
        Backend,
        Breaker,
        Budget,
        Failover,
        Forwarder,
        Heartbeats,
        PreferBackend,
        Routes,
        SaturationWatchdog,
    )

    routes = Routes(
        {
            "echo": [
                Backend(name="tower", url=tower, regime="local"),
                Backend(name="hosted", url=hosted, regime="hosted"),
            ]
        }
    )
    app = FastAPI()
    app.mount("/v1", Forwarder(connect_timeout=2.0))
    app.add_middleware(
        SaturationWatchdog,
        slow_after=slow_after,
        stall_after=stall_after,
        prompt_rate=prompt_rate,
    )
    app.add_middleware(Breaker, **breaker)
    app.add_middleware(Failover, routes=routes, paths=("/v1/",))
    app.add_middleware(PreferBackend)
    app.add_middleware(Budget, default=budget)
    app.add_middleware(Heartbeats, interval=interval)
    return app


async def wait_up(port: int, tries: int = 400) -> None:
    """Return once something accepts connections on loopback ``port`` (every 50 ms)."""
    for _ in range(tries):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        await writer.wait_closed()
        return
    raise RuntimeError(f"nothing listens on port {port}")


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) that process ``pid`` has used (Linux ``/proc``).

    The sum of its threads' run time in nanoseconds (``/proc/PID/task/*/schedstat``) where
    the kernel keeps it: ``/proc/PID/stat`` counts in clock ticks (10 ms), 0.05 % of a core
    over a 20 s window, as much as some of the differences measured with it. (A thread that
    ends between two readings takes its time with it: the gateways measured keep theirs.)
    """
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        pass
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
