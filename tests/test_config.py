"""Configuration from TIERCHAIN_* variables and the routes TOML file."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from tierchain import Backend, config, stack
from tierchain.allowance import Allowance
from tierchain.breaker import Breaker
from tierchain.budget import Budget
from tierchain.config import ConfigError, build_stack, from_env, load_routes
from tierchain.endpoints import Endpoints
from tierchain.failover import Failover
from tierchain.forwarder import Forwarder
from tierchain.heartbeats import Heartbeats
from tierchain.identity import StartupIdentity
from tierchain.prefer import PreferBackend
from tierchain.watchdog import SaturationWatchdog

from .support import FakeBackend, chat_request, completion_body, serve, until

TOKEN = "s3cret-admin-token-0123"

ROUTES = """
[[routes.echo.backends]]
name = "tower"
url = "http://127.0.0.1:11434"
regime = "local"
status_url = "http://127.0.0.1:11434/_gate/status"

[[routes.echo.backends]]
name = "hosted"
url = "https://api.example.com"
regime = "hosted"
model = "gpt-4o-mini"
api_key_env = "HOSTED_KEY"
"""


@pytest.fixture
def routes_file(tmp_path: Path) -> str:
    path = tmp_path / "routes.toml"
    path.write_text(ROUTES)
    return str(path)


def env(routes_file: str, **variables: str) -> dict[str, str]:
    return {"TIERCHAIN_ROUTES_FILE": routes_file, "HOSTED_KEY": "sk-live-xyz", **variables}


def problems_of(environ: dict[str, str]) -> tuple[str, ...]:
    with pytest.raises(ConfigError) as caught:
        from_env(environ)
    return caught.value.problems


def test_every_option_of_every_middleware_has_a_variable_or_is_declared_code_only():
    assert config.uncovered_options() == {}


def test_every_variable_reaches_the_keyword_of_its_middleware(routes_file):
    settings = from_env(
        env(
            routes_file,
            TIERCHAIN_HEARTBEAT_INTERVAL="2.5",
            TIERCHAIN_BUDGET_DEFAULT="10m",
            TIERCHAIN_BUDGET_HEADER="X-Deadline",
            TIERCHAIN_PREFER_HEADER="X-Tier",
            TIERCHAIN_FAILOVER_MAX_BODY="1MiB",
            TIERCHAIN_FAILOVER_RETRY_STATUSES="429, 503",
            TIERCHAIN_FAILOVER_PATHS="/v1/",
            TIERCHAIN_BREAKER_FAILURE_THRESHOLD="3",
            TIERCHAIN_BREAKER_SATURATION_COOLDOWN="15m",
            TIERCHAIN_BREAKER_WHEN_ALL_OPEN="try_soonest",
            TIERCHAIN_SLOW_AFTER="500ms",
            TIERCHAIN_FORWARDER_CONNECT_TIMEOUT="1.5",
        )
    )
    assert settings.middleware_kwargs("Heartbeats") == {"interval": 2.5}
    assert settings.middleware_kwargs("Budget") == {"default": 600.0, "header": "X-Deadline"}
    assert settings.middleware_kwargs("PreferBackend") == {"header": "X-Tier"}
    failover = settings.middleware_kwargs("Failover")
    assert failover["max_body"] == 2**20
    assert failover["retry_statuses"] == {429, 503}
    assert failover["paths"] == ("/v1/",)
    assert [b.name for b in failover["routes"]["echo"]] == ["tower", "hosted"]
    assert settings.middleware_kwargs("Breaker") == {
        "failure_threshold": 3,
        "saturation_cooldown": 900.0,
        "when_all_open": "try_soonest",
    }
    assert settings.middleware_kwargs("SaturationWatchdog") == {"slow_after": 0.5}
    assert settings.middleware_kwargs("Forwarder") == {"connect_timeout": 1.5}


def test_the_stack_is_built_in_the_briefs_order_with_the_configured_options(routes_file):
    settings = from_env(env(routes_file, TIERCHAIN_SLOW_AFTER="30"))
    app = build_stack(None, settings, identity=True)
    layers = []
    node = app
    while hasattr(node, "app"):
        layers.append(type(node))
        node = node.app
    layers.append(type(node))
    assert layers == [
        StartupIdentity,
        Endpoints,
        Heartbeats,
        Budget,
        PreferBackend,
        Failover,
        Breaker,
        SaturationWatchdog,
        Forwarder,
    ]
    watchdog = app
    while not isinstance(watchdog, SaturationWatchdog):
        watchdog = watchdog.app
    assert watchdog.slow_after == 30.0


def test_one_store_is_shared_by_every_piece_that_takes_one(routes_file):
    settings = from_env(env(routes_file, TIERCHAIN_STACK="PreferBackend,Failover,Breaker"))
    endpoints = build_stack(None, settings, identity=False)
    assert isinstance(endpoints, Endpoints)
    app = endpoints.app
    assert isinstance(app, PreferBackend)
    breaker = app.app.app
    assert isinstance(breaker, Breaker)
    assert app.store is not None
    assert breaker.store is app.store
    assert endpoints.store is app.store


def test_a_bad_value_names_the_variable_the_value_and_what_was_expected(routes_file):
    (problem,) = problems_of(env(routes_file, TIERCHAIN_BREAKER_FAILURE_THRESHOLD="zero"))
    assert "TIERCHAIN_BREAKER_FAILURE_THRESHOLD" in problem
    assert "'zero'" in problem
    assert "expected a whole number >= 1" in problem


def test_every_problem_is_reported_at_once_not_just_the_first(routes_file):
    problems = problems_of(
        env(
            routes_file,
            TIERCHAIN_HEARTBEAT_INTERVAL="-1",
            TIERCHAIN_BUDGET_DEFAULT="soon",
            TIERCHAIN_SLOW_AFTER="30 minutes",
            TIERCHAIN_BREAKER_WHEN_ALL_OPEN="panic",
        )
    )
    named = sorted(p.split("=", 1)[0] for p in problems)
    assert named == [
        "TIERCHAIN_BREAKER_WHEN_ALL_OPEN",
        "TIERCHAIN_BUDGET_DEFAULT",
        "TIERCHAIN_HEARTBEAT_INTERVAL",
        "TIERCHAIN_SLOW_AFTER",
    ]


def test_a_misspelt_variable_fails_instead_of_leaving_a_safeguard_off(routes_file):
    (problem,) = problems_of(env(routes_file, TIERCHAIN_SLOWAFTER="30"))
    assert (
        problem
        == "TIERCHAIN_SLOWAFTER is not a tierchain variable; did you mean TIERCHAIN_SLOW_AFTER?"
    )


def test_the_test_harness_variables_from_the_benchmarks_page_do_not_stop_serve(routes_file):
    # docs/benchmarks.md: eval "$(bash .ci/llama_server.sh | sed 's/^/export /')"
    settings = from_env(
        env(
            routes_file,
            TIERCHAIN_LLAMA_SERVER="/opt/llama.cpp/build/bin/llama-server",
            TIERCHAIN_SMOLLM2_GGUF="/tmp/smollm2-135m-instruct-q8_0.gguf",
        )
    )
    assert settings.routes is not None


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [("30", 30.0), ("2.5", 2.5), ("500ms", 0.5), ("15m", 900.0), ("2h", 7200.0), (" 1d ", 86400.0)],
)
def test_durations_take_seconds_or_a_unit(raw, seconds, routes_file):
    settings = from_env(env(routes_file, TIERCHAIN_BREAKER_SATURATION_COOLDOWN=raw))
    assert settings.middleware_kwargs("Breaker")["saturation_cooldown"] == seconds


def test_a_budget_default_of_none_means_no_default(routes_file):
    settings = from_env(env(routes_file, TIERCHAIN_BUDGET_DEFAULT="none"))
    assert settings.middleware_kwargs("Budget") == {"default": None}


def test_slow_after_allowance_builds_the_allowance_from_its_variables(routes_file):
    settings = from_env(
        env(routes_file, TIERCHAIN_SLOW_AFTER="allowance", TIERCHAIN_ALLOWANCE_BASE="60")
    )
    allowance = settings.middleware_kwargs("SaturationWatchdog")["slow_after"]
    assert isinstance(allowance, Allowance)
    assert allowance.base == 60.0
    assert allowance.cold_start == Allowance().cold_start


def test_an_allowance_variable_without_slow_after_allowance_is_a_problem(routes_file):
    (problem,) = problems_of(env(routes_file, TIERCHAIN_ALLOWANCE_BASE="60"))
    assert problem.startswith("TIERCHAIN_ALLOWANCE_BASE is set but has no effect")
    assert "TIERCHAIN_SLOW_AFTER=allowance" in problem


def test_the_admin_token_is_never_shown_not_even_when_it_is_wrong(routes_file):
    (problem,) = problems_of(env(routes_file, TIERCHAIN_ADMIN_TOKEN="tooshort"))
    assert "tooshort" not in problem
    assert problem.startswith("TIERCHAIN_ADMIN_TOKEN=<8 characters, not shown>: expected 16")
    settings = from_env(env(routes_file, TIERCHAIN_ADMIN_TOKEN=TOKEN))
    assert TOKEN not in repr(settings.effective())
    assert settings.effective()["options"]["Admin"]["token"] == "***"


def test_a_store_password_is_masked(routes_file):
    settings = from_env(env(routes_file, TIERCHAIN_STORE_URL="redis://:hunter2@10.0.0.9:6379/0"))
    assert settings.effective()["store_url"] == "redis://***@10.0.0.9:6379/0"


def test_the_stack_variable_picks_middlewares_but_not_their_order(routes_file):
    settings = from_env(env(routes_file, TIERCHAIN_STACK="budget, Failover"))
    assert settings.stack == ("Budget", "Failover")
    (problem,) = problems_of(env(routes_file, TIERCHAIN_STACK="Failover,Budget"))
    assert problem.startswith("TIERCHAIN_STACK='Failover,Budget': expected")
    assert "list them as Budget,Failover" in problem
    (problem,) = problems_of(env(routes_file, TIERCHAIN_STACK="Budget,Retry"))
    assert "'Retry' is not one of" in problem


def test_failover_without_a_routes_file_is_a_problem_naming_the_variable():
    (problem,) = problems_of({})
    assert problem.startswith("TIERCHAIN_ROUTES_FILE is not set: Failover needs routes")
    assert from_env({"TIERCHAIN_STACK": "Budget"}).stack == ("Budget",)


def test_a_value_the_middleware_itself_rejects_fails_at_build_naming_the_variables(routes_file):
    settings = from_env(
        env(
            routes_file,
            TIERCHAIN_STORE_URL="redis://127.0.0.1:1/0",
            TIERCHAIN_REDIS_TTL="0.5",
        )
    )
    with pytest.raises(ConfigError) as caught:
        build_stack(None, settings)
    (problem,) = caught.value.problems
    assert "TIERCHAIN_REDIS_TTL=0.5" in problem
    assert "ttl" in problem


# -- the routes file ----------------------------------------------------------------


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return str(path)


def test_routes_come_from_the_toml_file_with_api_keys_from_variables(routes_file):
    routes = load_routes(routes_file, environ={"HOSTED_KEY": "sk-live-xyz"})
    tower, hosted = routes["echo"]
    assert (tower.name, tower.url, tower.regime) == ("tower", "http://127.0.0.1:11434", "local")
    assert tower.status_url == "http://127.0.0.1:11434/_gate/status"
    assert hosted.model == "gpt-4o-mini"
    assert hosted.headers == {"Authorization": "Bearer sk-live-xyz"}


def test_a_bad_backend_names_its_key_path(tmp_path):
    path = write(
        tmp_path,
        """
