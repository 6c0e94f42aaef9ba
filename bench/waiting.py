#!/usr/bin/env python3
"""Many waiting streams: K streaming callers parked behind a tower that accepts and stays quiet.

The shape of the outage tierchain exists for: the GPU is saturated, the tower
accepts every request and says nothing. Each caller's stream is held open by
the gateway (Heartbeats commits ``200 text/event-stream`` after a second and
sends a keepalive every ``--interval`` seconds) while the request waits on the
tower. Two gateways are measured in the same run, one after the other, each in
its own uvicorn process on loopback:

- ``bare``: a bare httpx forwarding proxy (no tierchain, raw ASGI) holding the same streams;
- ``bare-fastapi``: the same proxy mounted in FastAPI at ``/v1``, as the README mounts the
  Forwarder: the same host without tierchain, so the difference is tierchain's own;
- ``bare-keepalive`` (with ``--only bare-keepalive``): the bare proxy writing one SSE comment
  every ``--interval`` per waiting stream, with no tierchain: the floor of what keepalives
  cost on this host and server;
- ``stack``: the README's stack (Heartbeats, Budget, PreferBackend, Failover,
  Breaker, SaturationWatchdog, Forwarder; tower then hosted), with the
  watchdog and the budget set far beyond the run so the streams stay waiting;
- ``serve`` (with ``--only serve``): ``tierchain serve`` itself, from its
  variables: its stack with no framework, its uvicorn server (one wake a second for
  its own checks) and its HTTP parser (httptools when installed, whatever ``--http``
  says): against ``bare``, what a gateway run as ``tierchain serve`` costs.

For each K it reports: streams held and failed; how many got the gateway's own
200 and how many never got a state line (for the stack, all K and none: a
caller parked behind the tower must hear from it); whether any breaker opened
(and how many requests reached hosted); the gateway's CPU per admitted stream
for each batch of admissions (flat is the target); RSS per waiting stream above
the bare proxies (over all K, and from half held to all held: the cost of one
more stream, without the first requests' one-off allocations); the gateway's
CPU over a window of keepalives, as a share of one core; open fds before,
while held and after the callers leave.

Run: ``.venv/bin/python bench/waiting.py 1000 3000 10000``. Each process
raises its fd limit as far as the hard limit allows; a gateway needs two fds
per stream (the caller's and the tower's), so K is capped at what fits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import resource
import socket
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import BareProxy
from readme_stack import cpu_seconds, wait_up

BODY = json.dumps(
    {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    b"content-type: application/json\r\naccept: text/event-stream\r\n"
    b"content-length: %d\r\n\r\n" % len(BODY)
) + BODY
HOSTED_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 40\r\n\r\n"
    b'data: {"choices":[]}\n\ndata: [DONE]\n\n\n\n\n\n'
)


try:
    import httptools  # noqa: F401

    _AUTO_HTTP = "httptools"
except ImportError:
    _AUTO_HTTP = "h11"


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- the tower (quiet) and hosted (answers at once), one process ---------------------------


def run_backends(tower_port: int, hosted_port: int, counts: Any) -> None:
    raise_fd_limit()

    class Quiet(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            counts[0] += 1

        def data_received(self, data: bytes) -> None:
            if b"\r\n\r\n" in data or data.endswith(b"}"):
                pass  # the request: say nothing, hold the connection

        def connection_lost(self, exc: Exception | None) -> None:
            counts[1] += 1

    class Hosted(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            if b"\r\n\r\n" in data:
                counts[2] += 1
                self.transport.write(HOSTED_ANSWER)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await loop.create_server(Quiet, "127.0.0.1", tower_port, backlog=4096)
        await loop.create_server(Hosted, "127.0.0.1", hosted_port, backlog=4096)
        await asyncio.Event().wait()

    asyncio.run(main())


# -- the gateways ---------------------------------------------------------------------------


def build(kind: str, tower: str, hosted: str) -> Any:
    """The gateway app, with ``/_bench/metrics`` for the breaker's state."""
    from prometheus_client import make_asgi_app

    metrics = make_asgi_app()
    if kind == "bare-keepalive":
        import httpx

        keeps = KeepaliveProxy(tower, float(os.environ["WAITING_INTERVAL"]))
        keeps.client = httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )
        inner: Any = keeps
    elif kind in ("bare", "bare-fastapi"):
        import httpx

        proxy = BareProxy(tower)
        # As the Forwarder's: no cap on connections (httpx's default is 100).
        proxy.client = httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )
        inner = proxy
        if kind == "bare-fastapi":
            from fastapi import FastAPI

            inner = FastAPI()
            inner.mount("/v1", proxy)  # (the path stays whole under a mount)
    else:
        from readme_stack import readme_gateway

        inner = readme_gateway(
            tower,
            hosted,
            slow_after=3600.0,
            stall_after=3600.0,
            budget=3600.0,
            interval=float(os.environ["WAITING_INTERVAL"]),
            prompt_rate=0,  # parked means waited on: no expected-prefill cut
        )

    snapshots: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/_bench/metrics":
            return await metrics(scope, receive, send)
        if scope["type"] == "http" and scope["path"] == "/_bench/memory":
            return await memory(send)
        return await inner(scope, receive, send)

    async def memory(send: Any) -> None:
        """With --trace-memory: the top allocations since the previous call."""
        import tracemalloc

        snap = tracemalloc.take_snapshot()
        text = ""
        if snapshots:
            by = os.environ.get("WAITING_TRACE_BY") or (
                "traceback" if tracemalloc.get_traceback_limit() > 1 else "filename"
            )
            stats = snap.compare_to(snapshots[-1], by)[:60]
            text = "\n".join(
                str(s) + "\n  " + "\n  ".join(s.traceback.format()[-12:]) for s in stats
            )
        snapshots.append(snap)
        start = {"type": "http.response.start", "status": 200, "headers": []}
        await send(start)
        await send({"type": "http.response.body", "body": text.encode()})

    return app


