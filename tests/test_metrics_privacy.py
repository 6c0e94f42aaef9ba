"""Nothing one caller sends can be read by another from the gateway's answers or /metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from tierchain.config import from_env
from tierchain.endpoints import Endpoints
from tierchain.keys import CallerKey, CallerKeys
from tierchain.stack import build_stack

from .support import FakeBackend, serve
from .test_pools import Gateway, say, tower, turns

KEY_A = "sk-gw-alice-0123456789abcdef"
KEY_B = "sk-gw-mallory-0123456789abcd"


async def test_a_key_cannot_hit_the_affinity_another_key_left_with_its_prompt(metric) -> None:
    hits = {"route": "echo", "pool": "tower", "result": "hit"}
    async with FakeBackend("a") as a, FakeBackend("b") as b:
        gw = Gateway([tower(a, b)])
        app = CallerKeys(gw.app, keys=[CallerKey("alice", KEY_A), CallerKey("mallory", KEY_B)])
        async with serve(app) as url, httpx.AsyncClient() as client:
            alice = {"authorization": f"Bearer {KEY_A}"}
            mallory = {"authorization": f"Bearer {KEY_B}"}
            first = await say(client, url, turns(7, 1), **alice)
            before = metric("tierchain_pool_affinity_total", **hits)
            # Mallory guesses Alice's whole prompt right: no hit, nothing to read.
            await say(client, url, turns(7, 2), **mallory)
            guessed = metric("tierchain_pool_affinity_total", **hits)
            # Alice's own next turn still finds her replica.
            again = await say(client, url, turns(7, 2), **alice)
            own = metric("tierchain_pool_affinity_total", **hits)
        await gw.aclose()
    assert guessed == before
    assert own == before + 1
    assert again == first


METRICS_KEY = "sk-metrics-0123456789abcdef"


async def test_metrics_answer_only_the_metrics_key_when_one_is_set(tmp_path) -> None:
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    settings = from_env(
        {
            "TIERCHAIN_ROUTES_FILE": str(routes),
            "TIERCHAIN_IDENTITY": "off",
            "TIERCHAIN_METRICS_KEY": METRICS_KEY,
        }
    )
    assert METRICS_KEY not in json.dumps(settings.effective())
    app = build_stack(None, settings)
    async with serve(app, lifespan="on") as url, httpx.AsyncClient() as client:
        bare = await client.get(url + "/metrics")
        wrong = await client.get(url + "/metrics", headers={"authorization": "Bearer nope"})
        right = await client.get(
            url + "/metrics", headers={"authorization": f"Bearer {METRICS_KEY}"}
        )
        health = await client.get(url + "/healthz")
    assert [bare.status_code, wrong.status_code, right.status_code] == [401, 401, 200]
    assert bare.json()["error"]["code"] == "missing_metrics_key"
    assert "tierchain_" in right.text
    assert health.status_code == 200  # the others stay open


def test_a_metrics_key_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="metrics_key"):
        Endpoints(metrics_key="short")


@pytest.mark.parametrize(
    ("env", "served"),
    [
        ({}, False),  # keys off: anyone may probe the affinity with a guessed prompt
        ({"TIERCHAIN_METRICS_KEY": METRICS_KEY}, True),  # /metrics is the operator's
        ({"TIERCHAIN_API_KEYS": KEY_A}, True),  # the affinity is per key
        ({"TIERCHAIN_API_KEYS": KEY_A, "TIERCHAIN_API_KEYS_OPEN_PATHS": "/api/"}, False),
    ],
    ids=["keys_off", "metrics_key", "keys_on", "open_paths"],
)
async def test_metrics_serve_the_prefix_affinity_counter_only_where_no_caller_can_probe_it(
    tmp_path, env, served
) -> None:
    from tierchain.telemetry import POOL_AFFINITY

    POOL_AFFINITY.labels("echo", "tower", "hit").inc()  # a hit someone's prompt made
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n')
    settings = from_env({"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_IDENTITY": "off", **env})
    app = build_stack(None, settings)
    headers = {"authorization": f"Bearer {METRICS_KEY}"} if env.get("TIERCHAIN_METRICS_KEY") else {}
    async with serve(app, lifespan="on") as url, httpx.AsyncClient() as client:
        text = (await client.get(url + "/metrics", headers=headers)).text
    assert ("tierchain_pool_affinity" in text) is served
    assert "tierchain_pool_picks" in text  # the rest is served either way
    assert text.endswith("\n")
