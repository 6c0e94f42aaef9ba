#!/usr/bin/env python3
"""A pool's picker against round-robin and random, with fake replicas that cache and queue.

Each fake replica (all of them in one uvicorn process, one port each) models the
two facts a picker can exploit:

- a **prefix cache**: it remembers the prompts it answered (the most recent
  ``--cache`` of them); a new prompt whose leading messages it has seen costs
  only the prefill of the rest (``PER_BYTE`` seconds a byte uncached, a tenth of
  that cached);
- a **queue**: ``SLOTS`` requests run at once, the next wait for a slot, and
  each running request slows the others' prefill (``CONTENTION`` per extra one).

Clients hold conversations: a shared system prompt, then turns that each repeat
the whole history, ``--concurrency`` conversations at a time. Turn by turn a
conversation alternates between **two gateway processes** (tierchain
``Failover`` + ``Forwarder``) that share one Redis (a throwaway redis-server on
loopback; without one, a single gateway on a MemoryStore, and the output says
so). For each pool size it compares three ways of choosing the replica:

- ``tierchain``: the route is a ``Pool`` of the replicas, picked by the gateway
  (live in-flight counts, learned time to first data, prefix affinity through
  the shared store);
- ``round-robin``: the client sends turn after turn to the next replica's own
  route (one counter across both gateways, as good as round-robin gets);
- ``random``: a replica at random per request.

It reports the time to first data (p50, p99, seconds, measured by the client),
the cache-hit rate (the share of turns after the first whose history the chosen
replica had cached) and how the requests spread over the replicas.

Run: ``.venv/bin/python bench/pools.py`` (``--quick`` for a short smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import httpx
from readme_stack import wait_up

PER_BYTE = 20e-6  # seconds of prefill per uncached prompt byte
CACHED_SHARE = 0.1  # a cached byte costs this share of an uncached one
SLOTS = 4  # requests a replica runs at once
CONTENTION = 0.25  # each other running request slows a prefill by this share
SYSTEM = "You are a careful assistant. " * 140  # about 4 KiB, shared by every conversation
TURN = "Please look at this part of the file and say what it does. " * 17  # about 1 KiB
ANSWER = "It reads the configuration and starts the server. " * 10  # about 0.5 KiB
THINK = 0.05  # seconds, at most, between a turn's answer and the next turn (at random)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _listening() -> socket.socket:
    """A socket bound to a free loopback port and listening, handed to the process that
    serves on it: no other process can take its port between the pick and the bind."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


# -- the fake replicas ---------------------------------------------------------------


def _prefixes(messages: list[Any]) -> list[tuple[str, int]]:
    """(hash, bytes) of each leading run of messages."""
    h = hashlib.blake2b(digest_size=16)
    out, size = [], 0
    for message in messages:
        block = json.dumps(message, sort_keys=True).encode()
        h.update(block)
        size += len(block)
        out.append((h.hexdigest(), size))
    return out


class Replica:
    """One fake model server: a prefix cache and a queue."""

    def __init__(self, name: str, cache: int) -> None:
        self.name = name
        self.cache: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.capacity = cache
        self.slots = asyncio.Semaphore(SLOTS)
        self.running = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        messages = json.loads(body)["messages"]
        prefixes = _prefixes(messages)
        whole = prefixes[-1][1]
        cached = max((size for key, size in prefixes if key in self.cache), default=0)
        history = prefixes[-2][0] if len(prefixes) > 1 else None
        hit = history is not None and history in self.cache
        async with self.slots:
            self.running += 1
            try:
                slow = 1 + CONTENTION * (self.running - 1)
                prefill = ((whole - cached) + cached * CACHED_SHARE) * PER_BYTE * slow
                await asyncio.sleep(prefill)
                headers = [
                    (b"content-type", b"text/event-stream"),
                    (b"x-replica", self.name.encode()),
                    (b"x-cache", b"hit" if hit else b"miss"),
                ]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}}]}
                for _ in range(3):
                    data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                    await asyncio.sleep(0.005)
                done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
                tail = b"data: " + json.dumps(done).encode() + b"\n\ndata: [DONE]\n\n"
                await send({"type": "http.response.body", "body": tail})
            finally:
                self.running -= 1
        # What it holds now: the prompt, and its own answer after it (as the client will
        # send it back in the next turn).
        turn = sum(1 for m in messages if m.get("role") == "user") - 1
        answer = {"role": "assistant", "content": f"{ANSWER} ({turn})"}
        for key, _ in _prefixes([*messages, answer]):
            self.cache[key] = None
            self.cache.move_to_end(key)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


def _replicas(socks: list[socket.socket], cache: int) -> None:
    import uvicorn

    async def main() -> None:
        serving = []
        for i, sock in enumerate(socks):
            config = uvicorn.Config(
                Replica(f"r{i}", cache), log_level="error", access_log=False, lifespan="off"
            )
            serving.append(uvicorn.Server(config).serve(sockets=[sock]))
        await asyncio.gather(*serving)

    asyncio.run(main())


# -- the gateways ----------------------------------------------------------------