[[routes.echo.backends]]
name = "tower"
url = "http://127.0.0.1:11434"

[[routes.echo.backends]]
name = "hosted"
url = "ftp://api.example.com"
""",
    )
    with pytest.raises(ConfigError) as caught:
        load_routes(path, environ={})
    (problem,) = caught.value.problems
    assert problem.startswith(
        f"{path}: routes.echo.backends[1].url='ftp://api.example.com' (backend 'hosted'): "
    )
    assert "http or https" in problem


def test_every_routes_problem_is_listed_with_its_key_path(tmp_path):
    path = write(
        tmp_path,
        """
[[routes.echo.backends]]
name = "tower"
url = "http://127.0.0.1:11434"
regimen = "local"

[[routes.echo.backends]]
url = "http://127.0.0.1:8000"

[[routes.echo.backends]]
name = "tower"
url = "http://127.0.0.1:8001"

[[routes.chat.backends]]
name = "hosted"
url = "https://api.example.com"
api_key_env = "MISSING_KEY"

[routes.empty]
""",
    )
    with pytest.raises(ConfigError) as caught:
        load_routes(path, environ={})
    problems = caught.value.problems
    assert all(p.startswith(f"{path}: ") for p in problems)  # each names the file
    keys = [p.removeprefix(f"{path}: ").split(":", 1)[0].split("=", 1)[0] for p in problems]
    assert [k.split(" (")[0] for k in keys] == [
        "routes.echo.backends[0].regimen",
        "routes.echo.backends[1].name",
        "routes.echo.backends[2].name",
        "routes.chat.backends[0].api_key_env",
        "routes.empty.backends",
    ]
    assert "(backend 'hosted')" in problems[3]  # and the backend, by its name
    assert "did you mean regime?" in problems[0]
    assert "MISSING_KEY is not set" in problems[3]


def test_a_routes_file_that_is_not_toml_names_the_variable(tmp_path):
    path = write(tmp_path, "[routes.echo\n")
    problems = problems_of({"TIERCHAIN_ROUTES_FILE": path})
    assert problems[0].startswith(f"TIERCHAIN_ROUTES_FILE={path!r}: not valid TOML")
    problems = problems_of({"TIERCHAIN_ROUTES_FILE": str(tmp_path / "nope.toml")})
    assert "cannot read it" in problems[0]


# -- end to end -----------------------------------------------------------------------


async def test_a_gateway_configured_only_by_variables_answers_through_the_whole_stack(tmp_path):
    async def answer(ex):
        await ex.respond(200, completion_body("hello"))

    async with FakeBackend("tower", answer) as tower:
        path = write(
            tmp_path,
            f'[[routes.echo.backends]]\nname = "tower"\nurl = "{tower.url}"\n',
        )
        settings = from_env({"TIERCHAIN_ROUTES_FILE": path, "TIERCHAIN_SLOW_AFTER": "5"})
        app = build_stack(None, settings, identity=False)
        async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=5) as client:
            response = await client.post(
                url + "/v1/chat/completions", content=chat_request(stream=False)
            )
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "hello"
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=ok"


async def test_the_admin_app_is_mounted_only_when_a_token_is_set(routes_file):
    settings = from_env(env(routes_file, TIERCHAIN_ADMIN_TOKEN=TOKEN))
    app = build_stack(None, settings, identity=False)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        ok = await client.get("/admin/tierchain/pins", headers={"authorization": f"Bearer {TOKEN}"})
        denied = await client.get("/admin/tierchain/pins")
    assert ok.status_code == 200
    assert denied.status_code == 401
    plain = build_stack(None, from_env(env(routes_file)), identity=False)
    assert not isinstance(plain, stack.Mount)


def test_the_old_import_path_of_build_stack_still_works_without_an_import_cycle():
    from tierchain.config import build_stack as old_path

    assert old_path is stack.build_stack
    assert "build_stack" in config.__all__
    # config imports nothing that imports it back: only the backend types, the exceptions,
    # the URL masker, the routes file's parser (which imports no other tierchain module but
    # these and the duration checks) and its own rooms (the option table, its parsers, the
    # settings, the warnings), at module level.
    tree = ast.parse(Path(config.__file__).read_text())
    imported = {
        node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    }
    rooms = {"options", "env_parsers", "settings", "misconfig"}
    assert imported == {"backend", "errors", "masking", "routes_file"} | rooms
    for room in rooms:
        tree = ast.parse((Path(config.__file__).parent / f"{room}.py").read_text())
        assert not [
            node
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module in ("config", "stack")
        ], room
    with pytest.raises(AttributeError):
        _ = config.no_such_name


def test_forward_caller_auth_is_a_boolean_per_backend_and_off_by_default(tmp_path):
    path = write(
        tmp_path,
        """
