"""The learned normal: each backend's own time to first data event sets its window."""

from __future__ import annotations

import logging
import random
from typing import Any

import httpx
import pytest

from tierchain import Backend, Failover, Forwarder, Routes, SaturationWatchdog
from tierchain.config import from_env
from tierchain.learned import Learned, bucket_of
from tierchain.sketch import LogSketch

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


def test_the_sketch_knows_a_quantile_to_within_one_bucket():
    rng = random.Random(7)
    sketch = LogSketch(half_life=1e9)
    values = [rng.uniform(0.01, 1.0) for _ in range(5000)]
    for v in values:
        sketch.add(v)
    exact = sorted(values)[int(0.99 * len(values))]
    q = sketch.quantile(0.99)
    assert q is not None
    assert exact <= q <= exact * 1.08 * 1.01
    assert sketch.count == 5000
    assert LogSketch().quantile(0.5) is None


def test_the_sketch_forgets_old_samples_by_half_life():
    sketch = LogSketch(half_life=50)
    for _ in range(50):
        sketch.add(10.0)  # the old model: slow
    for _ in range(300):
        sketch.add(0.1)  # after a swap: fast
    q = sketch.quantile(0.99)
    assert q is not None
    assert q < 0.2  # the old samples weigh under 1% now


def test_cold_start_uses_the_configured_maximum_until_enough_samples():
    learned = Learned(maximum=2.0, floor=0.25, quantile=0.99, margin=2.0, min_samples=5)
    body = chat_request()
    assert learned.window("tower", body) == (2.0, False)
    for _ in range(4):
        learned.observe("tower", body, 0.3)
    assert learned.window("tower", body) == (2.0, False)
    learned.observe("tower", body, 0.3)
    window, was_learned = learned.window("tower", body)
    assert was_learned
    assert 0.6 <= window <= 0.6 * 1.09  # 0.3 s x margin 2, within one bucket
    for _ in range(50):
        learned.observe("fast", body, 0.001)
        learned.observe("slow", body, 5.0)
    assert learned.window("fast", body) == (0.25, True)  # the floor
    assert learned.window("slow", body) == (2.0, True)  # never above the maximum


def test_prompt_sizes_are_learned_apart():
    learned = Learned(maximum=30.0, floor=0.1, min_samples=3)
    short, long = b"x" * 400, b"x" * 200_000  # 100 and 50k tokens (estimated)
    assert (bucket_of(short), bucket_of(long)) == ("1k", "64k")
    for _ in range(3):
        learned.observe("tower", short, 0.2)
    assert learned.window("tower", short)[1]
    assert learned.window("tower", long) == (30.0, False)


def test_two_saturations_in_a_row_under_a_learned_window_forget_it():
    learned = Learned(maximum=2.0, floor=0.1, min_samples=3)
    body = chat_request()
    for _ in range(3):
        learned.observe("tower", body, 0.05)
    assert learned.window("tower", body)[1]
    learned.saturated("tower", body, learned=True)
    assert learned.window("tower", body)[1]  # one may be a hiccup
    learned.saturated("tower", body, learned=True)
    assert learned.window("tower", body) == (2.0, False)  # a model swap: start over


@pytest.mark.parametrize(
    "opts",
    [
        {"floor": 3.0, "maximum": 2.0},
        {"quantile": 1.0},
        {"margin": 0},
        {"min_samples": 0},
        {"maximum": float("inf")},
    ],
)
def test_learned_options_are_checked(opts):
    with pytest.raises(ValueError):
        Learned(**opts)


def test_slow_after_auto_and_its_variables():
    assert SaturationWatchdog(None, slow_after="auto").learned == Learned()
    with pytest.raises(ValueError, match="auto"):
        SaturationWatchdog(None, slow_after="sometimes")
    settings = from_env(
        {
            "TIERCHAIN_STACK": "SaturationWatchdog",
            "TIERCHAIN_SLOW_AFTER": "auto",
            "TIERCHAIN_LEARNED_MAXIMUM": "2",
            "TIERCHAIN_LEARNED_MIN_SAMPLES": "10",
        }
    )
    built = settings.middleware_kwargs("SaturationWatchdog")["slow_after"]
    assert built == Learned(maximum=2.0, min_samples=10)


@on_virtual_time
async def test_learned_from_idle_requests_the_chain_moves_well_under_the_configured_window(
    metric, caplog
):
    saturated = False

    async def tower_script(ex: Exchange) -> None:
        if saturated:
            await ex.wait_closed_by_peer()  # another caller's long generation: ours waits
            return
        await streams(["from ", "tower"])(ex)

    async with (
        FakeBackend("tower", tower_script) as tower,
        FakeBackend("hosted", streams(["from ", "hosted"])) as hosted,
    ):
        forwarder = Forwarder()
        learned = Learned(maximum=2.0, floor=0.1, min_samples=5)
        watchdog = SaturationWatchdog(forwarder, slow_after=learned, status_interval=0)
        chain: Any = [Backend("tower", tower.url), Backend("hosted", hosted.url)]
        app = Failover(watchdog, routes=Routes({"echo": chain}))
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            for _ in range(5):  # idle: the tower's own normal is milliseconds
                r = await client.post(url + "/v1/chat/completions", content=chat_request())
                assert r.headers["x-tierchain-attempts"] == "tower;outcome=ok"
            saturated = True
            caplog.set_level(logging.WARNING, logger="tierchain")
            r = await client.post(url + "/v1/chat/completions", content=chat_request())
        await forwarder.aclose()
        await watchdog.aclose()
    assert r.content == HOSTED
    assert r.headers["x-tierchain-attempts"] == "tower;outcome=saturated, hosted;outcome=ok"
    # The tower was left when the learned window ended: the floor, not the configured 2 s.
    # (Its own record: what the caller waited also holds hosted's answer over real sockets.)
    (cut,) = [r for r in caplog.records if getattr(r, "event", "") == "dispatch.backend_saturated"]
    assert cut.tierchain["backend"] == "tower"
    assert 0.1 <= cut.tierchain["waited_s"] < 1.0
    gauge = metric("tierchain_learned_slow_after_seconds", backend="tower", bucket="1k")
    assert gauge == pytest.approx(learned.window("tower", chat_request())[0])
    assert 0.1 <= gauge < 1.0  # the floor, or twice the tower's own idle time


def test_a_learned_window_is_read_from_a_cache_that_follows_the_samples(monkeypatch):
    """A request reads the learned window without walking the sketch; the window follows
    new samples (at once while the sketch is young, then every 16 samples), and is always
    one of the sketch's bucket edges times the margin (a delay that recurs)."""
    learned = Learned(maximum=60.0, floor=0.1, margin=2.0, min_samples=5)
    body = chat_request()
    for _ in range(5):
        learned.observe("tower", body, 0.3)
    young, _ = learned.window("tower", body)
    for _ in range(30):
        learned.observe("tower", body, 3.0)  # the tower got slower
    older, was_learned = learned.window("tower", body)
    assert was_learned
    assert older > young * 5
    edges = {round(1e-3 * 1.08 ** (i + 1) * 2.0, 9) for i in range(200)}
    assert round(older, 9) in edges
    walks = 0
    quantile = LogSketch.quantile

    def counted(self: LogSketch, q: float) -> float | None:
        nonlocal walks
        walks += 1
        return quantile(self, q)

    monkeypatch.setattr(LogSketch, "quantile", counted)
    for _ in range(100):
        assert learned.window("tower", body) == (older, True)
    assert walks == 0
