"""A tier is a pool (issue 22), over real sockets.

A real uvicorn gateway (Heartbeats -> Budget -> PreferBackend -> Failover ->
Breaker -> SaturationWatchdog -> Forwarder) in front of fake replicas on
loopback: replicas picked by their live state, a failed replica followed by
another of the same pool before the next tier, shared hardware never failed
over onto, and a second try of the same tier after a transient fault.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tierchain import (
    Backend,
    Breaker,
    Budget,
    Failover,
    Forwarder,
    Heartbeats,
    MemoryStore,
    PickWeights,
    Pool,
    PreferBackend,
    Routes,
    SaturationWatchdog,
    TierRequest,
)
from tierchain.config import routes_from_toml
from tierchain.errors import ConfigError
from tierchain.picker import Picker

from .support import (
    Exchange,
    FakeBackend,
    answers,
    chat_request,
    on_virtual_time,
    once_then,
    parse_sse,
    refused_url,
    serve,
    streams,
)


class Gateway:
    """The whole stack around a Forwarder, with every state event recorded."""

    def __init__(
        self,
        chain: list[Backend | Pool],
        *,
        budget: float = 30.0,
        failover: dict[str, Any] | None = None,
        threshold: int = 1,
        **watchdog: Any,
    ) -> None:
        self.forwarder = Forwarder()
        watchdog.setdefault("status_interval", 0)
        self.watchdog = SaturationWatchdog(self.forwarder, **watchdog)
        self.store = MemoryStore()
        breaker = Breaker(self.watchdog, store=self.store, failure_threshold=threshold)
        self.failover = Failover(
            breaker, routes=Routes({"echo": chain}), store=self.store, **(failover or {})
        )
        inner = Heartbeats(Budget(PreferBackend(self.failover), default=budget), interval=0)
        self.events: list[dict[str, Any]] = []
        self.requests: list[TierRequest] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                req = TierRequest.of(scope)
                self.requests.append(req)
                req.subscribe(self.events.append)
            await inner(scope, receive, send)

        self.app = app

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()

    def states(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["state"] == name]


_ASKED = iter(range(10**9))


async def post(client: httpx.AsyncClient, url: str, **headers: str) -> httpx.Response:
    """A streaming chat request, each with a question of its own (no prefix in common)."""
    body = chat_request(stream=True, content=f"question {next(_ASKED)}")
    return await client.post(url + "/v1/chat/completions", content=body, headers=headers)


def trail(response: httpx.Response) -> list[str]:
    return [p.strip() for p in response.headers["x-tierchain-attempts"].split(",")]


def held(gate: asyncio.Event, arrived: asyncio.Event | None = None) -> Callable[[Exchange], Any]:
    """A replica that answers only once ``gate`` is set (``arrived`` set on arrival)."""

    async def script(ex: Exchange) -> None:
        if arrived is not None:
            arrived.set()
        await gate.wait()
        await streams(["held"])(ex)

    return script


async def quiet(ex: Exchange) -> None:
    await ex.wait_closed_by_peer()


def tower(a: FakeBackend | str, b: FakeBackend | str, **kw: Any) -> Pool:
    def url(x: FakeBackend | str) -> str:
        return x if isinstance(x, str) else x.url

    return Pool(
        name="tower",
        backends=[
            Backend(name="tower-a", url=url(a), **kw),
            Backend(name="tower-b", url=url(b), **kw),
        ],
    )


# -- a pool in a chain ---------------------------------------------------------------


def test_a_pool_stands_where_a_backend_stands_and_its_replicas_know_it() -> None:
    pool = Pool(
        name="tower",
        backends=[
            Backend(name="a", url="http://127.0.0.1:1"),
            Backend(name="b", url="http://127.0.0.1:2"),
        ],
    )
    routes = Routes({"echo": [pool, Backend(name="hosted", url="http://127.0.0.1:3")]})
    assert [b.name for b in routes["echo"]] == ["a", "b", "hosted"]
    assert [b.pool for b in routes["echo"]] == ["tower", "tower", None]
    assert routes.tiers("echo")[0] is pool
    assert routes.pooled == {"echo"}


@pytest.mark.parametrize(
    ("chain", "words"),
    [
        (lambda p: [p, p], "twice"),
        (lambda p: [p, Backend(name="tower", url="http://127.0.0.1:3")], "twice"),
        (lambda p: [p.backends[0]], "put the Pool in the chain"),
    ],
)
def test_a_pool_that_clashes_in_a_chain_is_refused(chain: Any, words: str) -> None:
    pool = Pool(name="tower", backends=[Backend(name="a", url="http://127.0.0.1:1")])
    with pytest.raises(ValueError, match=words):
        Routes({"echo": chain(pool)})


def test_an_empty_pool_or_a_pool_of_other_things_is_refused() -> None:
    with pytest.raises(ValueError, match="no backends"):
        Pool(name="tower", backends=[])
    with pytest.raises(ValueError, match="not a Backend"):
        Pool(name="tower", backends=["http://127.0.0.1:1"])  # type: ignore[list-item]


async def test_a_replica_answers_and_the_lines_and_the_trail_name_replica_and_pool() -> None:
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        gw = Gateway([tower(a, b)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    [entry] = trail(r)
    name = entry.split(";")[0]
    assert name in ("tower-a", "tower-b")
    assert entry == f"{name};pool=tower;outcome=ok"
    [attempt] = gw.states("attempt")
    assert (attempt["backend"], attempt["pool"]) == (name, "tower")
    assert gw.states("generating") == [{"state": "generating", "backend": name, "pool": "tower"}]
    lines = [c for e in parse_sse(r.content) for c in e["comments"]]
    assert any('"pool":"tower"' in c and f'"backend":"{name}"' in c for c in lines)
    assert len(a.requests) + len(b.requests) == 1


async def test_a_failed_replica_is_followed_by_another_replica_before_the_next_tier() -> None:
    async with FakeBackend("b") as b, FakeBackend("hosted") as hosted:
        gw = Gateway([tower(refused_url(), b), Backend(name="hosted", url=hosted.url)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            responses = [await post(client, url) for _ in range(6)]
        await gw.aclose()
    assert [r.status_code for r in responses] == [200] * 6
    assert hosted.requests == []  # the pool answered every time
    assert len(b.requests) == 6
    failed = [t for t in map(trail, responses) if len(t) > 1]
    assert failed  # the refused replica was tried at least once (then its breaker opened)
    for t in failed:
        assert t == ["tower-a;pool=tower;outcome=connect_refused", "tower-b;pool=tower;outcome=ok"]


async def test_every_replica_fails_before_the_next_tier_is_tried() -> None:
    async with FakeBackend("hosted") as hosted:
        gw = Gateway([tower(refused_url(), refused_url()), Backend(name="hosted", url=hosted.url)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    t = trail(r)
    assert sorted(t[:2]) == [
        "tower-a;pool=tower;outcome=connect_refused",
        "tower-b;pool=tower;outcome=connect_refused",
    ]
    assert t[2] == "hosted;outcome=ok"
    failed = gw.states("backend_failed")
    assert [f["pool"] for f in failed] == ["tower", "tower"]
    assert [f["failing_over"] for f in failed] == [True, True]


# -- picking by live state ---------------------------------------------------------------


async def test_a_busy_replica_is_not_picked_while_another_is_idle() -> None:
    gate = asyncio.Event()
    arrived = asyncio.Event()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = held(gate, arrived)
        gw = Gateway([tower(a, b)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            first = asyncio.create_task(post(client, url))
            await arrived.wait()
            busy = "tower-a" if a.requests else "tower-b"
            arrived.clear()
            second = asyncio.create_task(post(client, url))
            await arrived.wait()
            gate.set()
            r1, r2 = await first, await second
        await gw.aclose()
    assert (r1.status_code, r2.status_code) == (200, 200)
    assert trail(r1)[0].startswith(busy)
    assert not trail(r2)[0].startswith(busy)
    assert (len(a.requests), len(b.requests)) == (1, 1)


async def test_equal_idle_replicas_share_the_requests_at_random() -> None:
    random.seed(45)  # the picker's tie-break draws from random: the same run every time
    order: list[str] = []
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        gw = Gateway([tower(a, b)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            for _ in range(40):
                got = await post(client, url)
                assert got.status_code == 200
                order.append(got.headers["x-tierchain-backend"])
        await gw.aclose()
    # One after the other, each idle: a fair coin per request. Binomial(40, 1/2) falls
    # outside 10..30 with a probability under 1e-3; "the first takes all" is 40/0.
    assert 10 <= len(a.requests) <= 30, (len(a.requests), len(b.requests))
    assert len(a.requests) + len(b.requests) == 40
    # At random, not in turn: a round robin never picks the same replica twice in a row;
    # 40 fair coins repeat about 20 times in 39 pairs (fewer than 10: under 1e-3).
    repeats = sum(1 for x, y in itertools.pairwise(order) if x == y)
    assert repeats >= 10, order


async def test_an_open_replica_is_not_picked_while_another_is_closed() -> None:
    async with FakeBackend("b") as b:
        gw = Gateway([tower(refused_url(), b)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            # Until the refused replica has failed once, its breaker is closed.
            while True:
                r = await post(client, url)
                if len(trail(r)) == 2:
                    break
            later = [await post(client, url) for _ in range(10)]
        await gw.aclose()
    assert all(trail(r) == ["tower-b;pool=tower;outcome=ok"] for r in later)


async def test_a_full_replica_is_not_picked_while_another_has_room() -> None:
    gate = asyncio.Event()
    arrived = asyncio.Event()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = held(gate, arrived)
        gw = Gateway([tower(a, b, max_in_flight=1)], failover={"pick": PickWeights(in_flight=0)})
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            # Hold one request at tower-a (a preference puts it first) ...
            first = asyncio.create_task(post(client, url, **{"X-Prefer-Backend": "tower-a"}))
            await arrived.wait()
            # ... then tower-a is full: with no weight on in-flight attempts, only its
            # fullness keeps the next ones away from it.
            later = [await post(client, url) for _ in range(8)]
            gate.set()
            assert (await first).status_code == 200
        await gw.aclose()
    assert all(trail(r) == ["tower-b;pool=tower;outcome=ok"] for r in later)


async def test_a_preference_names_a_replica_or_the_pool() -> None:
    async with FakeBackend("a") as a, FakeBackend("b") as b, FakeBackend("hosted") as hosted:
        gw = Gateway([Backend(name="hosted", url=hosted.url), tower(a, b)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            replica = [await post(client, url, **{"X-Prefer-Backend": "tower-b"}) for _ in range(5)]
            pool = await post(client, url, **{"X-Prefer-Backend": "tower"})
            plain = await post(client, url)
        await gw.aclose()
    assert all(trail(r) == ["tower-b;pool=tower;outcome=ok"] for r in replica)
    assert trail(pool)[0].split(";")[1] == "pool=tower"
    assert trail(plain) == ["hosted;outcome=ok"]
    assert [b.name for b in gw.requests[-2].chain][2] == "hosted"  # reordered, not shortened


async def test_the_picker_orders_by_status_and_learned_time() -> None:
    picker = Picker(PickWeights(), admission=None)  # (no replica here has max_in_flight)
    slow, fast = _b("slow"), _b("fast")
    for _ in range(3):
        picker.started("m", slow)
        picker.ended(slow, "ok", body=b"", first_data_s=5.0)
        picker.started("m", fast)
        picker.ended(fast, "ok", body=b"", first_data_s=0.1)
    for _ in range(10):
        assert [b.name for b in await picker.order("m", [slow, fast], b"")] == ["fast", "slow"]
    # One attempt in flight (1.0) outweighs 4.9 s more of learned time (0.49).
    picker.started("m", fast)
    assert [b.name for b in await picker.order("m", [slow, fast], b"")] == ["slow", "fast"]
    picker.ended(fast, "ok", body=b"")
    assert [b.name for b in await picker.order("m", [slow, fast], b"")] == ["fast", "slow"]


def _b(name: str) -> Backend:
    return Pool(name="p" + name, backends=[Backend(name=name, url="http://127.0.0.1:1")]).backends[
        0
    ]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), True])
def test_a_pick_weight_must_be_a_number_at_least_zero(bad: Any) -> None:
    with pytest.raises(ValueError, match="pick weight waiting"):
        PickWeights(waiting=bad)


# -- the routes file ---------------------------------------------------------------------


def test_the_routes_file_holds_a_pool_with_its_backends() -> None:
    routes = routes_from_toml(
        {
            "routes": {
                "echo": {
                    "backends": [
                        {
                            "pool": "tower",
                            "backends": [
                                {"name": "tower-a", "url": "http://127.0.0.1:1", "shares": "gpu0"},
                                {"name": "tower-b", "url": "http://127.0.0.1:2"},
                            ],
                        },
                        {"name": "hosted", "url": "http://127.0.0.1:3"},
                    ]
                }
            }
        }
    )
    [pool, _hosted] = routes.tiers("echo")
    assert isinstance(pool, Pool)
    assert pool.name == "tower"
    assert [(b.name, b.pool, b.shares) for b in routes["echo"]] == [
        ("tower-a", "tower", "gpu0"),
        ("tower-b", "tower", None),
        ("hosted", None, None),
    ]


def test_every_problem_of_a_pool_entry_is_listed() -> None:
    with pytest.raises(ConfigError) as info:
        routes_from_toml(
            {
                "routes": {
                    "echo": {
                        "backends": [
                            {
                                "pool": "tower",
                                "url": "http://127.0.0.1:1",
                                "backends": [
                                    {"name": "tower-a", "url": "ftp://x"},
                                    {"name": "hosted", "url": "http://127.0.0.1:2"},
                                ],
                            },
                            {"name": "hosted", "url": "http://127.0.0.1:3"},
                        ]
                    }
                }
            }
        )
    problems = info.value.problems
    assert any(
        "routes.echo.backends[0].url (pool 'tower'): unknown key for a pool" in p for p in problems
    )
    assert any("routes.echo.backends[0].backends[0].url" in p for p in problems)
    assert any(
        "routes.echo.backends[1].name='hosted': this name is already in routes.echo "
        "(backends[0].backends[1])" in p
        for p in problems
    )


# -- shared hardware ---------------------------------------------------------------------


@on_virtual_time
async def test_a_saturated_local_model_never_hands_its_request_to_another_on_the_same_gpu() -> None:
    async with (
        FakeBackend("w2") as w2,
        FakeBackend("small") as small,
        FakeBackend("hosted") as hosted,
    ):
        w2.script = quiet
        gw = Gateway(
            [
                Backend(name="w2", url=w2.url, regime="local", shares="gpu0"),
                Backend(name="small", url=small.url, regime="local", shares="gpu0"),
                Backend(name="hosted", url=hosted.url, regime="hosted"),
            ],
            slow_after=0.3,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    assert trail(r) == ["w2;outcome=saturated", "small;outcome=busy", "hosted;outcome=ok"]
    assert small.requests == []  # never sent: it would have evicted w2 from the GPU
    [busy] = gw.states("backend_busy")
    assert busy == {
        "state": "backend_busy",
        "backend": "small",
        "reason": "shares",
        "shares": "gpu0",
        "failing_over": True,
    }


async def test_a_refused_local_model_still_fails_over_to_another_on_the_same_gpu() -> None:
    async with FakeBackend("small") as small:
        gw = Gateway(
            [
                Backend(name="w2", url=refused_url(), shares="gpu0"),
                Backend(name="small", url=small.url, shares="gpu0"),
            ]
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    # A refused connection says nothing holds the GPU: the group's other model may answer.
    assert trail(r) == ["w2;outcome=connect_refused", "small;outcome=ok"]


# -- retries on the same tier ------------------------------------------------------------


async def reset_at_once(ex: Exchange) -> None:
    await ex.reset()


@pytest.mark.parametrize(
    ("first", "outcome"),
    [
        (answers(502), "http_502"),
        (answers(503, b"<html>no upstream</html>", **{"content-type": "text/html"}), "http_503"),
        (answers(500), "http_500"),  # issue 31: a 500 once is answered by the same tier
        (answers(503), "http_503"),  # a model server's own JSON 503, no Retry-After
        (answers(529), "http_529"),  # Anthropic's "overloaded"
    ],
)
async def test_a_transient_fault_is_tried_again_on_the_same_tier(first: Any, outcome: str) -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = once_then(first)
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    assert trail(r) == [f"local;outcome={outcome}", "local;outcome=ok"]
    assert hosted.requests == []
    assert [a.get("retry") for a in gw.states("attempt")] == [None, 1]


async def test_one_transient_fault_on_the_last_tier_is_not_a_502() -> None:
    async with FakeBackend("hosted") as hosted:
        hosted.script = once_then(answers(502))
        gw = Gateway([Backend(name="hosted", url=hosted.url)], threshold=5)
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    assert trail(r) == ["hosted;outcome=http_502", "hosted;outcome=ok"]


async def test_retries_stop_at_their_number_per_request() -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = answers(502)
        hosted.script = answers(502)
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            failover={"retries": 2},
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 502
    assert [t.split(";")[0] for t in trail(r)] == ["local", "local", "local", "hosted"]


@pytest.mark.parametrize(
    ("first", "failover"),
    [
        (answers(503, **{"retry-after": "60"}), {}),  # past max_retry_wait: not waited out
        (answers(429, **{"retry-after": "2"}), {"max_retry_wait": 1}),
        (answers(429), {}),  # a rate limit that does not say when
        (answers(502), {"retries": 0}),
        (answers(504), {}),  # the backend's own deadline: no second try
        (reset_at_once, {}),  # a reset after the request went out: it may have been read
    ],
)
async def test_no_second_try_where_none_is_due(first: Any, failover: dict[str, Any]) -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = once_then(first)
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            failover=failover,
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert [t.split(";")[0] for t in trail(r)] == ["local", "hosted"]


async def test_a_backend_that_read_the_request_and_reset_sees_it_once_in_one_counted_attempt(
    metric: Any,
) -> None:
    """Issue 31: a reused keep-alive connection, the request read whole, then a reset. The
    backend may have worked on it (a paid one did, for 8 s): it is never sent to it again,
    neither by the pool nor as a same-tier retry; the one attempt is in the trail and the
    metrics, and the chain moves on."""
    calls = [0]

    async def ok_then_reset(ex: Exchange) -> None:
        calls[0] += 1
        if calls[0] == 1:
            await streams(["warm"])(ex)  # leaves the connection idle in the pool
        else:
            await ex.reset()

    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = ok_then_reset
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            threshold=5,
        )
        before = metric(
            "tierchain_attempts_total", route="echo", backend="local", outcome="connection_reset"
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            await post(client, url)
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    assert local.open_connections == 0
    assert len(local.requests) == 2  # one each: the second request was seen exactly once
    assert trail(r) == ["local;outcome=connection_reset", "hosted;outcome=ok"]
    after = metric(
        "tierchain_attempts_total", route="echo", backend="local", outcome="connection_reset"
    )
    assert after - before == 1


@on_virtual_time
async def test_a_request_the_backend_reset_before_it_was_written_whole_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other side of the same race: the backend reset its idle keep-alive just after
    the pool's look, so a write of the request failed and the backend never had it whole.
    One more try on the same backend, as an attempt of its own (outcome not_sent)."""
    import httpcore

    calls = [0]

    async def warm_then_reset(ex: Exchange) -> None:
        calls[0] += 1
        await streams(["warm" if calls[0] == 1 else "again"])(ex)
        if calls[0] == 1:
            await asyncio.sleep(0.05)
            await ex.reset()  # the idle connection, reset while in the gateway's pool

    # Every look at the idle connection comes before the reset reaches it.
    monkeypatch.setattr(httpcore.AsyncHTTPConnection, "has_expired", lambda self: False)
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = warm_then_reset
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            threshold=5,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            await post(client, url)
            await asyncio.sleep(0.2)
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 200
    assert trail(r) == ["local;outcome=not_sent", "local;outcome=ok"]
    assert len(local.requests) == 2  # the warm one, and the retry: the reset one never arrived
    assert hosted.requests == []
    assert [s["reason"] for s in gw.states("retrying")] == ["not_sent"]