[[routes.echo.backends]]
name = "tower"
url = "http://127.0.0.1:11434"

[[routes.echo.backends]]
name = "gate"
url = "http://127.0.0.1:8000"
forward_caller_auth = true
""",
    )
    tower, gate = load_routes(path, environ={})["echo"]
    assert (tower.forward_caller_auth, gate.forward_caller_auth) == (False, True)
    bad = write(
        tmp_path,
        """
[[routes.echo.backends]]
name = "gate"
url = "http://127.0.0.1:8000"
forward_caller_auth = "yes"
""",
    )
    with pytest.raises(ConfigError) as caught:
        load_routes(bad, environ={})
    (problem,) = caught.value.problems
    assert problem.startswith(
        f"{bad}: routes.echo.backends[0].forward_caller_auth='yes' (backend 'gate'): expected true"
    )


@pytest.mark.redis
async def test_the_redis_store_build_stack_made_is_closed_on_lifespan_shutdown(
    routes_file, redis_server
):
    import redis.asyncio as redis_client

    settings = from_env(env(routes_file, TIERCHAIN_STORE_URL=redis_server.url))
    app = build_stack(None, settings, identity=False)
    assert isinstance(app, stack.CloseOnShutdown)
    store = app.app.store  # the Endpoints share it with every Breaker and PreferBackend
    watcher = redis_client.Redis.from_url(redis_server.url)
    try:
        async with LifespanManager(app):
            await store.set_pin("echo", "tower", 30)  # opens a connection to the server
            assert len(await watcher.client_list()) == 2

        async def only_the_watchers() -> bool:  # redis-server sees the close when it gets to it
            return len(await watcher.client_list()) == 1

        await until(only_the_watchers, "only the watcher's connection left", limit=10.0)
    finally:
        await watcher.aclose()
    # A store given by the caller belongs to the caller: nothing wraps the stack to close it.
    given = build_stack(None, settings, store=config.layer_class("MemoryStore")(), identity=False)
    assert not isinstance(given, stack.CloseOnShutdown)


# -- routes file parity: every Backend option, every problem at once --------------------


def test_every_backend_option_has_a_key_in_the_routes_file():
    from dataclasses import fields

    from tierchain.config import BACKEND_KEYS

    # headers: headers + api_key_*; pool: set by Pool, not an option (a pool is its own entry)
    options = {f.name for f in fields(Backend) if f.init} - {"headers"}
    keys = {k.name for k in BACKEND_KEYS if k.field}
    assert options == keys


def test_the_routes_file_takes_stream_end_stall_after_and_every_other_backend_option(tmp_path):
    path = write(
        tmp_path,
        """
