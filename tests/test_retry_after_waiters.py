"""A waited Retry-After is honoured for every waiter (issue 43, item 5), on virtual time.

Twenty callers at once behind the only tier's ``429 Retry-After: 9``: each waits it out
(spread over a short window, not all at one instant) and gets its retry, none a 503
"cooling down" in its place; and no caller is told a Retry-After above the cap.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tierchain import Backend
from tierchain._responses import retry_after

from .support import (
    Exchange,
    FakeBackend,
    answers,
    chat_request,
    now,
    on_virtual_time,
    serve,
    streams,
)
from .test_pools import Gateway, post
from .test_retries import RATE_LIMITED


def limited_until(until: list[float], retry_after: str) -> Any:
    """A backend that answers 429 with ``retry_after`` until ``until[0]``, then streams."""

    async def script(ex: Exchange) -> None:
        if now() < until[0]:
            await answers(429, RATE_LIMITED, **{"retry-after": retry_after})(ex)
        else:
            await asyncio.sleep(2.0)  # an answer takes a while: the others arrive meanwhile
            await streams(["again"])(ex)

    return script


@on_virtual_time
async def test_twenty_callers_behind_one_retry_after_9_each_get_their_retry() -> None:
    """Each waiter's retry reaches the backend (the half-open breaker's single probe does
    not turn the other 19 away), and the retries arrive spread over a tenth of the wait."""
    started = now()
    until = [started + 9.0]
    arrivals: list[float] = []
    limited = limited_until(until, "9")

    async def script(ex: Exchange) -> None:
        arrivals.append(now() - started)
        await limited(ex)

    async with FakeBackend("only") as only:
        only.script = script
        gw = Gateway([Backend(name="only", url=only.url)], budget=60.0, threshold=5)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=120) as client:
            got = await asyncio.gather(*(post(client, url) for _ in range(20)))
        await gw.aclose()
    assert [r.status_code for r in got] == [200] * 20
    assert all("again" in r.text and "error" not in r.text for r in got)
    for req in gw.requests:
        assert [(a.backend, a.outcome) for a in req.attempts] == [
            ("only", "http_429"),
            ("only", "ok"),
        ]
    first, retries = arrivals[:20], arrivals[20:]
    assert len(retries) == 20
    assert max(first) < 1.0
    assert all(9.0 <= t <= 9.0 + 0.9 + 0.01 for t in retries)  # Retry-After, + up to 10 %
    assert len({round(t, 3) for t in retries}) > 10  # spread out, not one instant
    waits = [e["after_s"] for e in gw.states("retrying")]
    assert len(waits) == 20
    assert all(9.0 <= w <= 9.9 for w in waits)


@pytest.mark.parametrize(
    ("said", "read"),
    [
        ("9", 9.0),
        ("999999", 900.0),
        ("1e308", 900.0),
        ("9" * 400, 900.0),  # past a float: infinite, still a number
        ("inf", 900.0),
        ("-5", 0.0),
        ("nan", None),
        ("soon", None),
        ("Fri, 31 Dec 9999 23:59:59 GMT", 900.0),
    ],
)
def test_the_one_retry_after_reader_clamps_to_the_cap(said: str, read: float | None) -> None:
    assert retry_after([(b"retry-after", said.encode())]) == read


@pytest.mark.parametrize("said", ["999999", "1e308", "9" * 400])
@on_virtual_time
async def test_no_caller_is_told_a_retry_after_above_the_cap(said: str) -> None:
    async with FakeBackend("only") as only:
        only.script = answers(429, RATE_LIMITED, **{"retry-after": said})
        gw = Gateway([Backend(name="only", url=only.url)], budget=60.0, threshold=5)
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            body = chat_request(stream=False, content="q")
            first = await client.post(url + "/v1/chat/completions", content=body)
            second = await client.post(url + "/v1/chat/completions", content=body)
        await gw.aclose()
    assert first.status_code == second.status_code == 429
    assert first.headers["retry-after"] == "900"
    assert int(second.headers["retry-after"]) <= 900
    assert first.json()["error"]["attempts"][0]["retry_after_s"] == 900.0


@pytest.mark.parametrize(("said", "told"), [("999999", "900"), ("1e308", "900"), ("7", "7")])
async def test_an_upstream_answer_passed_on_whole_tells_no_retry_after_above_the_cap(
    said: str, told: str
) -> None:
    """The Forwarder alone passes a backend's 429 on as it came, but for a Retry-After past
    the cap, which it tells as the cap."""
    from tierchain import Forwarder

    async with FakeBackend("only") as only:
        only.script = answers(429, RATE_LIMITED, **{"retry-after": said})
        forwarder = Forwarder(backend=Backend(name="only", url=only.url))
        async with serve(forwarder) as url, httpx.AsyncClient() as client:
            body = chat_request(stream=False, content="q")
            r = await client.post(url + "/v1/chat/completions", content=body)
        await forwarder.aclose()
    assert r.status_code == 429
    assert r.headers["retry-after"] == told
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
