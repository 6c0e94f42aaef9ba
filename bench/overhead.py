#!/usr/bin/env python3
"""How much tierchain costs, against the same host with no tierchain, in one run.

Two measurements, each as a ratio against a bare app measured in the same run:

1. In process (no sockets, so nothing but the middleware is measured):
   microseconds added per request by the whole stack, and streamed chunks per
   second through it, for a handler that answers at once.
2. Over loopback (real uvicorn servers, a real upstream): requests per second
   and streamed chunks per second through ``Failover`` + ``Forwarder`` (and
   through the whole stack) against a bare forwarding proxy on the same host.

Run: ``python3 dev.py bench`` (or ``.venv/bin/python bench/overhead.py``).
``--quick`` shortens every phase (for CI smoke runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import httpx
from readme_stack import cpu_seconds, wait_up

import tierchain
from tierchain import Backend, Failover, Forwarder, Routes

CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"tok"}}]}\n\n'
)
BODY = json.dumps(
    {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()


# -- stacks -------------------------------------------------------------------------


def full_stack(inner: Any, routes: Routes) -> Any:
    """Every tierchain layer that exists, in the brief's order, around ``inner``."""
    app = inner
    layers: list[tuple[str, dict[str, Any]]] = [
        ("SaturationWatchdog", {"slow_after": 30.0}),
        ("Breaker", {}),
    ]
    for name, opts in layers:
        cls = getattr(tierchain, name, None)
        if cls is not None:
            app = cls(app, **opts)
    app = Failover(app, routes=routes)
    for name, opts in [
        ("PreferBackend", {}),
        ("Budget", {"default": 60.0}),
        ("Heartbeats", {"interval": 10.0}),
    ]:
        cls = getattr(tierchain, name, None)
        if cls is not None:
            app = cls(app, **opts)
    return app


def present_layers() -> list[str]:
    names = ["Heartbeats", "Budget", "PreferBackend", "Breaker", "SaturationWatchdog"]
    return ["Failover", *[n for n in names if hasattr(tierchain, n)]]


# -- 1. in process ----------------------------------------------------------------


def make_handler(chunks: int) -> Callable[..., Any]:
    async def handler(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(chunks):
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return handler


async def drive(app: Any, n: int) -> float:
    """Seconds for ``n`` sequential requests through ``app`` with in-memory receive/send."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]

    async def send(message: Any) -> None:
        return None

    t0 = time.perf_counter()
    for _ in range(n):
        done = asyncio.Event()
        sent = False

        async def receive(done: asyncio.Event = done) -> Any:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "headers": headers,
        }
        await app(scope, receive, send)
        done.set()
        # Give the loop a turn, as a server does between requests: it runs what the
        # request left scheduled and clears cancelled timers. The bare app pays it too.
        await asyncio.sleep(0)
    return time.perf_counter() - t0


async def in_process(requests: int, chunks: int, rounds: int) -> dict[str, float]:
    routes = Routes(
        {"echo": [Backend("a", "http://127.0.0.1:9"), Backend("b", "http://127.0.0.1:9")]}
    )
    one = make_handler(1)
    many = make_handler(chunks)
    bare_req, stack_req, bare_stream, stack_stream = [], [], [], []
    stack_one, stack_many = full_stack(one, routes), full_stack(many, routes)
    await drive(one, 200)  # warm up
    await drive(stack_one, 200)
    for _ in range(rounds):
        bare_req.append(await drive(one, requests) / requests)
        stack_req.append(await drive(stack_one, requests) / requests)
        bare_stream.append(chunks / await drive(many, 1))
        stack_stream.append(chunks / await drive(stack_many, 1))
    bare_us, stack_us = min(bare_req) * 1e6, min(stack_req) * 1e6
    return {
        "bare_us_per_request": bare_us,
        "stack_us_per_request": stack_us,
        "added_us_per_request": stack_us - bare_us,
        "bare_chunks_per_s": max(bare_stream),
        "stack_chunks_per_s": max(stack_stream),
        "chunk_throughput_ratio": max(stack_stream) / max(bare_stream),
    }


# -- 2. over loopback -------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def upstream_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    chunks = int(dict(scope["headers"]).get(b"x-chunks", b"1"))
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    payload = CHUNK * 8  # the upstream writes a few events per write, as real servers do
    for _ in range(max(1, chunks // 8)):
        await send({"type": "http.response.body", "body": payload, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


class BareProxy:
    """The same host with no tierchain: forward to one upstream with httpx, streaming."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.client: httpx.AsyncClient | None = None

    async def request(self, scope: Any, receive: Any) -> httpx.Request:
        """The caller's request, read whole, as one to the upstream."""
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=None)
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"host", b"content-length")]
        return self.client.build_request(
            scope["method"], self.upstream + scope["path"], headers=headers, content=body
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = await self.request(scope, receive)
        assert self.client is not None
        response = await self.client.send(request, stream=True)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k.lower(), v)
                        for k, v in response.headers.raw
                        if k.lower() not in (b"transfer-encoding", b"connection")
                    ],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