[[routes.echo.backends]]
name = "tower"
url = "http://127.0.0.1:11434"
regime = "local"
status_url = "http://127.0.0.1:11434/metrics"
model = "llama3"
stream_end = "openai"
stall_after = "5m"
forward_caller_auth = true
max_in_flight = 2
headers = { "X-Team" = "ml" }

[[routes.echo.backends]]
name = "plain"
url = "http://127.0.0.1:8000"
stream_end = false
stall_after = 2.5

[[routes.echo.backends]]
name = "quick"
url = "http://127.0.0.1:8001"
stall_after = "500ms"
""",
    )
    tower, plain, quick = load_routes(path, environ={})["echo"]
    assert tower == Backend(
        name="tower",
        url="http://127.0.0.1:11434",
        regime="local",
        status_url="http://127.0.0.1:11434/metrics",
        model="llama3",
        stream_end="openai",
        stall_after=300.0,
        forward_caller_auth=True,
        max_in_flight=2,
    )
    assert tower.headers == {"X-Team": "ml"}
    assert (plain.stream_end, plain.stall_after) == (None, 2.5)  # false: any clean end
    assert (quick.stream_end, quick.stall_after) == ("openai", 0.5)


@pytest.mark.parametrize(
    ("value", "seconds"), [("30", 30.0), ("2.5", 2.5), ("1e-3", 0.001), ('"90s"', 90.0)]
)
def test_stall_after_takes_a_toml_number_or_a_string_with_a_unit(tmp_path, value, seconds):
    path = write(
        tmp_path,
        '[[routes.echo.backends]]\nname = "t"\nurl = "http://127.0.0.1:1"\n'
        f"stall_after = {value}\n",
    )
    (backend,) = load_routes(path, environ={})["echo"]
    assert backend.stall_after == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('stall_after = "soon"', "stall_after='soon' (backend 'tower'): expected seconds"),
        ("stall_after = 0", "stall_after=0 (backend 'tower'): expected seconds"),
        ("stall_after = -3", "stall_after=-3 (backend 'tower'): expected seconds"),
        ("stall_after = true", "stall_after=True (backend 'tower'): expected seconds"),
        ("stall_after = inf", "stall_after=inf (backend 'tower'): expected seconds"),
        ('stream_end = ""', "stream_end='' (backend 'tower'): expected a non-empty string"),
        ("stream_end = true", "stream_end=True (backend 'tower'): expected a non-empty string"),
        ("max_in_flight = 1.5", "max_in_flight=1.5 (backend 'tower'): expected a whole number"),
        ('api_key_header = "x api key"', "api_key_header='x api key' (backend 'tower')"),
    ],
)
def test_a_bad_backend_value_names_the_file_the_route_the_backend_and_the_key(
    tmp_path, line, expected
):
    path = write(
        tmp_path,
        f'[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:1"\n'
        f'api_key_env = "KEY"\n{line}\n',
    )
    with pytest.raises(ConfigError) as caught:
        load_routes(path, environ={"KEY": "k"})
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}: routes.echo.backends[0].{expected}")


def test_every_problem_of_one_backend_is_listed_at_once(tmp_path):
    path = write(
        tmp_path,
        """
