"""The private parts of other packages that tierchain reaches into are still where it reaches.

One test per row of the table "Private parts of other packages" in docs/internals.md. Each
fails on an installed version where the attribute moved, changed type or stopped being used the
way the code relies on; then the use site (named in the table) must change, and the table's
"checked against" versions with it.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import ssl
import subprocess
import sys
import textwrap

import httpcore
import httpx
import pytest
import uvicorn

from tierchain._connections import FlatPool, FlatTransport

from .support import now, on_virtual_time, serve


async def small_answer(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


# -- httpx: AsyncHTTPTransport._pool -------------------------------------------------------


def test_httpx_transport_keeps_its_connection_pool_in_pool():
    transport = httpx.AsyncHTTPTransport()
    assert isinstance(transport._pool, httpcore.AsyncConnectionPool)
    for method in ("handle_async_request", "aclose", "__aenter__"):
        source = inspect.getsource(getattr(httpx.AsyncHTTPTransport, method))
        assert "self._pool." in source, f"httpx's {method} no longer goes through self._pool"


async def test_a_request_through_the_flat_transport_is_served_by_the_flat_pool():
    transport = FlatTransport(limits=httpx.Limits(max_keepalive_connections=4))
    pool = transport._pool
    assert isinstance(pool, FlatPool)
    async with serve(small_answer) as url, httpx.AsyncClient(transport=transport) as client:
        response = await client.get(url + "/")
        assert response.content == b"ok"
        assert pool.connections == 1  # the flat pool made it and holds it, idle
        assert (await client.get(url + "/")).content == b"ok"
        assert pool.connections == 1  # and reused it


def test_httpx_transports_build_their_tls_context_through_the_module_global_the_tests_share():
    # tests/conftest.py replaces httpx._transports.default.create_ssl_context so that the
    # suite's clients share one TLS context; this fails if httpx stops calling it from there.
    import httpx._transports.default as default

    source = inspect.getsource(httpx.AsyncHTTPTransport.__init__)
    assert "create_ssl_context(" in source
    assert default.create_ssl_context is not httpx.create_ssl_context  # the tests' own
    first = httpx.AsyncHTTPTransport()._pool._ssl_context
    assert first is httpx.AsyncHTTPTransport()._pool._ssl_context


# -- httpcore: AsyncConnectionPool._ssl_context, AsyncHTTPConnection._origin ---------------


@pytest.mark.parametrize("verify", [True, False])
def test_httpcore_pool_keeps_the_ssl_context_httpx_built_and_the_flat_pool_takes_it(verify):
    built = httpx.AsyncHTTPTransport(verify=verify)._pool._ssl_context
    assert isinstance(built, ssl.SSLContext)
    flat = FlatTransport(limits=httpx.Limits(), verify=verify)._pool
    assert isinstance(flat, FlatPool)
    taken = flat._ssl_context
    assert isinstance(taken, ssl.SSLContext)
    assert taken.verify_mode == built.verify_mode
    assert taken.verify_mode == (ssl.CERT_REQUIRED if verify else ssl.CERT_NONE)


def test_httpcore_connection_keeps_its_origin_in_origin():
    origin = httpcore.Origin(b"http", b"127.0.0.1", 8080)
    conn = httpcore.AsyncHTTPConnection(origin=origin)
    assert conn._origin is origin
    assert isinstance(conn._origin, httpcore.Origin)
    other = httpcore.Origin(b"http", b"127.0.0.1", 8081)
    assert conn.can_handle_request(origin)
    assert not conn.can_handle_request(other)


# -- OpenTelemetry: trace._TRACER_PROVIDER --------------------------------------------------


def test_opentelemetry_keeps_the_installed_tracer_provider_in_a_module_global():
    # A fresh interpreter: a provider can be installed once per process.
    code = textwrap.dedent(
        """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from tierchain.telemetry import tracing_enabled

        assert trace._TRACER_PROVIDER is None, trace._TRACER_PROVIDER
        assert not tracing_enabled()
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
        assert trace._TRACER_PROVIDER is provider
        assert tracing_enabled()
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"