# A comment line shaped as tierchain's state lines are (so the callers count it as one).
_KEEPALIVE = b': {"state":"waiting","backend":"tower"}\n\n'


class KeepaliveProxy(BareProxy):
    """The bare proxy plus the least a gateway can do to hold a waiting stream open, with no
    tierchain: it commits ``200 text/event-stream`` at once and writes one SSE comment every
    ``interval`` seconds (a task sleeping per stream) until the upstream answers. Its CPU
    over the keepalive window is the floor of what those writes cost on this host and server."""

    def __init__(self, upstream: str, interval: float) -> None:
        super().__init__(upstream)
        self.interval = interval

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = await self.request(scope, receive)
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/event-stream")]})
        assert self.client is not None

        async def keepalives() -> None:
            line = {"type": "http.response.body", "body": _KEEPALIVE, "more_body": True}
            while True:
                await asyncio.sleep(self.interval)
                await send(line)

        ticker = asyncio.ensure_future(keepalives())
        try:
            response = await self.client.send(request, stream=True)
        finally:
            ticker.cancel()
            await asyncio.wait([ticker])
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


def serve_environ(tower: str, hosted: str, interval: float) -> dict[str, str]:
    """``tierchain serve``'s variables for the tower then hosted, the streams left waiting."""
    import tempfile

    routes = os.path.join(tempfile.mkdtemp(), "routes.toml")
    with open(routes, "w") as f:
        f.write(
            f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower}"\nregime = "local"\n'
            f'[[routes.echo.backends]]\nname = "hosted"\nurl = "{hosted}"\n'
            'regime = "hosted"\n'
        )
    return {
        "TIERCHAIN_ROUTES_FILE": routes,
        "TIERCHAIN_SLOW_AFTER": "3600",
        "TIERCHAIN_WATCHDOG_STALL_AFTER": "3600",
        "TIERCHAIN_BUDGET_DEFAULT": "3600",
        "TIERCHAIN_HEARTBEAT_INTERVAL": str(interval),
        "TIERCHAIN_IDENTITY": "off",
        # Parked means waited on: no expected-prefill cut, no hedge to hosted.
        "TIERCHAIN_WATCHDOG_PROMPT_RATE": "0",
        "TIERCHAIN_FAILOVER_HEDGE_AFTER": "none",
        "TIERCHAIN_LOG_LEVEL": "error",
    }


