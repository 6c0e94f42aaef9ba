"""The burst probe against local fakes (loopback only): what its verdict may and may not say."""

from __future__ import annotations

import asyncio
import json

import pytest

from tierchain import burst
from tierchain.burst import Call, ProbeResult, chat_url, planned_calls, run_probe, verdict

from .support import FakeBackend, completion_body, on_virtual_time

SMALL = (1, 10, 20)


def serializing(each: float):
    """One request at a time, each taking ``each`` seconds: latency grows with concurrency."""
    lock = asyncio.Lock()

    async def script(ex):
        async with lock:
            await asyncio.sleep(each)
        await ex.respond(200, completion_body("x"))

    return script


def parallel(each: float):
    """Every request takes ``each`` seconds however many there are: flat latency."""

    async def script(ex):
        await asyncio.sleep(each)
        await ex.respond(200, completion_body("x"))

    return script


async def drained(backend: FakeBackend) -> None:
    """Wait (up to 0.5 s) until the client closed every connection to ``backend``."""
    for _ in range(100):
        if backend.open_connections == 0:
            return
        await asyncio.sleep(0.005)


async def probe(script, **kw) -> ProbeResult:
    """Run the probe against a fake; wait for its connections to close before stopping it."""
    async with FakeBackend("b", script) as backend:
        result = await run_probe(backend.url, "m", **kw)
        await drained(backend)
    return result


def test_the_standard_run_makes_138_calls():
    assert burst.LEVELS == (1, 5, 10, 30)
    assert burst.REPEATS == 3
    assert planned_calls() == 138


@pytest.mark.parametrize(
    ("given", "endpoint"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1/chat/completions"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/chat/completions"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/chat/completions"),
        ("http://h/v1/chat/completions", "http://h/v1/chat/completions"),
    ],
)
def test_the_endpoint_is_found_from_a_base_url(given, endpoint):
    assert chat_url(given) == endpoint


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="not an http or https URL"):
        chat_url("ftp://h")


async def test_every_call_sends_the_same_shortest_prompt_with_max_tokens_1():
    async with FakeBackend("b", parallel(0)) as backend:
        result = await run_probe(backend.url, "tiny", api_key="k-1", levels=(1, 2), repeats=2)
        await drained(backend)
    assert len(result.calls) == len(backend.requests) == 6
    bodies = {r.body for r in backend.requests}
    assert len(bodies) == 1
    body = json.loads(bodies.pop())
    assert body == {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "stream": False,
    }
    assert {r.headers["authorization"] for r in backend.requests} == {"Bearer k-1"}
    assert {r.path for r in backend.requests} == {"/v1/chat/completions"}


async def test_latency_that_grows_with_concurrency_is_evidence_of_queueing_not_of_where():
    seen: list[str] = []
    result = await probe(serializing(0.004), levels=SMALL, repeats=1, progress=seen.append)
    outcome = verdict(result)
    assert outcome.kind == "growth"
    text = outcome.text()
    assert "evidence of serialization or admission queueing" in text
    assert "does not say where" in text
    assert "absorbed" not in text
    assert len(seen) == 3
    assert seen[-1].startswith("[31/31] concurrency 20, repeat 1/1: 20 ok, p50 ")


@on_virtual_time  # the probe times its calls on the package clock
async def test_flat_latency_is_not_called_proof_of_no_admission_control():
    result = await probe(parallel(0.2), levels=SMALL, repeats=1)
    # Every call took the backend's 0.2 s, however many ran at once.
    assert [c.seconds for c in result.calls] == pytest.approx([0.2] * 31, abs=1e-3)
    outcome = verdict(result)
    assert outcome.kind == "flat"
    assert "cannot distinguish no admission control from a backend that absorbed the burst" in (
        outcome.text()
    )
    assert "evidence of serialization" not in outcome.text()


async def test_429s_are_called_a_rate_limiter_not_the_backend_shedding():
    busy = 0

    async def limiter(ex):
        nonlocal busy
        if busy:
            await ex.respond(429, b'{"error":{"message":"slow down"}}')
            return
        busy += 1
        try:
            await asyncio.sleep(0.01)
        finally:
            busy -= 1
        await ex.respond(200, completion_body("x"))

    result = await probe(limiter, levels=SMALL, repeats=1)
    text = verdict(result).text()
    assert "answered 429" in text
    assert "that is a rate limiter" in text
    assert "not the backend shedding load" in text
    assert "weak evidence" in text


@on_virtual_time
async def test_calls_without_an_answer_are_reported_as_failures_and_bounded():
    async def silent(ex):
        await ex.wait_closed_by_peer()

    result = await probe(silent, levels=(1, 2), repeats=1, call_timeout=0.1)
    assert all(c.error == "timeout after 0.1s" for c in result.calls)
    assert [round(c.seconds, 6) for c in result.calls] == [0.1, 0.1, 0.1]
    outcome = verdict(result)
    assert outcome.kind == "no_evidence"
    assert "3 of 3 calls got no HTTP answer (3x timeout after 0.1s)" in outcome.text()
    assert "says nothing about admission control" in outcome.text()


def test_error_statuses_are_not_attributed_to_anyone_in_particular():
    result = ProbeResult("http://x/v1/chat/completions", "m", (1, 5), 1)
    result.calls += [Call(1, 1, 200, 0.5)]
    result.calls += [Call(5, 1, 200, 0.5)] * 3 + [Call(5, 1, 503, 0.01)] * 2
    text = verdict(result).text()
    assert "2 of 6 calls were answered with an error status (2x HTTP 503)" in text
    assert "cannot be told whether the backend, a proxy or a limiter answered" in text


def test_a_small_rise_is_inconclusive():
    result = ProbeResult("http://x/v1/chat/completions", "m", (1, 30), 1)
    result.calls += [Call(1, 1, 200, 1.0)] + [Call(30, 1, 200, 1.7)] * 30
    assert verdict(result).kind == "inconclusive"