[[routes.echo.backends]]
name = "tower one"
url = "ftp://10.0.0.5"
status_url = "not a url"
max_in_flight = 0
stall_after = "soon"
api_key_header = "x-api-key"
""",
    )
    with pytest.raises(ConfigError) as caught:
        load_routes(path, environ={})
    keys = [p.removeprefix(f"{path}: ").split("=", 1)[0] for p in caught.value.problems]
    assert keys == [
        "routes.echo.backends[0].name",
        "routes.echo.backends[0].url",
        "routes.echo.backends[0].status_url",
        "routes.echo.backends[0].max_in_flight",
        "routes.echo.backends[0].stall_after",
        "routes.echo.backends[0].api_key_header",
    ]
    assert "has no effect without api_key_env" in caught.value.problems[-1]


def test_api_key_env_goes_in_the_header_it_names(tmp_path):
    path = write(
        tmp_path,
        """
[[routes.chat.backends]]
name = "openai"
url = "https://api.openai.com"
api_key_env = "OPENAI_KEY"

[[routes.chat.backends]]
name = "anthropic"
url = "https://api.anthropic.com"
api_key_env = "ANTHROPIC_KEY"
api_key_header = "x-api-key"
headers = { "anthropic-version" = "2023-06-01" }

[[routes.chat.backends]]
name = "gate"
url = "http://127.0.0.1:8000"
api_key_env = "GATE_KEY"
api_key_header = "Authorization"
api_key_prefix = "Token "
""",
    )
    environ = {"OPENAI_KEY": "sk-o", "ANTHROPIC_KEY": "sk-ant-a", "GATE_KEY": "g-1"}
    openai_tier, anthropic_tier, gate = load_routes(path, environ=environ)["chat"]
    assert openai_tier.headers == {"Authorization": "Bearer sk-o"}
    assert anthropic_tier.headers == {"anthropic-version": "2023-06-01", "x-api-key": "sk-ant-a"}
    assert gate.headers == {"Authorization": "Token g-1"}


def test_an_api_key_header_also_set_in_headers_is_a_problem_that_shows_no_value(tmp_path):
    path = write(
        tmp_path,
        """
