#!/usr/bin/env python3
"""A soak: N streaming callers for T minutes through the README stack; the tower fails at random.

The gateway (Heartbeats, Budget, PreferBackend, Failover, Breaker,
SaturationWatchdog, Forwarder under FastAPI, as in the README; breaker
cooldowns shortened) runs under uvicorn in its own process. The tower fails
each request in one of 15 ways, picked at random: refused (its listener is
closed for a moment now and then), reset, silence, headers then silence,
mid-stream reset, mid-stream stall, trickle, 429 and 503 with ``Retry-After``,
500, garbage, truncated, Content-Length framed, no ``[DONE]``, clean. Hosted
is healthy. Both are the test suite's fake backend (tests/support.py).

Every answer is checked byte for byte, heartbeat lines aside: it must be the
tower's or hosted's stream exactly (completed), the tower's first events then
hosted finishing the answer in the tower's envelope (continued), or a prefix of one of them
with at least one data event followed by one error event (lost after commit,
by design: the caller already had data when the tower broke). Anything else
with no data is a loss that should not have been; anything that is neither is
corrupted.

Run: ``python3 dev.py soak`` (or ``.venv/bin/python bench/soak.py --callers 200
--minutes 5``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support import (  # noqa: E402 (the repository's own fake backend)
    Exchange,
    FakeBackend,
    answers,
    chat_request,
    fault,
    openai_stream,
    streams,
)

TOWER_PIECES = ["tower-one", "tower-two", "tower-three"]
HOSTED_PIECES = ["hosted-one", "hosted-two", "hosted-three"]
TOWER = b"".join(openai_stream(TOWER_PIECES))
HOSTED = b"".join(openai_stream(HOSTED_PIECES))
HEARTBEAT = re.compile(rb': \{"state":[^\r\n]*\}\n')
ERROR_EVENT = re.compile(rb'data: \{"error":[^\n]*\}\n\n')

KINDS = [
    "refused",
    "reset",
    "silence",
    "headers_silence",
    "midstream_reset",
    "midstream_stall",
    "trickle",
    "http_429",
    "http_503",
    "http_500",
    "garbage",
    "truncated",
    "content_length",
    "no_done",
    "clean",
]


# -- the tower ---------------------------------------------------------------------------


async def _reset_at_once(ex: Exchange) -> None:
    await ex.reset()


async def _silence(ex: Exchange) -> None:
    await ex.wait_closed_by_peer()
    ex.finished = True


async def _headers_silence(ex: Exchange) -> None:
    await ex.head()
    await ex.wait_closed_by_peer()
    ex.finished = True


def tower_scripts() -> dict[str, Any]:
    pieces = TOWER_PIECES
    return {
        "reset": _reset_at_once,
        "silence": _silence,
        "headers_silence": _headers_silence,
        "midstream_reset": fault("reset", pieces),
        "midstream_stall": fault("stall", pieces),
        "trickle": fault("trickle", pieces),
        "http_429": answers(429, **{"retry-after": "1"}),
        "http_503": answers(503, **{"retry-after": "1"}),
        "http_500": answers(500),
        "garbage": fault("garbage", pieces),
        "truncated": fault("close", pieces),
        "content_length": fault("content_length", pieces),
        "no_done": fault("no_done", pieces),
        "clean": streams(pieces),
    }


class Tower:
    """The fake backend, failing at random; ``refused`` closes its listener for a moment."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.scripts = tower_scripts()
        self.backend = FakeBackend("tower", self.script)
        self.picked: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._refusing = False

    async def script(self, ex: Exchange) -> None:
        kind = self.rng.choice([k for k in KINDS if k != "refused"])
        self.picked[kind] += 1
        await self.scripts[kind](ex)

    async def refuse_now_and_then(self, stop: asyncio.Event) -> None:
        """Close the listener for 50-300 ms about once a second (connections are refused)."""
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(0.3, 1.5))
            server = self.backend._server
            if server is None or stop.is_set():
                return
            server.close()
            self.picked["refused"] += 1
            await asyncio.sleep(self.rng.uniform(0.05, 0.3))
            self.backend._server = await asyncio.start_server(
                self.backend._handle, "127.0.0.1", self.backend.port
            )


# -- the gateway -----------------------------------------------------------------------------


