"""docs/litellm.md, run as shown: its keys file, its routes file, its ``export`` lines, two
``tierchain serve`` replicas on one real redis-server.

Only what cannot run here is swapped: the backends' URLs (``http://127.0.0.1:11434``,
``https://api.openai.com``, ``https://api.anthropic.com``) for fake backends on loopback that
speak each wire format and its usage block as the real services send them (tests/wire_fakes.py
says where each shape comes from), the Redis URL for a throwaway redis-server's, and the ports
for free ones.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import httpx

from tierchain.config import from_env
from tierchain.stack import build_stack

from .support import Exchange, FakeBackend, serve
from .test_limits import openai_usage_stream
from .test_serve import START_TIMEOUT, tierchain_serve
from .wire_fakes import NDJSON, anthropic_stream, ollama_chat_lines, responses_stream, sends

PAGE = Path(__file__).resolve().parent.parent / "docs" / "litellm.md"
PIECES = ["Hel", "lo", "!"]
# What each fake's usage block says, per path: (input, output).
TOWER_USAGE = {
    "/v1/chat/completions": (11, 3),
    "/v1/responses": (5, 3),
    "/v1/messages": (25, 3),
    "/api/chat": (26, 282),
}


def blocks(kind: str) -> list[str]:
    """The page's fenced blocks of language ``kind`` ("" for a plain fence)."""
    found: list[str] = []
    lines: list[str] | None = None
    lang = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("```"):
            if lines is None:
                lang, lines = line[3:].strip(), []
            else:
                if lang == kind:
                    found.append("\n".join(lines) + "\n")
                lines = None
        elif lines is not None:
            lines.append(line)
    return found


def named_toml(name: str) -> str:
    """The page's TOML block whose first line is ``# <name>``."""
    (block,) = [b for b in blocks("toml") if b.splitlines()[0] == f"# {name}"]
    return block


def exported() -> dict[str, str]:
    """The variables of the page's ``export`` lines."""
    env: dict[str, str] = {}
    for block in blocks("sh"):
        for line in block.splitlines():
            if line.startswith("export "):
                for pair in shlex.split(line[len("export ") :]):
                    name, _, value = pair.partition("=")
                    env[name] = value
    return env


async def tower_script(ex: Exchange) -> None:
    """Ollama as the tower: OpenAI chat, Responses, Anthropic Messages and /api/chat, each
    streamed with its usage; any other path is Go's plain 404."""
    path = ex.request.path
    if path == "/v1/chat/completions":
        await sends(openai_usage_stream(PIECES, *TOWER_USAGE[path]))(ex)
    elif path == "/v1/responses":
        await sends(responses_stream(PIECES))(ex)
    elif path == "/v1/messages":
        await sends(anthropic_stream(PIECES))(ex)
    elif path == "/api/chat":
        await sends(ollama_chat_lines(PIECES), headers=NDJSON)(ex)
    else:
        await ex.respond(404, b"404 page not found", {"content-type": "text/plain"})


def with_urls(text: str, urls: dict[str, str]) -> str:
    for shown, real in urls.items():
        text = text.replace(shown, real)
    return text


def requests_of_each_format() -> list[tuple[str, bytes]]:
    messages = [{"role": "user", "content": "hi"}]
    return [
        (
            "/v1/chat/completions",
            json.dumps(
                {
                    "model": "llama3.2",
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": messages,
                }
            ).encode(),
        ),
        (
            "/v1/responses",
            json.dumps({"model": "llama3.2", "stream": True, "input": "hi"}).encode(),
        ),
        (
            "/v1/messages",
            json.dumps(
                {"model": "claude-haiku", "max_tokens": 64, "stream": True, "messages": messages}
            ).encode(),
        ),
        ("/api/chat", json.dumps({"model": "llama3.2", "messages": messages}).encode()),
    ]


