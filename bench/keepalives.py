#!/usr/bin/env python3
"""Heartbeats' own CPU per keepalive, in process: N waiting streams, an in-memory ``send``.

Run: ``.venv/bin/python bench/keepalives.py 5000`` (N streams, keepalive every 0.25 s, 2 s
measured). Through a real server most of a keepalive's cost is the server's own send; this
measures only what Heartbeats adds.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from tierchain import Heartbeats


async def main(n: int) -> None:
    release = asyncio.Event()
    lines = 0

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await release.wait()

    async def send(message: Any) -> None:
        nonlocal lines
        if message["type"] == "http.response.body":
            lines += 1

    async def receive() -> Any:
        await release.wait()
        return {"type": "http.disconnect"}

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": [(b"accept", b"text/event-stream")],
    }
    hb = Heartbeats(app, interval=0.25, commit_after=0.05)
    tasks = [asyncio.create_task(hb(dict(scope), receive, send)) for _ in range(n)]
    await asyncio.sleep(0.5)
    lines0, cpu0 = lines, time.process_time()
    await asyncio.sleep(2.0)
    cpu, written = time.process_time() - cpu0, lines - lines0
    print(
        f"{n} waiting streams: {written} keepalives in 2 s, {cpu:.3f} s of CPU, "
        f"{1e6 * cpu / max(1, written):.1f} us per keepalive"
    )
    release.set()
    await asyncio.wait(tasks)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5000))
