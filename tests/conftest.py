from __future__ import annotations

import functools
from typing import Any

import httpx._transports.default
import pytest
from prometheus_client import REGISTRY

from .support import RULES_TIMEOUT

# httpx builds a TLS context for every client and transport (reading certifi's bundle: about
# 45 ms of CPU), though the tests' clients speak plain HTTP to loopback: the suite built some
# 2,500 of them, a minute and a half of its time. The tests' clients share one per setting.
# httpx's ``_transports.default`` module is private (docs/internals.md, "Private parts of other
# packages"); tests/test_dependency_internals.py fails if it stops calling
# ``create_ssl_context`` from there.
_BUILD_TLS = httpx._transports.default.create_ssl_context


@functools.cache
def _tls(verify: bool, trust_env: bool) -> Any:
    return _BUILD_TLS(verify=verify, trust_env=trust_env)


def _shared_tls(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
    if isinstance(verify, bool) and cert is None:
        return _tls(verify, trust_env)
    return _BUILD_TLS(verify=verify, cert=cert, trust_env=trust_env)


httpx._transports.default.create_ssl_context = _shared_tls  # type: ignore[assignment]


@pytest.fixture
def metric():
    """Read a tierchain metric sample from the default registry (0.0 when absent)."""

    def read(name: str, **labels: str) -> float:
        value = REGISTRY.get_sample_value(name, labels)
        return 0.0 if value is None else value

    return read


@pytest.fixture
async def browser():
    """A headless Chromium (Playwright Browser); skips where it cannot be had."""
    from .browser import launch

    try:
        async with launch() as b:
            yield b
    except LookupError as exc:
        pytest.skip(f"headless Chromium unavailable: {exc}")


# -- a real redis-server (Breaker/RedisStore tests) -----------------------------

REDIS_BINARY = "/usr/bin/redis-server"


class RedisServer:
    """A throwaway redis-server on a free loopback port: kill it, start it again."""

    def __init__(self, binary: str) -> None:

        self.binary = binary
        self.port = self._free_port()
        self.proc = None

    @staticmethod
    def _free_port() -> int:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port

    def start_on_a_free_port(self) -> None:
        """Start it; if its port was taken meanwhile (an outgoing connection's
        ephemeral port), on another one."""
        for _ in range(5):
            try:
                self.start()
                return
            except RuntimeError:
                self.kill()
                self.port = self._free_port()
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import socket
        import subprocess
        import time

        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def redis_server():
    """A real redis-server for this test; skips only when the binary is missing."""
    import os
    import shutil

    binary = REDIS_BINARY if os.path.exists(REDIS_BINARY) else shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = RedisServer(binary)
    server.start_on_a_free_port()
    try:
        yield server
    finally:
        server.kill()


class ManualClock:
    """A breaker clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def manual_clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(params=["memory", "redis"])
async def breaker_store(request, manual_clock):
    """Each breaker store in turn (RedisStore on a throwaway redis-server), on manual_clock."""
    from tierchain import MemoryStore, RedisStore

    if request.param == "memory":
        yield MemoryStore(clock=manual_clock)
        return
    server = request.getfixturevalue("redis_server")
    # The rules are under test, not outages: a reply a busy machine delays must not send
    # the store to its local fallback (the outage tests make stores of their own).
    store = RedisStore(server.url, clock=manual_clock, timeout=RULES_TIMEOUT)
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture(autouse=True)
def _the_real_clock_between_tests():
    """Each test starts on the real clock: a virtual one left switched on (a monkeypatch
    undone after ``virtual_time`` had restored the clock) would freeze every later test."""
    import time

    from tierchain._runtime import clock

    assert clock.now is time.monotonic, f"a test left the package's clock switched: {clock.now!r}"