@on_virtual_time
async def test_a_saturation_is_never_tried_again_on_the_same_tier() -> None:
    async with FakeBackend("local") as local, FakeBackend("hosted") as hosted:
        local.script = once_then(quiet)
        gw = Gateway(
            [Backend(name="local", url=local.url), Backend(name="hosted", url=hosted.url)],
            slow_after=0.3,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert trail(r) == ["local;outcome=saturated", "hosted;outcome=ok"]


def test_no_second_try_once_only_the_reserve_is_left() -> None:
    from tierchain.failover import _may_retry
    from tierchain.request import Attempt

    req = TierRequest()
    attempt = Attempt(1, 2, Backend(name="local", url="http://127.0.0.1:1"), "echo")
    assert _may_retry(req, attempt)  # no budget: nothing to keep
    req.deadline = time.monotonic() + 10.0
    attempt.reserve = 4.0
    assert _may_retry(req, attempt)
    attempt.reserve = 11.0  # the time left is all the later tiers'
    assert not _may_retry(req, attempt)
    attempt.reserve = 0.0
    req.deadline = time.monotonic() - 0.1  # spent
    assert not _may_retry(req, attempt)


@on_virtual_time
async def test_when_every_backend_left_shares_the_taken_gpu_none_of_them_is_tried() -> None:
    async with FakeBackend("w2") as w2, FakeBackend("small") as small:
        w2.script = quiet
        gw = Gateway(
            [
                Backend(name="w2", url=w2.url, shares="gpu0"),
                Backend(name="small", url=small.url, shares="gpu0"),
            ],
            slow_after=0.3,
        )
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    assert r.status_code == 502
    assert trail(r) == ["w2;outcome=saturated", "small;outcome=busy"]
    assert small.requests == []  # not even as the chain's last backend


# -- prefix affinity ---------------------------------------------------------------------


def turns(conversation: int, n: int) -> bytes:
    """Turn ``n`` (from 1) of a conversation: the system prompt, the earlier turns, a new one."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    for i in range(1, n + 1):
        question = f"conversation {conversation} turn {i}: " + "tell me more. " * 40
        messages.append({"role": "user", "content": question})
        if i < n:
            messages.append({"role": "assistant", "content": f"answer {i}"})
    return json.dumps({"model": "echo", "stream": True, "messages": messages}).encode()


async def say(client: httpx.AsyncClient, url: str, body: bytes, **headers: str) -> str:
    r = await client.post(url + "/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == 200
    return trail(r)[-1].split(";")[0]


async def test_a_conversation_stays_on_its_replica_while_load_is_even() -> None:
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        gw = Gateway([tower(a, b)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            placed = {}
            for c in range(8):
                first = await say(client, url, turns(c, 1))
                later = [await say(client, url, turns(c, n)) for n in (2, 3, 4)]
                assert later == [first] * 3, c
                placed[c] = first
        await gw.aclose()
    assert set(placed.values()) == {"tower-a", "tower-b"}  # first turns spread (2 in 2**8: not)


async def test_a_conversation_leaves_its_replica_when_it_is_far_more_loaded() -> None:
    gate = asyncio.Event()
    arrived = asyncio.Event()
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        gw = Gateway([tower(a, b)])
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            assert (
                await say(client, url, turns(1, 1), **{"X-Prefer-Backend": "tower-a"}) == "tower-a"
            )
            a.script = held(gate, arrived)
            held_requests = []
            for _ in range(2):  # two in flight at tower-a: within the threshold (2.0)
                arrived.clear()
                held_requests.append(
                    asyncio.create_task(post(client, url, **{"X-Prefer-Backend": "tower-a"}))
                )
                await arrived.wait()
            kept = len(a.requests)
            arrived.clear()
            affine = asyncio.create_task(say(client, url, turns(1, 2)))
            await arrived.wait()  # it went to tower-a, and waits there
            assert len(a.requests) == kept + 1
            # A third held request: tower-a is now 3 above tower-b, past the threshold.
            arrived.clear()
            held_requests.append(
                asyncio.create_task(post(client, url, **{"X-Prefer-Backend": "tower-a"}))
            )
            await arrived.wait()
            moved = await say(client, url, turns(1, 3))
            gate.set()
            assert await affine == "tower-a"
            for task in held_requests:
                await task
        await gw.aclose()
    assert moved == "tower-b"


async def test_two_gateways_sharing_one_redis_send_a_conversation_to_the_same_replica(
    redis_server: Any,
) -> None:
    from tierchain import RedisStore

    async with FakeBackend("a") as a, FakeBackend("b") as b:
        stores = [RedisStore(redis_server.url), RedisStore(redis_server.url)]
        gateways = []
        for store in stores:
            forwarder = Forwarder()
            failover = Failover(
                Breaker(forwarder, store=store), routes=Routes({"echo": [tower(a, b)]}), store=store
            )
            gateways.append((failover, forwarder))
        async with (
            serve(gateways[0][0]) as one,
            serve(gateways[1][0]) as two,
            httpx.AsyncClient() as client,
        ):
            for c in range(8):
                first = await say(client, one, turns(c, 1))
                assert await say(client, two, turns(c, 2)) == first, c
                assert await say(client, one, turns(c, 3)) == first, c
        for _, forwarder in gateways:
            await forwarder.aclose()
        for store in stores:
            await store.aclose()


def test_prefix_keys_hash_the_leading_blocks_of_every_prompt_shape() -> None:
    from tierchain.picker import prefix_keys

    one = prefix_keys(turns(1, 1)).keys
    two = prefix_keys(turns(1, 2)).keys
    assert len(one) == 2  # the system prompt, the first turn
    assert two[:2] == one  # the second turn starts with the first
    assert prefix_keys(turns(2, 1)).keys[0] == one[0]  # the same system prompt
    assert prefix_keys(turns(2, 1)).keys[1] != one[1]
    anthropic = json.dumps({"system": "terse", "messages": [{"role": "user", "content": "x"}]})
    assert len(prefix_keys(anthropic.encode()).keys) == 2
    responses = json.dumps({"instructions": "terse", "input": "x" * 5000})
    assert prefix_keys(responses.encode()).sizes[1:] == [
        7 + 2048,
        7 + 4096,
        7 + 5000,
    ]  # "terse", then 2 KiB pieces
    assert prefix_keys(b"not json").keys == []


async def test_the_memory_index_of_prefixes_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierchain import memory_store as store_module

    monkeypatch.setattr(store_module, "AFFINITY_ENTRIES", 4)
    store = MemoryStore()
    for i in range(10):
        await store.affinity_set("echo", [f"k{i}"], "tower-a", 60.0)
    assert await store.affinity_get("echo", ["k0"]) is None  # the oldest went first
    assert await store.affinity_get("echo", ["k9"]) == "tower-a"
    assert len(store._affinity) == 4


def test_the_pools_page_states_the_weights_and_limits_the_code_has() -> None:
    import dataclasses
    import re
    from pathlib import Path

    from tierchain import memory_store as store_module
    from tierchain.picker import AFFINITY_TTL

    docs = Path(__file__).resolve().parent.parent / "docs"
    page = (docs / "pools.md").read_text()
    table = dict(re.findall(r"^\| `(\w+)` \| ([0-9.]+) \|", page, re.M))
    defaults = {f.name: f.default for f in dataclasses.fields(PickWeights)}
    assert {k: float(v) for k, v in table.items()} == defaults
    assert AFFINITY_TTL == 600.0 and "in the last 10 minutes" in page  # noqa: PT018
    assert store_module.AFFINITY_ENTRIES == 65536 and "65,536" in page  # noqa: PT018
    from tierchain.failover import _WAIT_POLL

    assert _WAIT_POLL == 0.25 and "every\n  quarter of a second" in page  # noqa: PT018
    config = (docs / "configuration.md").read_text()
    [listed] = re.findall(r"`TIERCHAIN_FAILOVER_PICK` \| `pick` \| (\S+) \|", config)
    from tierchain.config import pick_weights

    assert pick_weights(listed) == PickWeights()


async def test_a_store_that_fails_never_fails_the_pick() -> None:
    class Broken(MemoryStore):
        async def affinity_get(self, route: str, keys: Any) -> str | None:
            raise ConnectionError("away")

        async def affinity_set(self, route: str, keys: Any, backend: str, ttl: float) -> None:
            raise ConnectionError("away")

    picker = Picker(PickWeights(), admission=None, store=Broken())
    replicas = [_b("x"), _b("y")]
    from tierchain.picker import prefix_keys

    prefix = prefix_keys(turns(1, 2))
    await picker.remember("m", replicas[0], prefix)
    assert sorted(b.name for b in await picker.order("m", replicas, b"", prefix)) == ["x", "y"]


async def test_an_operator_pin_may_name_a_pool_and_its_replicas_go_first() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from tierchain import Admin

    token = "s3cret-operator-token-0123456789"
    async with FakeBackend("a") as a, FakeBackend("b") as b, FakeBackend("hosted") as hosted:
        store = MemoryStore()
        routes = Routes({"echo": [Backend(name="hosted", url=hosted.url), tower(a, b)]})
        forwarder = Forwarder()
        gateway = PreferBackend(Failover(forwarder, routes=routes, store=store), store=store)
        admin = Admin(routes=routes, store=store, token=token)
        app = Starlette(routes=[Mount("/admin", admin), Mount("/", gateway)])
        async with serve(app) as url, httpx.AsyncClient() as client:
            pinned = await client.put(
                url + "/admin/pins/echo",
                json={"backend": "tower", "ttl": 60},
                headers={"Authorization": f"Bearer {token}"},
            )
            r = await post(client, url)
        await forwarder.aclose()
    assert pinned.status_code == 200, pinned.text
    assert trail(r)[0].split(";")[1:] == ["pool=tower", "outcome=ok"]
    assert hosted.requests == []


def test_check_config_names_a_replica_by_its_place_in_its_pool(tmp_path: Any) -> None:
    import io

    from tierchain.__main__ import check_config

    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "http://127.0.0.1:3"\n'
        'regime = "hosted"\n\n'
        '[[routes.echo.backends]]\npool = "tower"\n'
        '[[routes.echo.backends.backends]]\nname = "tower-a"\nurl = "http://127.0.0.1:1"\n'
        '[[routes.echo.backends.backends]]\nname = "tower-b"\nurl = "http://127.0.0.1:2/v1"\n'
    )
    out = io.StringIO()
    assert check_config(environ={"TIERCHAIN_ROUTES_FILE": str(path)}, out=out) == 0
    warning = out.getvalue().rsplit("1 warning(s):\n", 1)[1]
    assert warning.startswith(
        f"  - {path}: routes.echo.backends[1].backends[1].url='http://127.0.0.1:2/v1' "
        "(backend 'tower-b')"
    )


def vllm_metrics(waiting: int, kv: float) -> bytes:
    return (
        f'vllm:num_requests_running{{model_name="m"}} 1.0\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}.0\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
        f'vllm:generation_tokens_total{{model_name="m"}} 10.0\n'
    ).encode()


def with_metrics(body: bytes, served: asyncio.Event) -> Callable[[Exchange], Any]:
    async def script(ex: Exchange) -> None:
        if ex.request.path == "/metrics":
            await ex.respond(200, body, {"content-type": "text/plain"})
            served.set()
        else:
            await streams(["from ", "replica"])(ex)

    return script


@pytest.mark.parametrize(
    ("busy", "why"),
    [(vllm_metrics(6, 0.2), "waiting past the threshold"), (vllm_metrics(0, 0.9), "KV cache")],
)
async def test_a_replica_whose_status_says_full_is_not_picked_while_another_is_free(
    busy: bytes, why: str
) -> None:
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        polled = [asyncio.Event(), asyncio.Event()]
        a.script = with_metrics(busy, polled[0])
        b.script = with_metrics(vllm_metrics(1, 0.3), polled[1])
        pool = Pool(
            name="tower",
            backends=[
                Backend(name="tower-a", url=a.url, status_url=a.url + "/metrics"),
                Backend(name="tower-b", url=b.url, status_url=b.url + "/metrics"),
            ],
        )
        # What the status says, not how fast it comes: a status asked before sending that
        # answers late is busy too (status_late), which a loaded machine's real time can make
        # of any status here; that rule has its own tests.
        gw = Gateway([pool], status_interval=0.02, status_late=0)
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            await post(client, url)  # the first request starts the pollers
            for event in polled:  # a poll answered, and then another: the first was read
                await event.wait()
                event.clear()
                await event.wait()
            later = [await post(client, url) for _ in range(8)]
        await gw.aclose()
    assert all(trail(r) == ["tower-b;pool=tower;outcome=ok"] for r in later), why


async def test_a_proxy_fault_on_a_replica_goes_to_the_next_replica_not_the_same_one() -> None:
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        a.script = b.script = once_then(answers(502))
        gw = Gateway([tower(a, b)], threshold=5)
        async with serve(gw.app) as url, httpx.AsyncClient() as client:
            r = await post(client, url)
        await gw.aclose()
    # The first replica picked answered 502; the other replica is the second try.
    [first, second] = [t.split(";")[0] for t in trail(r)]
    assert first != second
    assert trail(r)[0].endswith("outcome=http_502")