# -- uvicorn: the Server methods serve.py overrides ----------------------------------------


def test_uvicorn_server_still_has_the_methods_and_attributes_serve_overrides_and_reads():
    server = uvicorn.Server(uvicorn.Config(small_answer))
    assert server.started is False
    assert "self.capture_signals()" in inspect.getsource(uvicorn.Server.serve)
    assert list(inspect.signature(uvicorn.Server.handle_exit).parameters) == [
        "self",
        "sig",
        "frame",
    ]
    for name in ("startup", "shutdown"):
        method = getattr(uvicorn.Server, name)
        assert inspect.iscoroutinefunction(method)
        assert "sockets" in inspect.signature(method).parameters
    assert "self.servers" in inspect.getsource(uvicorn.Server.startup)
    # The main loop serve.py replaces (one on_tick a second): uvicorn still runs it, asks
    # on_tick whether to stop, refreshes its Date header on a counter multiple of 10, and
    # reads should_exit there (serve.py's property wakes the loop when it is set).
    assert "await self.main_loop()" in inspect.getsource(uvicorn.Server._serve)
    assert inspect.iscoroutinefunction(uvicorn.Server.main_loop)
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    on_tick = inspect.getsource(uvicorn.Server.on_tick)
    assert "counter % 10 == 0" in on_tick
    assert "self.should_exit" in on_tick
    assert server.should_exit is False


def test_the_test_server_shuts_down_as_uvicorn_does_with_what_it_reads_of_uvicorn():
    # tests/support.py's PromptServer replaces shutdown: what uvicorn's own does (close the
    # listeners, ask each connection to shut down, wait for connections and tasks under the
    # graceful timeout, then the lifespan) must still be all there is to it.
    shutdown = inspect.getsource(uvicorn.Server.shutdown)
    for step in (
        "server.close()",
        "connection.shutdown()",
        "timeout_graceful_shutdown",
        "self.lifespan.shutdown()",
    ):
        assert step in shutdown
    waits = inspect.getsource(uvicorn.Server._wait_tasks_to_complete)
    for read in ("self.server_state.connections", "self.server_state.tasks", "wait_closed()"):
        assert read in waits


@pytest.mark.parametrize("kind", ["uvicorn's own", "the tests' own"])
@on_virtual_time
async def test_the_test_server_stops_without_uvicorns_tenths_of_a_second(kind):
    from .support import PromptServer

    async def stopped_after_one_request(server: uvicorn.Server) -> float:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag
            await asyncio.sleep(0.005)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with httpx.AsyncClient() as client:
            assert (await client.get(url)).status_code == 200
        told = now()
        if isinstance(server, PromptServer):
            server.stop()
        else:
            server.should_exit = True
        await task
        sock.close()
        assert server.server_state.connections == set()
        return now() - told

    config = uvicorn.Config(small_answer, lifespan="off", log_level="warning")
    if kind == "the tests' own":
        assert await stopped_after_one_request(PromptServer(config)) == 0.0
    else:  # what the tests' server saves: the rest of a tick, and shutdown's own 0.1 s sleep
        assert await stopped_after_one_request(uvicorn.Server(config)) > 0.1


# -- uvicorn and httptools: the parser callbacks HttpToolsWithoutTrailers wraps ---------------