def _gateway(sock: socket.socket, replica_ports: list[int], store_url: str | None) -> None:
    import uvicorn

    from tierchain import Backend, Failover, Forwarder, MemoryStore, Pool, RedisStore, Routes

    backends = [
        Backend(name=f"r{i}", url=f"http://127.0.0.1:{p}") for i, p in enumerate(replica_ports)
    ]
    chains: dict[str, list[Any]] = {"pool": [Pool(name="pool", backends=backends)]}
    for backend in backends:
        chains[backend.name] = [backend]
    store = RedisStore(store_url) if store_url else MemoryStore()
    app = Failover(Forwarder(), routes=Routes(chains), store=store)
    config = uvicorn.Config(app, log_level="error", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


# -- the callers -------------------------------------------------------------------


async def _conversation(
    c: int,
    turns: int,
    client: httpx.AsyncClient,
    gateways: list[str],
    choose: Any,
    results: list[tuple[int, float, bool, str]],
    think: random.Random,
) -> None:
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {c} turn {t}. {TURN}"})
        body = json.dumps({"model": choose(), "stream": True, "messages": messages})
        url = gateways[t % len(gateways)] + "/v1/chat/completions"
        start = time.perf_counter()
        first = None
        async with client.stream("POST", url, content=body) as r:
            async for raw in r.aiter_raw():
                if first is None and b"data:" in raw:
                    first = time.perf_counter() - start
            replica = r.headers.get("x-replica", "?")
            hit = r.headers.get("x-cache") == "hit"
        assert r.status_code == 200, r.status_code
        results.append((t, first if first is not None else float("nan"), hit, replica))
        messages.append({"role": "assistant", "content": f"{ANSWER} ({t})"})
        await asyncio.sleep(think.uniform(0, THINK))  # the caller reads, then types


async def _load(
    gateways: list[str], mode: str, replicas: int, conversations: int, turns: int, parallel: int
) -> list[tuple[int, float, bool, str]]:
    results: list[tuple[int, float, bool, str]] = []
    counter = itertools.count()
    rng = random.Random(7)
    think = random.Random(11)

    def choose() -> str:
        if mode == "tierchain":
            return "pool"
        if mode == "round-robin":
            return f"r{next(counter) % replicas}"
        return f"r{rng.randrange(replicas)}"

    queue = iter(range(conversations))
    limits = httpx.Limits(max_connections=parallel * 2, max_keepalive_connections=parallel * 2)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker() -> None:
            for c in queue:
                await _conversation(c, turns, client, gateways, choose, results, think)

        await asyncio.gather(*(worker() for _ in range(parallel)))
    return results


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _start_redis() -> tuple[subprocess.Popen[bytes] | None, str | None]:
    binary = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if binary is None:
        return None, None
    for _ in range(5):  # its port taken meanwhile (by another process's connection): another
        port = _free_port()
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        proc = subprocess.Popen(
            [*cmd, "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(400):  # up within 20 s, or exited (its port was taken)
            if proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                time.sleep(0.05)
                continue
            return proc, f"redis://127.0.0.1:{port}/0"
        proc.kill()
        proc.wait()
    raise RuntimeError("redis-server did not start on a free port in five tries")


def _one_run(
    ctx: Any,
    n: int,
    mode: str,
    store_url: str | None,
    conversations: int,
    turns: int,
    parallel: int,
    cache: int,
) -> list[tuple[int, float, bool, str]]:
    replica_socks = [_listening() for _ in range(n)]
    replica_ports = [sock.getsockname()[1] for sock in replica_socks]
    gateway_socks = [_listening() for _ in range(2 if store_url else 1)]
    gateway_ports = [sock.getsockname()[1] for sock in gateway_socks]
    procs = [ctx.Process(target=_replicas, args=(replica_socks, cache), daemon=True)]
    procs += [
        ctx.Process(target=_gateway, args=(sock, replica_ports, store_url), daemon=True)
        for sock in gateway_socks
    ]
    for p in procs:
        p.start()
    for sock in [*replica_socks, *gateway_socks]:
        sock.close()  # each child has its own copy now
    try:
        for port in [*replica_ports, *gateway_ports]:
            asyncio.run(wait_up(port))
        gateways = [f"http://127.0.0.1:{p}" for p in gateway_ports]
        return asyncio.run(_load(gateways, mode, n, conversations, turns, parallel))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)


def run(sizes: list[int], conversations: int, turns: int, parallel: int, cache: int) -> None:
    redis, store_url = _start_redis()
    ctx = multiprocessing.get_context("spawn")
    try:
        where = (
            "two gateway processes sharing one Redis"
            if store_url
            else ("one gateway process on a MemoryStore (no redis-server found)")
        )
        print(
            f"{conversations} conversations of {turns} turns, {parallel} at a time, through "
            f"{where}; replicas: {SLOTS} slots, a cache of {cache} prompt prefixes"
        )
        for n in sizes:
            for mode in ("tierchain", "round-robin", "random"):
                # Fresh replicas (cold caches) and fresh gateways for every run.
                results = _one_run(ctx, n, mode, store_url, conversations, turns, parallel, cache)
                ttfd = [r[1] for r in results]
                later = [r for r in results if r[0] > 0]
                hits = sum(r[2] for r in later) / len(later) if later else 0.0
                spread = collections.Counter(r[3] for r in results)
                shares = "/".join(
                    f"{round(100 * spread[f'r{i}'] / len(results))}" for i in range(n)
                )
                print(
                    f"  replicas {n}  {mode:<12} p50 {statistics.median(ttfd):.3f} s  "
                    f"p99 {_quantile(ttfd, 0.99):.3f} s  cache hits {100 * hits:.0f}%  "
                    f"spread {shares} %"
                )
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--replicas", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cache", type=int, default=60, help="prompt prefixes a replica keeps")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.concurrency = 8, 3, 4
    run(args.replicas, args.conversations, args.turns, args.concurrency, args.cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
