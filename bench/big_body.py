#!/usr/bin/env python3
"""Is ``/healthz`` answered while one caller's huge body is handled? ``tierchain serve`` in
a process of its own, one POST of ``--mb`` MB of ``[[],[],...]`` (under the 32 MiB
``max_body``), and ``/healthz`` asked every 10 ms meanwhile from another connection.

Run: ``.venv/bin/python bench/big_body.py`` (``--mb 30``, ``--shape nested``; ``--shape prose``
sends a valid chat body of one long message instead). Prints the POST's status, how long it
took, the gateway's CPU for it, and the slowest ``/healthz`` answer while it was in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu(pid: int) -> float:
    """The process's user and system CPU seconds, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def body(shape: str, mb: int) -> bytes:
    size = mb * 2**20
    if shape == "nested":
        return b"[" + b"[]," * (size // 3) + b"[]]"
    text = b"The quick brown fox, jumps over the lazy dog. " * (size // 46)
    return b'{"model":"echo","messages":[{"role":"user","content":"' + text + b'"}]}'


_POSTER = """
import sys, time, httpx
payload = open(sys.argv[2], "rb").read()
started = time.perf_counter()
r = httpx.post(sys.argv[1] + "/v1/chat/completions", content=payload, timeout=300,
               headers={"content-type": "application/json"})
print(r.status_code, round(time.perf_counter() - started, 2))
"""


async def measure(url: str, payload: Path, size: int, pid: int) -> None:
    """The POST from a process of its own, so that sending it takes nothing from the asker."""
    async with httpx.AsyncClient(timeout=120) as asker:
        await asker.get(url + "/healthz")  # the connection open before the measure
        quiet = 0.0  # the slowest answer with nothing else going on: the machine's own noise
        for _ in range(50):
            t = time.perf_counter()
            await asker.get(url + "/healthz")
            quiet = max(quiet, time.perf_counter() - t)
            await asyncio.sleep(0.01)
        cpu0 = _cpu(pid)
        post = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _POSTER, url, str(payload), stdout=asyncio.subprocess.PIPE
        )
        waited = asyncio.create_task(post.communicate())
        slowest = 0.0
        asked = 0
        while not waited.done():
            t = time.perf_counter()
            r = await asker.get(url + "/healthz")
            assert r.status_code == 200
            slowest = max(slowest, time.perf_counter() - t)
            asked += 1
            await asyncio.sleep(0.01)
        out, _ = await waited
        cpu = _cpu(pid) - cpu0
    status, took = out.decode().split()
    print(
        f"POST of {size / 2**20:.1f} MiB: {status} in {took} s, "
        f"gateway CPU {cpu:.2f} s; /healthz asked {asked} times meanwhile, "
        f"slowest answer {1000 * slowest:.0f} ms (before the POST, 50 asked: slowest "
        f"{1000 * quiet:.0f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=30)
    parser.add_argument("--shape", choices=("nested", "prose"), default="nested")
    args = parser.parse_args()
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        routes = Path(tmp) / "routes.toml"
        routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
        env = {
            **os.environ,
            "TIERCHAIN_ROUTES_FILE": str(routes),
            "TIERCHAIN_PORT": str(port),
            "TIERCHAIN_LOG_LEVEL": "warning",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierchain", "serve"], env=env, stderr=subprocess.DEVNULL
        )
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(200):
                try:
                    httpx.get(url + "/healthz")
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            payload = Path(tmp) / "body.json"
            data = body(args.shape, args.mb)
            payload.write_bytes(data)
            asyncio.run(measure(url, payload, len(data), proc.pid))
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