def run_gateway(
    kind: str, port: int, tower: str, hosted: str, interval: float, http: str = "h11"
) -> None:
    raise_fd_limit()
    if kind == "serve":
        # tierchain serve itself: its server, its parser (httptools when installed), its
        # /metrics; not the bench's wrapper.
        from tierchain.serve import run

        sys.exit(run(host="127.0.0.1", port=port, environ=serve_environ(tower, hosted, interval)))
    import uvicorn

    os.environ["WAITING_INTERVAL"] = str(interval)
    if os.environ.get("WAITING_TRACE_MEMORY"):
        import tracemalloc

        tracemalloc.start(int(os.environ["WAITING_TRACE_MEMORY"]))
    uvicorn.run(
        build(kind, tower, hosted),
        host="127.0.0.1",
        port=port,
        log_level="critical",
        access_log=False,
        lifespan="off",
        backlog=4096,
        timeout_keep_alive=3600,
        http=http,
    )


def proc_stats(pid: int) -> dict[str, float]:
    """CPU seconds, RSS bytes and open fds of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = cpu_seconds(pid)
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"cpu": cpu, "rss": rss, "fds": fds}


# -- the callers ------------------------------------------------------------------------------


class Caller(asyncio.Protocol):
    """One streaming caller: sends the request, then only reads."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.status: int | None = None
        self.lines = 0
        self.data = False
        self.closed = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(REQUEST)

    def data_received(self, data: bytes) -> None:
        if self.status is None:
            self.raw += data
            head, sep, rest = bytes(self.raw).partition(b"\r\n\r\n")
            if not sep:
                return
            self.status = int(head.split(b" ", 2)[1])
            data = rest
            self.raw = bytearray()
        self.lines += data.count(b": {")
        if b"data:" in data:
            self.data = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    @property
    def held(self) -> bool:
        return not self.closed and not self.data and self.status in (None, 200)


async def scrape(port: int, path: str = "/_bench/metrics") -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % path.encode())
    data = await reader.read()
    writer.close()
    return data.decode("latin-1")


def breaker_opened(metrics: str) -> bool:
    for line in metrics.splitlines():
        if (
            line.startswith("tierchain_breaker_transitions_total")
            and 'to="open"' in line
            and float(line.rsplit(" ", 1)[1]) > 0
        ):
            return True
    return False