[[routes.chat.backends]]
name = "anthropic"
url = "https://api.anthropic.com"
api_key_env = "ANTHROPIC_KEY"
api_key_header = "x-api-key"
headers = { "X-Api-Key" = "sk-ant-written-in-the-file" }
""",
    )
    with pytest.raises(ConfigError) as caught:
        load_routes(path, environ={"ANTHROPIC_KEY": "sk-ant-from-env"})
    (problem,) = caught.value.problems
    assert problem.startswith(f"{path}: routes.chat.backends[0].headers.X-Api-Key (backend")
    assert "in one place only" in problem
    assert "sk-ant" not in problem


def layers_of(app: object) -> dict[str, Any]:
    """The stack's pieces by class name, outermost first (following each one's ``app``)."""
    found: dict[str, Any] = {}
    while app is not None:
        found.setdefault(type(app).__name__, app)
        app = getattr(app, "app", None)
    return found


def test_each_built_stack_wires_its_own_watchdogs_status_board_into_the_breaker_and_failover(
    routes_file,
):
    settings = from_env(env(routes_file))
    first = layers_of(build_stack(None, settings, identity=False))
    second = layers_of(build_stack(None, settings, identity=False))  # built last
    board = first["SaturationWatchdog"].board
    assert board is not None
    assert board is not second["SaturationWatchdog"].board
    assert first["Breaker"].status_board is board
    assert first["Failover"].status_board is board
    assert second["Breaker"].status_board is second["SaturationWatchdog"].board
