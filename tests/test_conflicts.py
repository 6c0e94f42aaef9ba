"""Options that load one by one but cannot work together are refused at start-up.

``tierchain serve``, ``check-config`` and ``build_stack`` each refuse them with one
sentence and a hint (``tierchain.stack.conflicts``), and ``CallerKeys`` refuses to be
built in front of ``KeyLimits`` with open paths where it can see that: none of them
becomes a 500 on a request (docs/configuration.md, "Options that cannot work together").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tierchain.config import ConfigError, from_env
from tierchain.keys import CallerKey, CallerKeys
from tierchain.limits import KeyLimits
from tierchain.stack import build_stack

from .test_cli import run_check
from .test_serve import START_TIMEOUT, tierchain_serve

KEY = "sk-gw-team-a-0123456789"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    routes = tmp_path / "routes.toml"
    routes.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\n'
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "http://127.0.0.1:10"\n'
    )
    return {"TIERCHAIN_ROUTES_FILE": str(routes), "dir": str(tmp_path)}


def keys_file(files: dict[str, str], body: str) -> str:
    path = Path(files["dir"]) / "keys.toml"
    path.write_text(f'[[keys]]\nname = "a"\nkey = "{KEY}"\n{body}')
    return str(path)


def problems(environ: dict[str, str]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        build_stack(None, from_env(environ), identity=False)
    return caught.value.problems


@pytest.mark.parametrize(
    "limit", ["rpm = 5\n", "tpm = 500\n", "budget_tokens = 1000\n"], ids=["rpm", "tpm", "budget"]
)
def test_open_paths_with_a_key_limit_refuse_to_build_naming_both_variables(files, limit):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_API_KEYS_FILE": keys_file(files, limit),
        "TIERCHAIN_API_KEYS_OPEN_PATHS": "/api/",
    }
    (problem,) = problems(env)
    assert problem.startswith(
        "TIERCHAIN_API_KEYS_OPEN_PATHS=/api/ cannot work with key limits ('a') in "
        "TIERCHAIN_API_KEYS_FILE"
    )
    assert "remove the open paths, or the limits" in problem
    code, out = run_check({k: v for k, v in env.items()})
    assert code == 2
    assert "cannot work with key limits ('a')" in out


def test_open_paths_with_backend_budgets_refuse_to_build(files):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_API_KEYS_FILE": keys_file(
            files, '\n[[backend_budgets]]\nbackend = "hosted"\ntokens = 9\n'
        ),
        "TIERCHAIN_API_KEYS_OPEN_PATHS": "/api/",
    }
    (problem,) = problems(env)
    assert "cannot work with [[backend_budgets]]" in problem


def test_open_paths_with_keys_that_have_no_limit_still_build(files):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_API_KEYS_FILE": keys_file(files, ""),
        "TIERCHAIN_API_KEYS_OPEN_PATHS": "/api/",
    }
    assert build_stack(None, from_env(env), identity=False) is not None


async def test_serve_refuses_open_paths_with_limits_and_exits_2(files):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_API_KEYS_FILE": keys_file(files, "rpm = 5\n"),
        "TIERCHAIN_API_KEYS_OPEN_PATHS": "/api/",
    }
    async with tierchain_serve(env) as served:
        status = await served.exit_status(START_TIMEOUT)
    assert status == 2
    assert "cannot work with key limits ('a')" in "\n".join(served.lines)


async def _noop(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
    return None


def test_callerkeys_with_open_paths_in_front_of_keylimits_is_refused_when_built():
    limited = CallerKey("a", KEY, rpm=5)
    with pytest.raises(ValueError, match="open_paths cannot stand in front of KeyLimits"):
        CallerKeys(KeyLimits(_noop), keys=[limited], open_paths=["/api/"])
    # Without open paths, or without a limit to hold, the same pair is fine.
    CallerKeys(KeyLimits(_noop), keys=[limited])
    CallerKeys(KeyLimits(_noop), keys=[CallerKey("b", KEY)], open_paths=["/api/"])


async def test_an_anonymous_request_on_an_open_path_passes_keylimits_without_a_500():
    """Composed where CallerKeys cannot see KeyLimits behind it, an anonymous request on an
    open path still gets its answer: no key to limit, nothing raised."""
    seen = []

    async def handler(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    class Opaque:  # hides what stands behind it (no .app)
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await self._inner(scope, receive, send)

    app = CallerKeys(
        Opaque(KeyLimits(handler)), keys=[CallerKey("b", KEY, rpm=5)], open_paths=["/api/"]
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.post("/api/chat", json={})
    assert r.status_code == 200
    assert seen == ["/api/chat"]


def test_serves_own_forwarder_without_failover_is_refused(files):
    env = {"TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"], "TIERCHAIN_STACK": "Budget"}
    (problem,) = problems(env)
    assert problem.startswith("TIERCHAIN_STACK=Budget leaves Failover out")
    code, out = run_check(env)
    assert code == 2
    assert "add Failover to TIERCHAIN_STACK" in out
    # A host's own handler behind the same stack routes by itself: nothing to refuse.
    assert build_stack(_noop, from_env(env), identity=False) is not None


def test_a_steering_key_without_preferbackend_in_the_stack_is_refused(files):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_API_KEYS_FILE": keys_file(files, 'backend = "hosted"\n'),
        "TIERCHAIN_STACK": "Failover",
    }
    (problem,) = problems(env)
    assert problem.startswith("keys 'a' steer (prefer or backend) but PreferBackend is not")


@pytest.mark.parametrize(
    ("body", "start"),
    [
        ('backend = "gpu"\n', "key 'a': backend = 'gpu' is no backend or pool of any route"),
        (
            '\n[[backend_budgets]]\nbackend = "gpu"\ntokens = 9\n',
            "[[backend_budgets]] backend = 'gpu' is no backend of any route",
        ),
    ],
    ids=["key_backend", "backend_budget"],
)
def test_a_backend_name_no_route_has_is_refused(files, body, start):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_API_KEYS_FILE": keys_file(files, body),
    }
    (problem,) = problems(env)
    assert problem.startswith(start)
    assert "(known: hosted, tower)" in problem


def test_open_paths_without_any_key_are_refused(files):
    env = {**{"TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"]}}
    env["TIERCHAIN_API_KEYS_OPEN_PATHS"] = "/api/"
    (problem,) = problems(env)
    assert "CallerKeys needs at least one key" in problem


def test_the_options_of_a_layer_left_out_of_the_stack_are_not_refused(files):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_STACK": "Failover",
        "TIERCHAIN_BUDGET_DEFAULT": "30",
    }
    assert build_stack(None, from_env(env), identity=False) is not None


@pytest.mark.parametrize(
    ("variable", "what"),
    [
        ("TIERCHAIN_ADMIN_TOKEN", "administer the gateway"),
        ("TIERCHAIN_METRICS_KEY", "read /metrics"),
    ],
)
def test_an_operator_secret_equal_to_a_caller_key_is_refused(files, variable, what):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_API_KEYS": f"{KEY},sk-gw-other-0123456789abc",
        variable: KEY,
    }
    (problem,) = problems(env)
    assert problem == (
        f"{variable} is the same as caller key 'key-1': that caller could {what}; "
        "give it a value of its own"
    )
    assert KEY not in problem


def test_a_waiting_room_no_request_could_ever_wait_in_is_refused(files):
    env = {
        "TIERCHAIN_ROUTES_FILE": files["TIERCHAIN_ROUTES_FILE"],
        "TIERCHAIN_FAILOVER_WAITING_ROOM": "on",
    }
    (problem,) = problems(env)
    assert problem.startswith("TIERCHAIN_FAILOVER_WAITING_ROOM=on, but no route has every")
    routes = Path(files["dir"]) / "limited.toml"
    routes.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:9"\nmax_in_flight = 2\n'
    )
    env["TIERCHAIN_ROUTES_FILE"] = str(routes)
    assert build_stack(None, from_env(env), identity=False) is not None