def test_httptools_reports_a_chunked_requests_trailers_through_on_header_after_the_head():
    httptools = pytest.importorskip("httptools")
    calls: list[tuple[str, bytes]] = []

    class Recorder:
        def on_message_begin(self) -> None:
            calls.append(("begin", b""))

        def on_header(self, name: bytes, value: bytes) -> None:
            calls.append(("header", name))

        def on_headers_complete(self) -> None:
            calls.append(("head", b""))

    parser = httptools.HttpRequestParser(Recorder())
    parser.feed_data(
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nhi\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    assert calls == [
        ("begin", b""),
        ("header", b"Host"),
        ("header", b"Transfer-Encoding"),
        ("head", b""),
        ("header", b"X-Trailer"),  # after the head: what the subclass drops
    ]


def test_uvicorn_httptools_protocol_appends_each_field_to_the_scopes_header_list():
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from tierchain.httptools_protocol import HttpToolsWithoutTrailers

    assert issubclass(HttpToolsWithoutTrailers, HttpToolsProtocol)
    begin = inspect.getsource(HttpToolsProtocol.on_message_begin)
    assert "self.headers = []" in begin
    assert '"headers": self.headers' in begin
    assert "self.headers.append(" in inspect.getsource(HttpToolsProtocol.on_header)
    for name in ("on_message_begin", "on_header", "on_headers_complete"):
        assert name in vars(HttpToolsProtocol), f"uvicorn no longer defines {name}"
        assert name in vars(HttpToolsWithoutTrailers)


def test_uvicorn_httptools_runs_each_request_as_its_cycles_run_asgi_with_more_body():
    """What _runtime/server.py reads: the request task's coroutine is the httptools cycle's
    ``run_asgi`` (its frame's ``self`` the cycle), which keeps ``transport`` and
    ``more_body``."""
    pytest.importorskip("httptools")
    from uvicorn.protocols.http import httptools_impl

    from tierchain._runtime import server

    cycle = httptools_impl.RequestResponseCycle
    assert cycle.__module__ == server._CYCLE_MODULE
    assert cycle.run_asgi.__qualname__ == "RequestResponseCycle.run_asgi"
    assert "cycle.run_asgi(app)" in inspect.getsource(httptools_impl.HttpToolsProtocol)
    init = inspect.getsource(cycle.__init__)
    assert "self.transport = transport" in init
    assert "self.more_body = True" in init
    complete = inspect.getsource(httptools_impl.HttpToolsProtocol.on_message_complete)
    assert "self.cycle.more_body = False" in complete


# -- asyncio (3.11): tasks._current_tasks ----------------------------------------------------


async def test_asyncio_keeps_the_running_task_of_each_loop_in_current_tasks_on_3_11():
    from tierchain._runtime import interrupt

    task = asyncio.current_task()
    if sys.version_info >= (3, 12):
        assert interrupt._CURRENT is None  # 3.12's current_task is C: nothing private read
    else:
        table = asyncio.tasks._current_tasks  # type: ignore[attr-defined]
        assert interrupt._CURRENT is table
        assert table.get(asyncio.get_running_loop()) is task
    armed = interrupt.Interruption.on()
    assert armed.task is task
    other = interrupt.Interruption()
    assert other.arm() is task


# -- OpenTelemetry: context._RUNTIME_CONTEXT._current_context, trace.propagation._SPAN_KEY --


def test_opentelemetry_keeps_the_current_span_in_its_runtime_contexts_contextvar():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from tierchain import telemetry

    assert telemetry._SPAN_SLOT is not None  # found where the table says (else the API is asked)
    assert telemetry.current_span() is trace.INVALID_SPAN is trace.get_current_span()
    span = TracerProvider().get_tracer("test").start_span("request")
    with trace.use_span(span, end_on_exit=True):
        assert telemetry.current_span() is span is trace.get_current_span()
    assert telemetry.current_span() is trace.INVALID_SPAN


def test_the_gateways_clients_verify_with_one_trust_store_built_once_a_process():
    from tierchain._connections import trust_store

    store = trust_store()
    assert store is trust_store()
    assert store.verify_mode == ssl.CERT_REQUIRED
    assert store.check_hostname
    assert FlatTransport(limits=httpx.Limits())._pool._ssl_context is store
    own = ssl.create_default_context()
    assert FlatTransport(limits=httpx.Limits(), verify=own)._pool._ssl_context is own
