"""Status-aware routing: a backend whose polled status says full is skipped before sending."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tierchain import (
    Backend,
    Breaker,
    Failover,
    Forwarder,
    MemoryStore,
    Routes,
    SaturationWatchdog,
    TierRequest,
)
from tierchain.probes import auto_reader
from tierchain.status import StatusBoard, board_within

from .support import (
    Exchange,
    FakeBackend,
    chat_request,
    on_virtual_time,
    openai_stream,
    serve,
    streams,
)

HOSTED = b"".join(openai_stream(["from ", "hosted"]))
TOWER = b"".join(openai_stream(["from ", "tower"]))


def vllm(running: int, waiting: int, kv: float = 0.1) -> bytes:
    return (
        f'vllm:num_requests_running{{model_name="m"}} {running}.0\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}.0\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
        f'vllm:generation_tokens_total{{model_name="m"}} 10.0\n'
    ).encode()


class Tower:
    """A tower whose /metrics answers ``self.body``; ``served`` fires on each answer."""

    def __init__(self, body: bytes, chat: Any = None) -> None:
        self.body = body
        self.chat = chat or streams(["from ", "tower"])
        self.served = asyncio.Event()
        self.asked = asyncio.Event()  # a status GET arrived
        self.hang_status = False
        self.broken_status = False

    async def script(self, ex: Exchange) -> None:
        if ex.request.path == "/metrics":
            self.asked.set()
            if self.hang_status:
                await ex.wait_closed_by_peer()
                return
            if self.broken_status:
                await ex.respond(500, b"oops", {"content-type": "text/plain"})
                return
            body = self.body
            await ex.respond(200, body, {"content-type": "text/plain"})
            self.served.set()
            return
        await self.chat(ex)

    async def polled_with(self, body: bytes) -> None:
        """Serve ``body`` from now on, and wait until a poll has read it."""
        self.body = body
        for _ in range(2):  # one poll may be in flight with the old body
            self.served.clear()
            await asyncio.wait_for(self.served.wait(), 2)


class Gateway:
    def __init__(self, chain: list[Backend], *, breaker: dict[str, Any] | None = None, **wd: Any):
        self.events: list[dict[str, Any]] = []
        self.forwarder = Forwarder()
        wd.setdefault("status_interval", 0.02)
        self.watchdog = SaturationWatchdog(self.forwarder, **wd)
        inner: Any = self.watchdog
        self.store = MemoryStore()
        self.breaker: Breaker | None = None
        if breaker is not None:
            inner = self.breaker = Breaker(inner, store=self.store, **breaker)
        self.failover = failover = Failover(inner, routes=Routes({"echo": chain}))

        async def app(scope, receive, send):
            if scope["type"] == "http":
                TierRequest.of(scope).subscribe(self.events.append)
            await failover(scope, receive, send)

        self.app = app

    def states(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["state"] == name]

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.watchdog.aclose()


async def post(client: httpx.AsyncClient, url: str) -> httpx.Response:
    return await client.post(url + "/v1/chat/completions", content=chat_request())


def chats(backend: FakeBackend) -> int:
    return sum(r.path == "/v1/chat/completions" for r in backend.requests)


@on_virtual_time
async def test_a_backend_whose_status_says_full_is_skipped_before_sending(metric):
    tower = Tower(vllm(1, 0))
    before = metric("tierchain_backend_busy_total", route="echo", backend="tower", why="status")
    async with (
        FakeBackend("tower", tower.script) as fake,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        status_url = fake.url + "/metrics"
        gw = Gateway([Backend("tower", fake.url, status_url=status_url), Backend("h", hosted.url)])
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            assert (await post(client, url)).content == TOWER  # room: it goes
            await tower.polled_with(vllm(8, 6))  # 6 waiting: full
            full = await post(client, url)
            await tower.polled_with(vllm(4, 0, kv=0.93))  # KV cache past 0.8: full
            kv_full = await post(client, url)
            await tower.polled_with(vllm(2, 1))  # below every threshold: room
            room = await post(client, url)
        await gw.aclose()
    assert full.content == HOSTED
    assert full.headers["x-tierchain-attempts"] == "tower;outcome=busy, h;outcome=ok"
    assert kv_full.content == HOSTED
    assert room.content == TOWER
    assert chats(fake) == 2  # the skipped attempts sent nothing
    assert gw.states("backend_busy") == [
        {"state": "backend_busy", "backend": "tower", "reason": "6 waiting", "failing_over": True},
        {
            "state": "backend_busy",
            "backend": "tower",
            "reason": "kv_cache 0.93",
            "failing_over": True,
        },
    ]
    after = metric("tierchain_backend_busy_total", route="echo", backend="tower", why="status")
    assert after == before + 2


@on_virtual_time
async def test_every_slot_busy_is_full():
    one_slot_busy = b'[{"id": 0, "is_processing": true, "next_token": [{"n_decoded": 40}]}]'
    tower = Tower(b'[{"id": 0, "is_processing": false, "next_token": [{"n_decoded": 0}]}]')
    async with (
        FakeBackend("tower", tower.script) as fake,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        chain = [
            Backend("tower", fake.url, status_url=fake.url + "/metrics"),
            Backend("h", hosted.url),
        ]
        gw = Gateway(chain)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            assert (await post(client, url)).content == TOWER
            await tower.polled_with(one_slot_busy)
            response = await post(client, url)
        await gw.aclose()
    assert response.content == HOSTED
    assert gw.states("backend_busy")[0]["reason"] == "all slots busy"


@on_virtual_time
async def test_a_status_never_read_is_asked_first_a_late_one_is_busy_a_failing_one_never_blocks():
    tower = Tower(vllm(8, 6))
    async with (
        FakeBackend("tower", tower.script) as fake,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        chain = [
            Backend("tower", fake.url, status_url=fake.url + "/metrics"),
            Backend("h", hosted.url),
        ]
        gw = Gateway(chain, status_stale=0.1)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            first = await post(client, url)  # no status yet: asked before sending (full)
            await tower.polled_with(vllm(8, 6))
            tower.hang_status = True  # from now on the status never answers
            await asyncio.sleep(0.15)  # the full status goes stale
            # Asked, no answer within status_late (250 ms): a server that slow to say
            # how it is doing is starved itself (issue 32): never "send it".
            late = await post(client, url)
            tower.hang_status, tower.broken_status = False, True  # fails at once
            await asyncio.sleep(0.15)
            later = await post(client, url)  # a status that fails says nothing: try it
        await gw.aclose()
    assert first.content == HOSTED
    assert late.content == HOSTED
    assert later.content == TOWER
    assert [e["reason"] for e in gw.states("backend_busy")] == [
        "6 waiting",
        "status late (0.25s)",
    ]


@on_virtual_time
async def test_the_last_tier_is_never_skipped_for_a_full_status():
    tower = Tower(vllm(8, 6))
    async with FakeBackend("tower", tower.script) as fake:
        gw = Gateway([Backend("tower", fake.url, status_url=fake.url + "/metrics")])
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            assert (await post(client, url)).content == TOWER
            assert gw.watchdog.board is not None
            assert gw.watchdog.board.polling() == []  # a last tier is never polled
        await gw.aclose()
    assert gw.states("backend_busy") == []


@on_virtual_time
async def test_one_poller_per_backend_while_traffic_flows_none_while_idle():
    seen: list[tuple[list[str], int]] = []  # what a chat request found running as it arrived
    board_ref: list[Any] = []

    async def chat(ex: Exchange) -> None:
        polls = [t for t in asyncio.all_tasks() if t.get_name() == "tierchain-status-poll"]
        seen.append((board_ref[0].polling(), len(polls)))
        await streams(["from ", "tower"])(ex)

    tower = Tower(vllm(1, 0), chat)
    async with (
        FakeBackend("tower", tower.script) as fake,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        status_url = fake.url + "/metrics"
        chain = [Backend("tower", fake.url, status_url=status_url), Backend("h", hosted.url)]
        gw = Gateway(chain)
        board = gw.watchdog.board
        assert board is not None
        board_ref.append(board)
        board.idle_stop = 0.15
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            assert board.polling() == []  # nothing before traffic
            await asyncio.gather(*(post(client, url) for _ in range(5)))
            tasks = [t for t in asyncio.all_tasks() if t.get_name() == "tierchain-status-poll"]
            await asyncio.wait(tasks, timeout=3)  # stops by itself once idle
            idle = board.polling()
            polls = sum(r.path == "/metrics" for r in fake.requests)
            await asyncio.sleep(0.1)
            polls_later = sum(r.path == "/metrics" for r in fake.requests)
        await gw.aclose()
    assert seen == [([status_url], 1)] * 5  # one poller, however many requests
    assert len(tasks) <= 1
    assert idle == []
    assert polls_later == polls  # nothing polled while idle


@on_virtual_time
async def test_a_breaker_open_for_saturation_half_opens_as_soon_as_the_status_says_idle():
    release = asyncio.Event()

    async def chat(ex: Exchange) -> None:
        if not release.is_set():
            await ex.wait_closed_by_peer()  # saturated: says nothing
            return
        await streams(["from ", "tower"])(ex)

    tower = Tower(vllm(1, 1), chat)  # one running, ours waiting: queued, yet not full
    async with (
        FakeBackend("tower", tower.script) as fake,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        chain = [
            Backend("tower", fake.url, status_url=fake.url + "/metrics"),
            Backend("h", hosted.url),
        ]
        gw = Gateway(
            chain,
            breaker={"saturation_threshold": 1, "saturation_cooldown": 900.0},
            slow_after=0.1,
            status_interval=0.02,
            status_stale=5.0,
            suspect_for=0,  # (the breaker's own wake; no suspect mark in its way)
        )
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            first = await post(client, url)  # saturated: the breaker opens for 900 s
            assert (await gw.store.breaker_snapshot("echo", "tower")).state == "open"
            skipped = await post(client, url)  # still busy: skipped, and the poller runs
            await tower.polled_with(vllm(1, 0))  # busy, nothing queued: maybe another caller's
            still_skipped = await post(client, url)
            release.set()
            await tower.polled_with(vllm(0, 0))  # the tower is idle now
            recovered = await post(client, url)
        await gw.aclose()
    assert first.headers["x-tierchain-attempts"] == "tower;outcome=saturated, h;outcome=ok"
    assert skipped.headers["x-tierchain-attempts"] == "tower;outcome=skipped, h;outcome=ok"
    assert still_skipped.headers["x-tierchain-attempts"] == "tower;outcome=skipped, h;outcome=ok"
    assert recovered.content == TOWER
    assert (await gw.store.breaker_snapshot("echo", "tower")).state == "closed"
    assert gw.breaker is not None
    assert gw.breaker.status_board is gw.watchdog.board


def test_each_gateway_in_one_process_reads_the_board_of_its_own_watchdog():
    first = Gateway([Backend("tower", "http://127.0.0.1:1")], breaker={})
    second = Gateway([Backend("tower", "http://127.0.0.1:1")], breaker={})  # built last
    assert first.watchdog.board is not None
    assert second.watchdog.board is not None
    assert first.watchdog.board is not second.watchdog.board
    assert first.breaker is not None
    assert second.breaker is not None
    assert first.breaker.status_board is first.watchdog.board
    assert first.failover.status_board is first.watchdog.board
    assert second.breaker.status_board is second.watchdog.board
    assert second.failover.status_board is second.watchdog.board


def test_without_a_watchdog_that_polls_a_breaker_reads_no_board_even_if_another_gateway_has_one():
    polling = Gateway([Backend("tower", "http://127.0.0.1:1")], breaker={})
    quiet = SaturationWatchdog(Forwarder(), status_interval=0)
    assert polling.watchdog.board is not None
    assert quiet.board is None
    assert Breaker(quiet).status_board is None
    routes = Routes({"echo": [Backend("t", "http://127.0.0.1:1")]})
    assert Failover(quiet, routes=routes).status_board is None


def test_a_board_given_by_hand_is_the_one_read():
    board = StatusBoard()
    watchdog = SaturationWatchdog(Forwarder())
    assert Breaker(watchdog, status_board=board).status_board is board
    assert board_within(Breaker(watchdog)) is watchdog.board  # through the Breaker's app
    routes = Routes({"echo": [Backend("t", "http://127.0.0.1:1")]})
    around = Failover(Breaker(watchdog, status_board=board), routes=routes)
    assert around.status_board is board  # the nearest: the one the Breaker was given


@on_virtual_time
async def test_a_second_gateway_built_later_does_not_take_over_the_first_ones_recovery_by_status():
    """The first gateway's breaker half-opens from its own board's poll; the second
    gateway's board (built after it) never polls the first one's tower."""
    tower = Tower(vllm(0, 0))
    async with FakeBackend("tower", tower.script) as fake:
        chain = [Backend("tower", fake.url, status_url=fake.url + "/metrics")]
        first = Gateway(chain, breaker={"saturation_threshold": 1})
        second = Gateway(chain, breaker={"saturation_threshold": 1})
        assert first.breaker is not None
        policy = first.breaker.policy
        ticket = await first.store.breaker_acquire("echo", "tower", policy)
        await first.store.breaker_record("echo", "tower", policy, "saturation", gen=ticket.gen)
        assert (await first.store.breaker_snapshot("echo", "tower")).state == "open"
        async with serve(first.app) as url, httpx.AsyncClient(timeout=5) as client:
            await post(client, url)  # open: skipped, and its board starts polling the tower
            await tower.polled_with(vllm(0, 0))
            recovered = await post(client, url)
        assert second.watchdog.board is not None
        assert second.watchdog.board.polling() == []
        await first.aclose()
        await second.aclose()
    assert recovered.content == TOWER


async def test_a_status_get_in_flight_ends_with_the_poller_that_sent_it():
    # The tower accepts the status GET and never answers: the GET is still out when the
    # board stops. It must end (and close its connection) with the poller's client, not
    # run on past it and leave the connection to the garbage collector.
    tower = Tower(vllm(0, 0))
    tower.hang_status = True
    async with FakeBackend("tower", tower.script) as fake:
        board = StatusBoard(interval=0.02, stale_after=1, timeout=60)
        url = fake.url + "/metrics"
        assert board.peek(url, auto_reader) is None  # (starts the poller)
        await asyncio.wait_for(tower.asked.wait(), 30)
        out = [t for t in asyncio.all_tasks() if t.get_name() == "tierchain-status-get"]
        assert len(out) == 1  # the GET in flight, on the poller's client
        await board.aclose()
        assert out[0].done()
        await asyncio.wait_for(fake.connection_closed.wait(), 30)  # its connection too


@on_virtual_time
async def test_a_burst_of_200_requests_never_multiplies_the_status_gets():
    """200 requests over half a second, each ending before the next arrives: the status URL
    is read at most once per status interval (the poller's pace), not once per request."""

    async def chat(ex: Exchange) -> None:
        await asyncio.sleep(0.002)
        await streams(["from ", "tower"])(ex)

    tower = Tower(vllm(0, 0), chat)
    async with (
        FakeBackend("tower", tower.script) as fake,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        status_url = fake.url + "/metrics"
        chain = [Backend("tower", fake.url, status_url=status_url), Backend("h", hosted.url)]
        gw = Gateway(chain, status_interval=0.02)
        async with serve(gw.app) as url, httpx.AsyncClient(timeout=5) as client:
            started = asyncio.get_running_loop().time()

            async def later(i: int) -> httpx.Response:
                await asyncio.sleep(i * 0.0025)
                return await post(client, url)

            answers = await asyncio.gather(*(later(i) for i in range(200)))
            took = asyncio.get_running_loop().time() - started
            gets = sum(r.path == "/metrics" for r in fake.requests)
        await gw.aclose()
    assert all(a.status_code == 200 for a in answers)
    assert chats(fake) == 200
    assert took >= 199 * 0.0025 + 0.002  # the last request starts then and takes its 2 ms
    # One GET per interval at most (the poller's own pace), plus the first ask.
    assert gets <= took / 0.02 + 2, gets
