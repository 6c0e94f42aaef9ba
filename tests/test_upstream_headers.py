"""What the Forwarder passes on, both ways: credentials, hop-by-hop, cookies, trace context."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tierchain import Backend, Failover, Forwarder, Routes, telemetry

from .support import FakeBackend, chat_request, completion_body, serve
from .test_targets import raw_request

CALLER_SECRETS = (
    "Authorization: Bearer caller-secret\r\n"
    "X-Api-Key: caller-secret\r\n"
    "Api-Key: caller-secret\r\n"
    "Cookie: session=caller-secret\r\n"
)
CREDENTIALS = ("authorization", "x-api-key", "api-key", "cookie")


async def _json(ex) -> None:
    await ex.respond(200, completion_body("ok"))


async def test_a_callers_credentials_reach_only_a_backend_that_opts_in():
    async with FakeBackend("upstream", _json) as upstream:
        routes = Routes(
            {
                "local": [Backend("tower", upstream.url)],
                "hosted": [Backend("hosted", upstream.url, headers={"Api-Key": "sk-own"})],
                "gate": [Backend("gate", upstream.url, forward_caller_auth=True)],
            }
        )
        forwarder = Forwarder()
        async with serve(Failover(forwarder, routes=routes)) as url:
            for model in ("local", "hosted", "gate"):
                status, _, _ = await raw_request(
                    url,
                    "/v1/chat/completions",
                    chat_request(model, stream=False),
                    headers=CALLER_SECRETS,
                )
                assert status == 200
        await forwarder.aclose()
    local, hosted, gate = (r.headers for r in upstream.requests)
    assert not [h for h in CREDENTIALS if h in local]
    assert {h: hosted.get(h) for h in CREDENTIALS} == {
        "authorization": None,
        "x-api-key": None,
        "api-key": "sk-own",  # the backend's own key, never the caller's
        "cookie": None,
    }
    assert {h: gate[h] for h in CREDENTIALS} == {
        "authorization": "Bearer caller-secret",
        "x-api-key": "caller-secret",
        "api-key": "caller-secret",
        "cookie": "session=caller-secret",
    }


async def _with_upstream_extras(ex) -> None:
    await ex.respond(
        200,
        completion_body("ok"),
        {
            "Set-Cookie": "upstream-session=1; Path=/",
            "Date": "Mon, 01 Jan 2001 00:00:00 GMT",
            "Server": "upstream/1.0",
            "Keep-Alive": "timeout=5",
            "Connection": "keep-alive, X-Private",
            "X-Private": "hop",
            "Proxy-Authenticate": "Basic",
            "Upgrade": "h2c",
            "X-Keep": "yes",
        },
    )


@pytest.mark.parametrize("chained", [False, True], ids=["alone", "in_a_chain"])
async def test_a_response_has_one_date_one_server_and_no_upstream_cookie_or_hop_by_hop(chained):
    async with FakeBackend("tower", _with_upstream_extras) as tower:
        backend = Backend("tower", tower.url)
        forwarder = Forwarder() if chained else Forwarder(backend=backend)
        app = Failover(forwarder, routes=Routes({"echo": [backend]})) if chained else forwarder
        async with serve(app) as url:
            status, headers, body = await raw_request(
                url, "/v1/chat/completions", chat_request(stream=False)
            )
        await forwarder.aclose()
    assert status == 200
    assert body == completion_body("ok")
    names = [k for k, _ in headers]
    assert names.count("date") == 1
    assert names.count("server") == 1
    assert dict(headers)["server"] == "uvicorn"  # the server in front, not the upstream's
    assert dict(headers)["date"] != "Mon, 01 Jan 2001 00:00:00 GMT"
    for dropped in ("set-cookie", "keep-alive", "x-private", "proxy-authenticate", "upgrade"):
        assert dropped not in names
    assert dict(headers)["x-keep"] == "yes"


CALLER_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans(monkeypatch):
    """An OpenTelemetry SDK tracer for tierchain, recording into memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    monkeypatch.setattr(telemetry, "tracer", provider.get_tracer("tierchain"))
    yield exporter
    provider.shutdown()


async def test_the_attempts_span_goes_upstream_as_traceparent_not_the_callers(spans):
    async with (
        FakeBackend("tower", lambda ex: ex.respond(503, b"{}")) as tower,
        FakeBackend("hosted", _json) as hosted,
    ):
        forwarder = Forwarder()
        routes = Routes({"echo": [Backend("tower", tower.url), Backend("hosted", hosted.url)]})
        async with serve(Failover(forwarder, routes=routes, retries=0)) as url:
            status, _, _ = await raw_request(
                url,
                "/v1/chat/completions",
                chat_request(stream=False),
                headers=f"traceparent: {CALLER_TRACE}\r\ntracestate: caller=1\r\n",
            )
        await forwarder.aclose()
    assert status == 200
    attempts = [s for s in spans.get_finished_spans() if s.name == "tierchain.attempt"]
    by_backend = {s.attributes["tierchain.backend"]: s.context for s in attempts}
    for fake in (tower, hosted):
        [seen] = fake.requests
        context = by_backend[fake.name]
        assert seen.headers["traceparent"] == (
            f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        )
        assert "tracestate" not in seen.headers
    assert by_backend["tower"].span_id != by_backend["hosted"].span_id


async def test_without_a_tracer_the_callers_trace_context_is_not_passed_on():
    async with FakeBackend("tower", _json) as tower:
        forwarder = Forwarder(backend=Backend("tower", tower.url))
        async with serve(forwarder) as url:
            await raw_request(
                url,
                "/v1/chat/completions",
                chat_request(stream=False),
                headers=f"traceparent: {CALLER_TRACE}\r\ntracestate: caller=1\r\n",
            )
        await forwarder.aclose()
    [seen] = tower.requests
    assert "traceparent" not in seen.headers
    assert "tracestate" not in seen.headers
