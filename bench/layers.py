#!/usr/bin/env python3
"""What each tierchain layer adds per request, in process, against Failover alone.

Each layer is put around (or inside) a Failover in front of a handler that
answers one SSE event and ``data: [DONE]`` at once, and timed against the bare
handler and against Failover alone, in interleaved rounds in one process (the
best round counts). It is the breakdown behind ``bench/overhead.py``'s
"added per request" figure.

Run: ``.venv/bin/python bench/layers.py`` (``--requests`` and ``--rounds`` to
change the sizes). Wall-clock figures on a shared virtual machine swing by half
between runs; instruction counts do not. ``--only NAME`` runs one stack, so that
``valgrind --tool=callgrind`` can count it: the difference between a run of
1,200 requests and one of 200, divided by 1,000, is its instructions per request.
Add ``--virtual-time`` for that count: the run is on tierchain's virtual clock
(``tierchain.testing.virtual_time``), so no timer falls due while the loop is busy,
and the count is the requests' own work rather than the timer wake-ups that
callgrind's fifty-fold slowness multiplies per request. ``--chunks N`` makes
each answer N data events: the difference between ``--chunks 51`` and
``--chunks 1``, divided by 50, is the count per streamed chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead

import tierchain
from tierchain import Backend, Failover, Routes

ROUTES = Routes({"echo": [Backend("a", "http://127.0.0.1:9"), Backend("b", "http://127.0.0.1:9")]})


def stacks() -> dict[str, Callable[[Any], Any]]:
    def failover(app: Any) -> Any:
        return Failover(app, routes=ROUTES)

    return {
        "bare handler": lambda h: h,
        "Failover": failover,
        "+ SaturationWatchdog": lambda h: failover(
            tierchain.SaturationWatchdog(h, slow_after=30.0)
        ),
        "+ Breaker": lambda h: failover(tierchain.Breaker(h)),
        "+ PreferBackend": lambda h: tierchain.PreferBackend(failover(h)),
        "+ Budget": lambda h: tierchain.Budget(failover(h), default=60.0),
        "+ Heartbeats": lambda h: tierchain.Heartbeats(failover(h), interval=10.0),
        "whole stack": lambda h: overhead.full_stack(h, ROUTES),
    }


async def main(requests: int, rounds: int, only: str | None, chunks: int = 1) -> None:
    apps = {
        name: make(overhead.make_handler(chunks))
        for name, make in stacks().items()
        if only is None or name.removeprefix("+ ") == only
    }
    if only is not None:
        await overhead.drive(apps[next(iter(apps))], requests)
        return
    for app in apps.values():
        await overhead.drive(app, 300)  # warm up
    best: dict[str, float] = dict.fromkeys(apps, float("inf"))
    for _ in range(rounds):
        for name, app in apps.items():
            best[name] = min(best[name], await overhead.drive(app, requests) / requests * 1e6)
    bare, alone = best["bare handler"], best["Failover"]
    print(f"tierchain {tierchain.__version__}; microseconds per request, best of {rounds} rounds")
    for name, us in best.items():
        versus = f"  {us - alone:+6.1f} vs Failover" if name.startswith("+") else ""
        print(f"  {name:22s} {us:7.1f}  adds {us - bare:6.1f} to the bare handler{versus}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=[n.removeprefix("+ ") for n in stacks()])
    parser.add_argument("--virtual-time", action="store_true", help="run on virtual time")
    parser.add_argument(
        "--chunks", type=int, default=1, help="SSE data events per answer (default 1)"
    )
    args = parser.parse_args()
    if not args.virtual_time:
        asyncio.run(main(args.requests, args.rounds, args.only, args.chunks))
    else:
        from tierchain.testing import virtual_time

        with virtual_time() as clock:
            loop = clock.new_event_loop()
            try:
                loop.run_until_complete(main(args.requests, args.rounds, args.only, args.chunks))
            finally:
                loop.close()