async def measure(
    kind: str,
    k: int,
    batch: int,
    interval: float,
    window: float,
    counts: Any,
    ports: Any,
    settle: float,
    fds_wait: float = 30.0,
) -> dict[str, Any]:
    tower_port, hosted_port = ports
    tracing = bool(os.environ.get("WAITING_TRACE_MEMORY"))
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    tower, hosted = f"http://127.0.0.1:{tower_port}", f"http://127.0.0.1:{hosted_port}"
    http = os.environ.get("WAITING_HTTP", _AUTO_HTTP)
    proc = ctx.Process(
        target=run_gateway, args=(kind, port, tower, hosted, interval, http), daemon=True
    )
    proc.start()
    loop = asyncio.get_running_loop()
    callers: list[Caller] = []
    try:
        await wait_up(port)
        assert proc.pid is not None
        # Warm up: one stream answered by... nobody; then let it go.
        base = proc_stats(proc.pid)
        if tracing:
            await scrape(port, "/_bench/memory")
        tower_before, hosted_before = counts[0], counts[2]
        per_batch: list[float] = []
        half: tuple[int, int] | None = None  # (streams held, RSS) once half are in
        t0 = time.monotonic()
        for start in range(0, k, batch):
            n = min(batch, k - start)
            before = proc_stats(proc.pid)["cpu"]
            for _ in range(n):
                caller = Caller()
                await loop.create_connection(lambda c=caller: c, "127.0.0.1", port)
                callers.append(caller)
            # Admitted: the tower has the request (or it went elsewhere, or failed).
            target = start + n
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                done = counts[0] - tower_before + counts[2] - hosted_before
                done += sum(1 for c in callers if c.closed or c.data)
                if done >= target:
                    break
                await asyncio.sleep(0.02)
            per_batch.append((proc_stats(proc.pid)["cpu"] - before) / n * 1e3)
            if settle:
                await asyncio.sleep(settle)  # its commits fall here, not in the next batch
            if half is None and target >= k // 2:
                half = (target, proc_stats(proc.pid)["rss"])
        admit_s = time.monotonic() - t0
        await asyncio.sleep(2.5)  # the commit (1 s) and the first lines
        held_stats = proc_stats(proc.pid)
        cpu0, t_0 = held_stats["cpu"], time.monotonic()
        await asyncio.sleep(window)
        cpu1, t_1 = proc_stats(proc.pid)["cpu"], time.monotonic()
        lines = sum(c.lines for c in callers)
        metrics = await scrape(port, "/metrics" if kind == "serve" else "/_bench/metrics")
        if tracing:
            print(await scrape(port, "/_bench/memory"))
        held = sum(1 for c in callers if c.held)
        # Heartbeats' own 200 (the bare proxies send nothing until the tower answers).
        committed = sum(1 for c in callers if c.status == 200)
        silent = sum(1 for c in callers if c.lines == 0)
        result = {
            "kind": kind,
            "k": k,
            "held": held,
            "failed": k - held,
            "committed": committed,
            "without_lines": silent,
            "reached_tower": counts[0] - tower_before,
            "reached_hosted": counts[2] - hosted_before,
            "breaker_opened": breaker_opened(metrics),
            # (the bare proxies have no tierchain metrics: "closed" there says nothing)
            "metrics_read": "tierchain_" in metrics,
            "admit_s": round(admit_s, 1),
            "admit_ms_cpu_first_batch": round(per_batch[0], 3),
            "admit_ms_cpu_last_batch": round(per_batch[-1], 3),
            "admit_ms_cpu_per_batch": [round(x, 3) for x in per_batch],
            "rss_base_mb": round(base["rss"] / 2**20, 1),
            "rss_held_mb": round(held_stats["rss"] / 2**20, 1),
            "kib_per_stream": round((held_stats["rss"] - base["rss"]) / k / 1024, 2),
            # From half held to all held: what one more waiting stream costs, without the
            # first requests' one-off allocations (and their noise) in the figure.
            "kib_per_stream_marginal": (
                round((held_stats["rss"] - half[1]) / (k - half[0]) / 1024, 2)
                if half is not None and k > half[0]
                else None
            ),
            "keepalive_core_pct": round((cpu1 - cpu0) / (t_1 - t_0) * 100, 2),
            "lines_per_stream": round(lines / k, 1),
            "fds_base": base["fds"],
            "fds_held": held_stats["fds"],
        }
        for c in callers:
            if c.transport is not None:
                c.transport.close()
        callers.clear()
        left = time.monotonic()
        fds = proc_stats(proc.pid)["fds"]
        while fds > base["fds"] + 2 and time.monotonic() - left < fds_wait:
            await asyncio.sleep(0.5)
            fds = proc_stats(proc.pid)["fds"]
        result["fds_after"] = fds
        result["fds_after_s"] = round(time.monotonic() - left, 1)
        return result
    finally:
        for c in callers:
            if c.transport is not None:
                c.transport.close()
        proc.terminate()
        proc.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("k", nargs="*", type=int, default=[1000, 3000, 10000])
    parser.add_argument("--batch", type=int, default=250, help="callers admitted per batch")
    parser.add_argument("--interval", type=float, default=10.0, help="keepalive interval (s)")
    parser.add_argument("--window", type=float, default=20.0, help="keepalive CPU window (s)")
    parser.add_argument(
        "--only",
        action="append",
        choices=["bare", "bare-fastapi", "bare-keepalive", "stack", "serve"],
        help="measure this gateway (again for another; default: bare, bare-fastapi, stack)",
    )
    parser.add_argument(
        "--settle", type=float, default=1.5, help="pause after each batch (its commits)"
    )
    parser.add_argument(
        "--http",
        choices=["h11", "httptools"],
        default=_AUTO_HTTP,
        help="uvicorn's HTTP parser for the gateways other than serve (default: as uvicorn's "
        "auto, httptools when installed)",
    )
    parser.add_argument(
        "--fds-wait",
        type=float,
        default=30.0,
        help="seconds to wait after the callers left for the gateway's fds to come back",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--trace-memory", type=int, default=0, help="frames: print the gateway top allocations"
    )
    parser.add_argument(
        "--trace-by",
        choices=["filename", "lineno", "traceback"],
        help="with --trace-memory: group allocations by this (default: by file for 1 frame)",
    )
    args = parser.parse_args()
    if args.trace_memory and "serve" in (args.only or []):
        parser.error("--trace-memory needs the bench's own endpoint: not with --only serve")
    os.environ["WAITING_HTTP"] = args.http
    if args.trace_memory:
        os.environ["WAITING_TRACE_MEMORY"] = str(args.trace_memory)
        if args.trace_by:
            os.environ["WAITING_TRACE_BY"] = args.trace_by
    limit = raise_fd_limit()
    cap = (limit - 64) // 2
    ctx = multiprocessing.get_context("spawn")
    counts = ctx.Array("l", 3, lock=False)  # tower connections, tower closed, hosted requests
    ports = (free_port(), free_port())
    backends = ctx.Process(target=run_backends, args=(*ports, counts), daemon=True)
    backends.start()
    results = []
    try:
        for k in args.k:
            if k > cap:
                print(
                    f"K={k} needs {2 * k} fds in the gateway; the hard limit is {limit}: "
                    f"measuring K={cap}",
                    file=sys.stderr,
                )
                k = cap
            for kind in args.only or ["bare", "bare-fastapi", "stack"]:

                async def one(kind: str = kind, k: int = k) -> dict[str, Any]:
                    await wait_up(ports[0])
                    return await measure(
                        kind,
                        k,
                        args.batch,
                        args.interval,
                        args.window,
                        counts,
                        ports,
                        args.settle,
                        args.fds_wait,
                    )

                result = asyncio.run(one())
                results.append(result)
                if args.json:
                    print(json.dumps(result), flush=True)
                else:
                    r = result
                    print(
                        f"[{r['kind']:12}] K={r['k']:>6} held {r['held']} failed {r['failed']} "
                        f"committed {r['committed']} without a line {r['without_lines']} "
                        f"(tower {r['reached_tower']}, hosted {r['reached_hosted']}, breaker "
                        f"{'OPENED' if r['breaker_opened'] else 'closed'}"
                        f"{'' if r['metrics_read'] else ', no tierchain metrics'}); "
                        f"admit {r['admit_s']} s, "
                        f"CPU/stream first batch {r['admit_ms_cpu_first_batch']} ms, last "
                        f"{r['admit_ms_cpu_last_batch']} ms; RSS {r['rss_base_mb']}->"
                        f"{r['rss_held_mb']} MB = {r['kib_per_stream']} KiB/stream "
                        f"({r['kib_per_stream_marginal']} from half held to all); keepalive "
                        f"window {r['keepalive_core_pct']}% of a core ({r['lines_per_stream']} "
                        f"lines/stream); fds {r['fds_base']}->{r['fds_held']}->{r['fds_after']} "
                        f"({r['fds_after_s']} s after the callers left)",
                        flush=True,
                    )
        pairs: dict[int, dict[str, dict[str, Any]]] = {}
        for r in results:
            pairs.setdefault(r["k"], {})[r["kind"]] = r
        for k, pair in pairs.items():
            for mine, bare in (("stack", "bare"), ("stack", "bare-fastapi"), ("serve", "bare")):
                if bare in pair and mine in pair:
                    extra = pair[mine]["kib_per_stream"] - pair[bare]["kib_per_stream"]
                    line = (
                        f"K={k}: the {mine} gateway holds each waiting stream in {extra:.2f} KiB "
                        f"above {bare}"
                    )
                    a, b = (
                        pair[mine]["kib_per_stream_marginal"],
                        pair[bare]["kib_per_stream_marginal"],
                    )
                    if a is not None and b is not None:
                        line += f" (from half held to all held: {a - b:.2f} KiB)"
                    print(line)
    finally:
        backends.terminate()
        backends.join(5)


if __name__ == "__main__":
    main()