def build_gateway(tower: str, hosted: str) -> Any:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from readme_stack import readme_gateway

    app = readme_gateway(
        tower,
        hosted,
        slow_after=1.5,
        stall_after=2.0,
        budget=60.0,
        interval=2.0,
        failure_cooldown=5.0,
        saturation_cooldown=10.0,
    )

    async def gateway(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/_soak/stats":
            body = json.dumps(own_stats()).encode()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        await app(scope, receive, send)

    return gateway


def own_stats() -> dict[str, Any]:
    """This process's tasks, open fds and RSS (and its breakers' openings)."""
    from prometheus_client import REGISTRY

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    opened: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.name == "tierchain_breaker_transitions":
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels.get("to") == "open":
                    opened[sample.labels["backend"]] = sample.value
    tasks = asyncio.all_tasks()
    return {
        "tasks": len(tasks),
        "task_names": sorted(task.get_name() for task in tasks),
        "fds": len(os.listdir("/proc/self/fd")),
        "rss": rss,
        "breaker_opened": opened,
    }


SERVER_KEEP_ALIVE = 30
"""Seconds the gateway's uvicorn keeps an idle connection (uvicorn's default is 5)."""


def run_gateway(port: int, tower: str, hosted: str) -> None:
    import uvicorn

    logging.getLogger("tierchain").setLevel(os.environ.get("SOAK_LOG_LEVEL", "ERROR"))
    uvicorn.run(
        build_gateway(tower, hosted),
        host="127.0.0.1",
        port=port,
        log_level=os.environ.get("SOAK_SERVER_LOG_LEVEL", "critical").lower(),
        access_log=False,
        lifespan="off",
        backlog=2048,
        # Idle keep-alive connections: well past the callers' 2 s (see soak()), so that a
        # caller starved of CPU, which finishes reading an answer seconds after the server
        # sent it, never sends its next request on a connection the server is closing.
        timeout_keep_alive=SERVER_KEEP_ALIVE,
    )


# -- the callers ----------------------------------------------------------------------------------


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    continued: int = 0
    lost_by_design: int = 0
    lost_should_not: int = 0
    corrupted: int = 0
    ttfd: list[float] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)

    def note(self, what: str, detail: str) -> None:
        if len(self.samples) < 8:
            self.samples.append(f"{what}: {detail}")


def continued(body: bytes) -> bool:
    """The tower's first whole events (at least one with data), then hosted finishing the
    answer in the tower's envelope (a continuation: the fake hosted tier answers its own
    text whatever partial answer it is sent), one finish and one ``data: [DONE]``."""
    if not body.endswith(b"data: [DONE]\n\n") or body.count(b"data: [DONE]") != 1:
        return False
    prefix = b""
    for event in openai_stream(TOWER_PIECES)[:-2]:  # (not its finish, not [DONE])
        prefix += event
        if not body.startswith(prefix):
            return False
        rest = body[len(prefix) : -len(b"data: [DONE]\n\n")].split(b"\n\n")
        try:
            chunks = [json.loads(e[len(b"data: ") :]) for e in rest if e.startswith(b"data: ")]
        except ValueError:
            return False
        if not chunks or chunks[-1]["choices"][0]["finish_reason"] != "stop":
            continue
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        # (Asked in words, hosted starts a fresh message: the gateway puts a space between
        # the tower's last word and its first, docs/continuation.md#the-seam.)
        if text.removeprefix(" ") == "".join(HOSTED_PIECES):
            return True
    return False


def classify(status: int, raw: bytes) -> str:
    """completed | continued | lost_by_design | lost_should_not | corrupted, for one answer."""
    if status != 200:
        return "lost_should_not"
    body = HEARTBEAT.sub(b"", raw)
    if body in (TOWER, HOSTED):
        return "completed"
    if continued(body):
        return "continued"
    error = ERROR_EVENT.search(body)
    if error is None or error.end() != len(body):
        return "lost_should_not" if b"data:" not in body else "corrupted"
    head = body[: error.start()]
    if not head:
        return "lost_should_not"  # an error with no data: the chain should have carried on
    for whole in (TOWER, HOSTED):
        events = openai_stream(TOWER_PIECES if whole is TOWER else HOSTED_PIECES)
        prefix = b""
        for event in events:
            prefix += event
            if head == prefix:
                return "lost_by_design"
    return "corrupted"


async def caller(url: str, client: httpx.AsyncClient, until: float, tally: Tally) -> None:
    body = chat_request()
    while time.monotonic() < until:
        tally.requests += 1
        t0 = time.monotonic()
        raw = b""
        status = 0
        first: float | None = None
        try:
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=body
            ) as response:
                status = response.status_code
                async for chunk in response.aiter_raw():
                    raw += chunk
                    if first is None and b"data:" in HEARTBEAT.sub(b"", raw):
                        first = time.monotonic() - t0
        except httpx.HTTPError as exc:
            what = "lost_should_not" if b"data:" not in HEARTBEAT.sub(b"", raw) else "corrupted"
            setattr(tally, what, getattr(tally, what) + 1)
            tally.note(what, f"{exc!r} after {len(raw)} bytes")
            continue
        what = classify(status, raw)
        setattr(tally, what, getattr(tally, what) + 1)
        if what in ("lost_should_not", "corrupted"):
            tally.note(what, f"status {status}: {raw[-300:]!r}")
        if first is not None and what != "corrupted":
            tally.ttfd.append(first)