def _serve(kind: str, port: int, upstream_port: int) -> None:
    import uvicorn

    upstream = f"http://127.0.0.1:{upstream_port}"
    app: Any
    if kind == "upstream":
        app = upstream_app
    elif kind == "bare":
        app = BareProxy(upstream)
    else:
        routes = Routes({"echo": [Backend("up", upstream)]})
        forwarder = Forwarder()
        app = (
            Failover(forwarder, routes=routes)
            if kind == "failover"
            else full_stack(forwarder, routes)
        )
    uvicorn.run(
        app, host="127.0.0.1", port=port, log_level="error", access_log=False, lifespan="off"
    )


async def load(url: str, requests: int, concurrency: int, chunks: int) -> tuple[float, float]:
    """(requests per second, chunks per second) for ``requests`` POSTs at ``concurrency``."""
    queue = iter(range(requests))
    received = 0
    headers = {"content-type": "application/json", "x-chunks": str(chunks)}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:

        async def worker() -> None:
            nonlocal received
            for _ in queue:
                async with client.stream("POST", url, content=BODY, headers=headers) as r:
                    async for raw in r.aiter_raw():
                        received += raw.count(b"data:")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return requests / elapsed, received / elapsed


def loopback(requests: int, stream_requests: int, chunks: int, rounds: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    up_port = _free_port()
    procs = [ctx.Process(target=_serve, args=("upstream", up_port, up_port), daemon=True)]
    ports = {kind: _free_port() for kind in ("bare", "failover", "stack")}
    gateways = {
        kind: ctx.Process(target=_serve, args=(kind, port, up_port), daemon=True)
        for kind, port in ports.items()
    }
    procs += list(gateways.values())
    for p in procs:
        p.start()
    results: dict[str, dict[str, list[float]]] = {
        k: {"rps": [], "cps": [], "cpu": [], "chunks": []} for k in ports
    }
    try:

        async def run() -> None:
            for port in [up_port, *ports.values()]:
                await wait_up(port, tries=200)
            for port in ports.values():  # warm-up
                await load(f"http://127.0.0.1:{port}/v1/chat/completions", 100, 8, 1)
            for _ in range(rounds):
                for kind, port in ports.items():
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    rps, _ = await load(url, requests, 8, 1)
                    pid = gateways[kind].pid
                    assert pid is not None
                    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
                    _, cps = await load(url, stream_requests, 2, chunks)
                    results[kind]["cpu"].append(cpu_seconds(pid) - cpu0)
                    results[kind]["chunks"].append(cps * (time.perf_counter() - t0))
                    results[kind]["rps"].append(rps)
                    results[kind]["cps"].append(cps)

        asyncio.run(run())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)
    out: dict[str, float] = {}
    for kind in ports:
        out[f"{kind}_requests_per_s"] = statistics.median(results[kind]["rps"])
        out[f"{kind}_chunks_per_s"] = statistics.median(results[kind]["cps"])
        # The spread between rounds: on a small machine the client, the gateway and
        # the upstream share the cores, and a ratio inside it is not a difference.
        out[f"{kind}_chunks_spread"] = (max(results[kind]["cps"]) - min(results[kind]["cps"])) / (
            out[f"{kind}_chunks_per_s"]
        )
    for kind in ports:
        # The gateway's own CPU per streamed chunk: what caps its throughput once the
        # cores are busy, and far steadier than wall-clock rates on a shared machine.
        out[f"{kind}_chunks_per_cpu_s"] = sum(results[kind]["chunks"]) / max(
            sum(results[kind]["cpu"]), 1e-9
        )
    for kind in ("failover", "stack"):
        out[f"{kind}_chunks_per_cpu_ratio"] = (
            out[f"{kind}_chunks_per_cpu_s"] / out["bare_chunks_per_cpu_s"]
        )
        out[f"{kind}_request_ratio"] = out[f"{kind}_requests_per_s"] / out["bare_requests_per_s"]
        out[f"{kind}_chunk_ratio"] = out[f"{kind}_chunks_per_s"] / out["bare_chunks_per_s"]
        # Paired by round (each against the bare proxy measured just before it): the
        # machine's drift between rounds cancels out.
        paired = [
            mine / bare
            for mine, bare in zip(results[kind]["cps"], results["bare"]["cps"], strict=True)
        ]
        out[f"{kind}_chunk_ratio_paired"] = statistics.median(paired)
        out[f"{kind}_chunk_ratio_paired_min"] = min(paired)
        out[f"{kind}_chunk_ratio_paired_max"] = max(paired)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short phases (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--skip-loopback", action="store_true")
    args = parser.parse_args()
    q = args.quick
    print(
        f"tierchain {tierchain.__version__}; python {sys.version.split()[0]}; "
        f"{os.cpu_count()} cpus; layers: {', '.join(present_layers())}",
        flush=True,
    )
    inproc = asyncio.run(in_process(500 if q else 5000, 2000 if q else 20000, 2 if q else 5))
    print("\n[in process] whole stack vs the bare handler")
    print(
        f"  per request: bare {inproc['bare_us_per_request']:.1f} us, "
        f"stack {inproc['stack_us_per_request']:.1f} us, "
        f"added {inproc['added_us_per_request']:.1f} us"
    )
    print(
        f"  streamed chunks/s: bare {inproc['bare_chunks_per_s']:,.0f}, "
        f"stack {inproc['stack_chunks_per_s']:,.0f}, "
        f"ratio {inproc['chunk_throughput_ratio']:.3f}"
    )
    results: dict[str, Any] = {"in_process": inproc}
    if not args.skip_loopback:
        lb = loopback(200 if q else 2000, 10 if q else 60, 800 if q else 4000, 1 if q else 5)
        results["loopback"] = lb
        print("\n[over loopback] uvicorn gateway -> uvicorn upstream, vs a bare httpx proxy")
        for kind in ("bare", "failover", "stack"):
            print(
                f"  {kind:9s} {lb[kind + '_requests_per_s']:8,.0f} req/s  "
                f"{lb[kind + '_chunks_per_s']:10,.0f} chunks/s  "
                f"(spread between rounds {lb[kind + '_chunks_spread']:.0%})"
            )
        for kind in ("failover", "stack"):
            print(
                f"  {kind:9s} ratio: requests {lb[kind + '_request_ratio']:.3f}, "
                f"chunks {lb[kind + '_chunk_ratio']:.3f}; chunks paired by round "
                f"{lb[kind + '_chunk_ratio_paired']:.3f} "
                f"({lb[kind + '_chunk_ratio_paired_min']:.3f}-"
                f"{lb[kind + '_chunk_ratio_paired_max']:.3f}); chunks per gateway "
                f"CPU-second {lb[kind + '_chunks_per_cpu_ratio']:.3f}"
            )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
