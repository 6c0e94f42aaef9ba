"""The tierchain command line: check-config, burst-probe, demo."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tierchain.__main__ import burst_probe, check_config, main

from .support import FakeBackend, completion_body
from .test_burst import drained

TOKEN = "cli-admin-token-0123456789"


@pytest.fixture
def routes_file(tmp_path: Path) -> str:
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n'
        'regime = "local"\n\n'
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "https://api.example.com"\n'
        'regime = "hosted"\napi_key_env = "HOSTED_KEY"\n'
    )
    return str(path)


def run_check(environ: dict[str, str], *, as_json: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    code = check_config(as_json=as_json, environ=environ, out=out)
    return code, out.getvalue()


def test_check_config_prints_the_stack_outermost_first_then_routes_and_settings(routes_file):
    code, text = run_check(
        {
            "TIERCHAIN_ROUTES_FILE": routes_file,
            "HOSTED_KEY": "sk-very-secret",
            "TIERCHAIN_SLOW_AFTER": "45",
            "TIERCHAIN_ADMIN_TOKEN": TOKEN,
        }
    )
    assert code == 0
    assert "configuration OK" in text
    order = [
        "StartupIdentity",
        "Admin ",
        "Endpoints",
        "Heartbeats",
        "Budget",
        "PreferBackend",
        "Failover",
        "Breaker",
        "SaturationWatchdog",
        "handler: Forwarder",
    ]
    positions = [text.index(name) for name in order]
    assert positions == sorted(positions)
    assert "slow_after=45.0 (TIERCHAIN_SLOW_AFTER)" in text
    assert "saturation_cooldown=900.0" in text
    assert "1. tower        http://127.0.0.1:11434  regime=local" in text
    assert "headers=Authorization" in text
    assert "sk-very-secret" not in text
    assert TOKEN not in text
    assert "token=***" in text


def test_check_config_lists_every_problem_and_exits_2(routes_file):
    code, text = run_check(
        {
            "TIERCHAIN_ROUTES_FILE": routes_file,
            "TIERCHAIN_BREAKER_FAILURE_THRESHOLD": "0",
            "TIERCHAIN_HEARTBEAT_INTERVALL": "5",
        }
    )
    assert code == 2
    assert "3 configuration problem(s)" in text
    assert "TIERCHAIN_BREAKER_FAILURE_THRESHOLD='0': expected a whole number >= 1" in text
    assert "did you mean TIERCHAIN_HEARTBEAT_INTERVAL?" in text
    assert "routes.echo.backends[1].api_key_env='HOSTED_KEY'" in text


def test_check_config_reports_what_a_middleware_itself_rejects(routes_file):
    code, text = run_check(
        {
            "TIERCHAIN_ROUTES_FILE": routes_file,
            "HOSTED_KEY": "k",
            "TIERCHAIN_STORE_URL": "redis://127.0.0.1:1/0",
            "TIERCHAIN_REDIS_TTL": "0.5",
        }
    )
    assert code == 2
    assert "TIERCHAIN_REDIS_TTL=0.5" in text


def test_check_config_json_is_machine_readable(routes_file):
    code, text = run_check(
        {"TIERCHAIN_ROUTES_FILE": routes_file, "HOSTED_KEY": "k", "TIERCHAIN_STACK": "Failover"},
        as_json=True,
    )
    assert code == 0
    doc = json.loads(text)
    assert [row["name"] for row in doc["stack"]] == [
        "StartupIdentity",
        "Endpoints",
        "Failover",
        "handler: Forwarder",
    ]
    assert [b["name"] for b in doc["routes"]["echo"]] == ["tower", "hosted"]
    code, text = run_check({}, as_json=True)
    assert code == 2
    assert json.loads(text)["ok"] is False


def test_the_installed_command_runs_check_config(routes_file):
    env = {"TIERCHAIN_ROUTES_FILE": routes_file, "HOSTED_KEY": "k", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "tierchain", "check-config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "configuration OK" in done.stdout


def test_burst_probe_without_yes_refuses_and_names_the_number_of_calls(capsys):
    code = main(["burst-probe", "http://127.0.0.1:9/v1", "--model", "m"])
    err = capsys.readouterr().err
    assert code == 2
    assert "would make 138 calls to http://127.0.0.1:9/v1/chat/completions" in err
    assert "concurrency 1, 5, 10, 30, 3 repeats each, max_tokens 1" in err
    assert "Nothing was sent. Add --yes to run it." in err


async def test_burst_probe_without_yes_sends_nothing():
    async with FakeBackend("b") as backend:
        err = io.StringIO()
        code = burst_probe(backend.url, model="m", yes=False, err=err)
        await asyncio.sleep(0.05)
    assert code == 2
    assert backend.requests == []


def test_burst_probe_names_a_missing_api_key_variable():
    err = io.StringIO()
    code = burst_probe(
        "http://127.0.0.1:9", model="m", yes=True, api_key_env="NO_SUCH_KEY", environ={}, err=err
    )
    assert code == 2
    assert "--api-key-env NO_SUCH_KEY: that variable is not set" in err.getvalue()


async def test_burst_probe_with_yes_runs_all_138_calls_with_progress_and_a_verdict():
    lock = asyncio.Lock()

    async def serial(ex):
        async with lock:
            await asyncio.sleep(0.002)
        await ex.respond(200, completion_body("x"))

    async with FakeBackend("b", serial) as backend:
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(
            burst_probe,
            backend.url,
            model="m",
            yes=True,
            api_key_env="PROBE_KEY",
            environ={"PROBE_KEY": "k-42"},
            out=out,
            err=err,
        )
        await drained(backend)
    assert code == 0
    assert len(backend.requests) == 138
    assert backend.requests[0].headers["authorization"] == "Bearer k-42"
    progress = err.getvalue().splitlines()
    assert progress[0].startswith("burst-probe: 138 calls to ")
    assert len(progress) == 1 + 12
    assert progress[-1].startswith("[138/138] concurrency 30, repeat 3/3: 30 ok")
    assert "Latency grows with concurrency" in out.getvalue()
    assert "k-42" not in out.getvalue() + err.getvalue()


def test_demo_is_the_demo_modules_main(monkeypatch):
    seen = []
    fake = types.ModuleType("tierchain.demo")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "tierchain.demo", fake)
    assert main(["demo", "--fast"]) == 0
    assert seen == [["--fast"]]


def test_no_command_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    assert "check-config" in capsys.readouterr().err
    assert main(["no-such-command"]) == 2


def test_check_config_shows_which_backends_receive_the_callers_credentials(tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n\n'
        '[[routes.echo.backends]]\nname = "gate"\nurl = "http://127.0.0.1:8000"\n'
        "forward_caller_auth = true\n"
    )
    code, text = run_check({"TIERCHAIN_ROUTES_FILE": str(path)})
    assert code == 0
    [tower] = [line for line in text.splitlines() if "1. tower" in line]
    [gate] = [line for line in text.splitlines() if "2. gate" in line]
    assert "forward_caller_auth" not in tower
    assert gate.endswith("forward_caller_auth=true")
    code, text = run_check({"TIERCHAIN_ROUTES_FILE": str(path)}, as_json=True)
    tower_json, gate_json = json.loads(text)["routes"]["echo"]
    assert "forward_caller_auth" not in tower_json
    assert gate_json["forward_caller_auth"] is True


def test_check_config_warns_when_a_backend_url_ends_in_v1_and_the_requests_carry_v1(tmp_path):
    # The LiteLLM copy trap: api_base ".../v1" + the caller's "/v1/chat/completions".
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n'
        'regime = "local"\n\n'
        '[[routes.echo.backends]]\nname = "proxy"\nurl = "http://127.0.0.1:4000/v1/"\n'
    )
    environ = {"TIERCHAIN_ROUTES_FILE": str(path)}
    code, text = run_check(environ)
    assert code == 0  # it can start: a warning, not a problem
    assert "configuration OK, with 1 warning(s) listed at the end" in text
    warning = text.rsplit("1 warning(s):\n", 1)[1]
    assert warning.startswith(
        f"  - {path}: routes.echo.backends[1].url='http://127.0.0.1:4000/v1/' (backend 'proxy'): "
        "its path ends in /v1"
    )
    assert "http://127.0.0.1:4000/v1/v1/chat/completions" in warning
    assert "expected the base URL without /v1: 'http://127.0.0.1:4000'" in warning
    code, text = run_check(environ, as_json=True)
    (only,) = json.loads(text)["warnings"]
    assert "backends[1]" in only
    # Requests under /api/ only: nothing carries /v1 twice, nothing to warn about.
    code, text = run_check({**environ, "TIERCHAIN_FAILOVER_PATHS": "/api/"}, as_json=True)
    assert json.loads(text)["warnings"] == []
    code, text = run_check({**environ, "TIERCHAIN_FAILOVER_PATHS": "/v1/"})
    assert "(TIERCHAIN_FAILOVER_PATHS=/v1/)" in text


def test_check_config_lists_every_problem_of_every_backend_at_once(tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "ftp://10.0.0.5"\n'
        'stall_after = "soon"\nmax_in_flight = 0\n\n'
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "https://api.example.com"\n'
        'stream_end = 3\napi_key_env = "HOSTED_KEY"\n'
    )
    code, text = run_check(
        {"TIERCHAIN_ROUTES_FILE": str(path), "TIERCHAIN_BREAKER_FAILURE_THRESHOLD": "0"}
    )
    assert code == 2
    assert "6 configuration problem(s)" in text
    for key in (
        "routes.echo.backends[0].url='ftp://10.0.0.5' (backend 'tower')",
        "routes.echo.backends[0].stall_after='soon' (backend 'tower')",
        "routes.echo.backends[0].max_in_flight=0 (backend 'tower')",
        "routes.echo.backends[1].stream_end=3 (backend 'hosted')",
        "routes.echo.backends[1].api_key_env='HOSTED_KEY' (backend 'hosted')",
    ):
        assert f"  - {path}: {key}" in text
    assert "TIERCHAIN_BREAKER_FAILURE_THRESHOLD='0'" in text


def test_check_config_shows_each_backends_own_options_from_the_routes_file(tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n'
        'stall_after = "5m"\nmax_in_flight = 1\nstream_end = false\n'
    )
    code, text = run_check({"TIERCHAIN_ROUTES_FILE": str(path)})
    assert code == 0
    line = next(li for li in text.splitlines() if "1. tower" in li)
    assert line.endswith("stream_end=none  stall_after=300.0  max_in_flight=1")
    code, text = run_check({"TIERCHAIN_ROUTES_FILE": str(path)}, as_json=True)
    (tower,) = json.loads(text)["routes"]["echo"]
    assert (tower["stream_end"], tower["stall_after"], tower["max_in_flight"]) == (None, 300.0, 1)


def test_check_config_shows_each_routes_wire_format_and_which_replicas_form_a_pool(tmp_path):
    path = tmp_path / "routes.toml"
    path.write_text(
        '[routes.claude]\nwire_format = "anthropic"\n\n'
        '[[routes.claude.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n\n'
        '[[routes.chat.backends]]\npool = "gpus"\nbackends = [\n'
        '  { name = "gpu-a", url = "http://10.0.0.5:8000" },\n'
        '  { name = "gpu-b", url = "http://10.0.0.6:8000", wire_format = "openai" },\n]\n\n'
        '[[routes.chat.backends]]\nname = "hosted"\nurl = "https://api.example.com"\n'
    )
    code, text = run_check({"TIERCHAIN_ROUTES_FILE": str(path)})
    assert code == 0
    lines = text.splitlines()
    at = lines.index(
        "  chat:  wire format from each request's path (openai, responses, anthropic, ollama)"
    )
    assert lines[at + 1] == (
        "    1. pool gpus: 2 replicas (gpu-a, gpu-b), one tier: each attempt picks one by its "
        "live state"
    )
    assert lines[at + 2].startswith("       - gpu-a ")
    assert lines[at + 3].endswith("http://10.0.0.6:8000  wire_format=openai")
    assert lines[at + 4].startswith("    2. hosted ")
    assert "  claude:  wire format anthropic" in lines
    code, text = run_check({"TIERCHAIN_ROUTES_FILE": str(path)}, as_json=True)
    doc = json.loads(text)
    assert doc["wire_formats"]["claude"] == "anthropic"
    assert doc["pools"] == {"chat": {"gpus": ["gpu-a", "gpu-b"]}}