async def test_the_litellm_setup_runs_from_the_docs_alone(tmp_path, redis_server):
    env = exported()
    async with (
        FakeBackend("tower", tower_script) as tower,
        FakeBackend("openai") as openai,
        FakeBackend("anthropic") as anthropic,
    ):
        urls = {
            "http://127.0.0.1:11434": tower.url,
            "https://api.openai.com": openai.url,
            "https://api.anthropic.com": anthropic.url,
        }
        (tmp_path / "keys.toml").write_text(named_toml("keys.toml"))
        (tmp_path / "routes.toml").write_text(with_urls(named_toml("routes.toml"), urls))
        env.update(
            TIERCHAIN_ROUTES_FILE=str(tmp_path / "routes.toml"),
            TIERCHAIN_API_KEYS_FILE=str(tmp_path / "keys.toml"),
            TIERCHAIN_STORE_URL=redis_server.url,
            TIERCHAIN_LOG_FORMAT="json",
        )
        async with (
            tierchain_serve(env) as one,
            tierchain_serve(env) as two,
            httpx.AsyncClient(timeout=10) as client,
        ):
            replicas = []
            for served in (one, two):
                await served.event("tierchain.started", START_TIMEOUT)
                (address,) = (await served.event("serve.listening"))["addresses"]
                replicas.append(f"http://{address}")

            # batch: rpm 3 for the gateway as a whole, whichever replica answers.
            batch = {"authorization": f"Bearer {env['GW_KEY_BATCH']}"}
            chat = requests_of_each_format()[0][1]
            answered = [
                await client.post(url + "/v1/chat/completions", content=chat, headers=batch)
                for url in (replicas[0], replicas[1], replicas[0])
            ]
            seen = len(tower.requests)
            over = await client.post(
                replicas[1] + "/v1/chat/completions", content=chat, headers=batch
            )
            reached = len(tower.requests) - seen

            # app: one request of each wire format, spread over both replicas.
            app = {"authorization": f"Bearer {env['GW_KEY_APP']}"}
            formats = []
            for i, (path, body) in enumerate(requests_of_each_format()):
                response = await client.post(replicas[i % 2] + path, content=body, headers=app)
                formats.append((path, response.status_code, response.content))

            admin = {"authorization": f"Bearer {env['TIERCHAIN_ADMIN_TOKEN']}"}
            reports = [
                (await client.get(url + "/admin/tierchain/usage", headers=admin)).json()
                for url in replicas
            ]
    assert [r.status_code for r in answered] == [200, 200, 200]
    assert over.status_code == 429
    assert over.json()["error"]["code"] == "rpm_exceeded"
    assert 1 <= int(over.headers["retry-after"]) <= 60
    assert reached == 0  # over the limit: no backend saw it
    assert [(path, status) for path, status, _ in formats] == [(path, 200) for path in TOWER_USAGE]
    assert openai.requests == []
    assert anthropic.requests == []

    # Both replicas read the same totals, equal to the backends' own usage blocks.
    assert reports[0]["usage"] == reports[1]["usage"]
    rows = reports[0]["usage"]

    def tokens(key: str, route: str, kind: str) -> int:
        return sum(
            r["value"]
            for r in rows
            if (r["key_name"], r["route"], r["backend"], r["kind"]) == (key, route, "tower", kind)
        )

    expected_in = {"llama3.2": 11 + 5 + 26, "claude-haiku": 25}
    expected_out = {"llama3.2": 3 + 3 + 282, "claude-haiku": 3}
    for route in ("llama3.2", "claude-haiku"):
        assert tokens("app", route, "input") == expected_in[route]
        assert tokens("app", route, "output") == expected_out[route]
    assert tokens("batch", "llama3.2", "input") == 3 * 11
    assert {r["kind"] for r in rows} <= {"input", "output", "requests", "refused"}
    keys = {k["key_name"]: k for k in reports[1]["keys"]}
    assert keys["batch"]["refused"] == 1
    assert keys["batch"]["requests"] == 3
    assert keys["app"]["requests"] == 4
    limits = {k["key_name"]: k for k in reports[0]["limits"]}
    assert limits["batch"]["rpm_used"] == 3
    assert limits["app"]["budget_tokens"] == 2_000_000
    assert limits["app"]["budget_used"] == sum(expected_in.values()) + sum(expected_out.values())
    assert env["GW_KEY_APP"] not in json.dumps(reports)


async def test_the_docs_base_url_with_v1_fails_over_to_the_hosted_tier(
    tmp_path, caplog, monkeypatch
):
    env = exported()
    for name, value in env.items():  # in process: the keys file reads its key_env variables
        if not name.startswith("TIERCHAIN_"):
            monkeypatch.setenv(name, value)
    async with (
        FakeBackend("tower", tower_script) as tower,
        FakeBackend("openai") as openai,
    ):
        routes = with_urls(
            named_toml("routes.toml, the tower's URL copied with /v1"),
            {"http://127.0.0.1:11434": tower.url, "https://api.openai.com": openai.url},
        )
        (tmp_path / "routes.toml").write_text(routes)
        (tmp_path / "keys.toml").write_text(named_toml("keys.toml"))
        env.update(
            TIERCHAIN_ROUTES_FILE=str(tmp_path / "routes.toml"),
            TIERCHAIN_API_KEYS_FILE=str(tmp_path / "keys.toml"),
        )
        del env["TIERCHAIN_STORE_URL"]  # one replica: the default memory store
        app = build_stack(None, from_env(env), identity=False)
        chat = requests_of_each_format()[0][1]
        headers = {"authorization": f"Bearer {env['GW_KEY_APP']}"}
        with caplog.at_level("WARNING", logger="tierchain"):
            async with serve(app, lifespan="on") as url, httpx.AsyncClient(timeout=10) as client:
                response = await client.post(
                    url + "/v1/chat/completions", content=chat, headers=headers
                )
    assert [r.path for r in tower.requests] == ["/v1/v1/chat/completions"]
    assert response.status_code == 200
    assert response.headers["x-tierchain-attempts"] == "tower;outcome=http_404, openai;outcome=ok"
    assert [json.loads(r.body)["model"] for r in openai.requests] == ["gpt-4o-mini"]
    assert openai.requests[0].headers["authorization"] == f"Bearer {env['OPENAI_API_KEY']}"
    assert any(getattr(r, "event", "") == "dispatch.backend_not_found" for r in caplog.records)


def test_the_page_shows_the_429_the_gateway_sends():
    (shown,) = [b for b in blocks("") if "429" in b]
    body = json.loads(shown.split("\n\n", 1)[1])
    assert body["error"]["code"] == "rpm_exceeded"
    assert "key 'batch' is over 3 requests per minute" in body["error"]["message"]


def test_the_pages_keys_file_has_two_keys_with_different_limits_and_a_budget():
    import tomllib

    keys = tomllib.loads(named_toml("keys.toml"))["keys"]
    assert len(keys) == 2
    assert keys[0]["rpm"] != keys[1]["rpm"]
    assert keys[0]["tpm"] != keys[1]["tpm"]
    assert any("budget_tokens" in k for k in keys)