async def stats(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as client:
        result: dict[str, Any] = (await client.get(url + "/_soak/stats")).json()
        return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def soak(callers: int, seconds: float, seed: int = 1, settle: float = 8.0) -> dict[str, Any]:
    """Run the soak; returns the figures (see the module docstring)."""
    tower = Tower(seed)
    stop = asyncio.Event()
    async with tower.backend, FakeBackend("hosted", streams(HOSTED_PIECES)) as hosted:
        port = free_port()
        # Its own process (the figures are the gateway's alone), started from this file.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--gateway", str(port), tower.backend.url, hosted.url
        )
        url = f"http://127.0.0.1:{port}"
        refuser: asyncio.Task[None] | None = None
        try:
            for _ in range(400):
                try:
                    start = await stats(url)
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
            else:
                raise RuntimeError("the gateway did not start")
            tally = Tally()
            refuser = asyncio.create_task(tower.refuse_now_and_then(stop))
            # A client must give up an idle connection before the server does (here
            # SERVER_KEEP_ALIVE, counted from when the server sent the answer, not from when
            # the caller read it), or a request sent as the server closes it is lost with 0
            # bytes read: the HTTP/1.1 keep-alive race, not a loss of the gateway's.
            limits = httpx.Limits(
                max_connections=callers, max_keepalive_connections=callers, keepalive_expiry=2.0
            )
            timeout = httpx.Timeout(120.0, connect=10.0)
            until = time.monotonic() + seconds
            async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
                await asyncio.gather(*(caller(url, client, until, tally) for _ in range(callers)))
            stop.set()
            await refuser
            # Settle: idle pooled connections are closed after their keep-alive expiry.
            end = await stats(url)
            deadline = time.monotonic() + settle
            while time.monotonic() < deadline and (
                end["fds"] > start["fds"] or end["tasks"] > start["tasks"]
            ):
                await asyncio.sleep(0.25)
                end = await stats(url)
        finally:
            stop.set()
            if refuser is not None and not refuser.done():
                refuser.cancel()
            proc.terminate()
            await proc.wait()
    ttfd = sorted(tally.ttfd)
    return {
        "callers": callers,
        "seconds": seconds,
        "requests": tally.requests,
        "completed": tally.completed,
        "continued": tally.continued,
        "lost_after_commit_by_design": tally.lost_by_design,
        "lost_should_not_have_been": tally.lost_should_not,
        "corrupted": tally.corrupted,
        "ttfd_p50_s": round(statistics.median(ttfd), 3) if ttfd else None,
        "ttfd_p99_s": round(ttfd[int(len(ttfd) * 0.99) - 1], 3) if ttfd else None,
        "start": {k: start[k] for k in ("rss", "tasks", "fds", "task_names")},
        "end": {k: end[k] for k in ("rss", "tasks", "fds", "task_names")},
        "breaker_opened": end["breaker_opened"],
        "faults": tower.picked,
        "samples": tally.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, default=200)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--gateway", nargs=3, help=argparse.SUPPRESS)  # PORT TOWER HOSTED
    args = parser.parse_args()
    if args.gateway:
        port, tower, hosted = args.gateway
        return run_gateway(int(port), tower, hosted)
    r = asyncio.run(soak(args.callers, args.minutes * 60, args.seed))
    if args.json:
        print(json.dumps(r, indent=2))
        return
    mb = 2**20
    print(f"{r['callers']} callers for {r['seconds']:.0f} s through the README stack")
    print(
        f"  requests {r['requests']}, completed {r['completed']}, "
        f"continued on hosted {r['continued']}"
    )
    print(
        f"  lost: {r['lost_after_commit_by_design']} after commit (by design), "
        f"{r['lost_should_not_have_been']} that should not have been"
    )
    print(f"  corrupted {r['corrupted']}")
    print(f"  time to first data event: p50 {r['ttfd_p50_s']} s, p99 {r['ttfd_p99_s']} s")
    s, e = r["start"], r["end"]
    print(
        f"  gateway RSS {s['rss'] / mb:.1f} -> {e['rss'] / mb:.1f} MB, tasks {s['tasks']} -> "
        f"{e['tasks']}, fds {s['fds']} -> {e['fds']}"
    )
    print(f"  breakers opened: {r['breaker_opened'] or 'none'}")
    print(f"  tower faults: {r['faults']}")
    for sample in r["samples"]:
        print(f"  sample {sample}")


if __name__ == "__main__":
    main()
