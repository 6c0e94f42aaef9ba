"""Secrets never printed: a planted credential shows in no output, log, body, header or repr."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
from pathlib import Path

import httpx
import pytest

from tierchain import Backend, MemoryStore, identity
from tierchain.__main__ import check_config
from tierchain.config import build_stack, from_env
from tierchain.identity import Once, identity_fields
from tierchain.masking import mask_text, mask_url, url_secrets

from .support import FakeBackend, answers, chat_request, refused_url, serve, streams

# One distinct secret per place a secret can be put.
REDIS_USERINFO = "redisuserinfo-S3cret"
REDIS_QUERY = "redisquery-S3cret"
REDIS_MALFORMED = "redismalformed-S3cret"
BACKEND_USERINFO = "backenduserinfo-S3cret"
BACKEND_QUERY = "backendquery-S3cret"
BACKEND_KEY = "sk-backendkey-S3cret"
ADMIN_TOKEN = "admintoken-S3cret-0123456789"
SECRETS = (
    REDIS_USERINFO,
    REDIS_QUERY,
    REDIS_MALFORMED,
    BACKEND_USERINFO,
    BACKEND_QUERY,
    BACKEND_KEY,
    ADMIN_TOKEN,
)


def assert_clean(where: str, text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked into {where}: {text!r}"
    assert "S3cret" not in text, f"part of a secret leaked into {where}: {text!r}"


def routes_toml(tmp_path: Path, tower_url: str, hosted_url: str) -> str:
    path = tmp_path / "routes.toml"
    path.write_text(
        "[[routes.echo.backends]]\n"
        'name = "tower"\n'
        f'url = "{tower_url}"\n'
        'regime = "local"\n\n'
        "[[routes.echo.backends]]\n"
        'name = "hosted"\n'
        f'url = "{hosted_url}"\n'
        'regime = "hosted"\n'
        'api_key_env = "HOSTED_KEY"\n'
    )
    return str(path)


def with_userinfo_and_key(url: str) -> str:
    scheme, _, host = url.partition("://")
    return f"{scheme}://user:{BACKEND_USERINFO}@{host}/?key={BACKEND_QUERY}"


def redis_url(port: int) -> str:
    return f"redis://default:{REDIS_USERINFO}@127.0.0.1:{port}/0?password={REDIS_QUERY}"


def environ(routes_file: str, store_url: str) -> dict[str, str]:
    return {
        "TIERCHAIN_ROUTES_FILE": routes_file,
        "HOSTED_KEY": BACKEND_KEY,
        "TIERCHAIN_ADMIN_TOKEN": ADMIN_TOKEN,
        "TIERCHAIN_STORE_URL": store_url,
        "TIERCHAIN_REDIS_TIMEOUT": "0.2",
    }


def run_check(env: dict[str, str], *, as_json: bool) -> tuple[int, str]:
    out = io.StringIO()
    code = check_config(as_json=as_json, environ=env, out=out)
    return code, out.getvalue()


def closed_port() -> int:
    return int(refused_url().rsplit(":", 1)[1])


# -- the masker ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw-1234@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        (
            "redis://127.0.0.1:6379/0?password=pw-1234&db=1",
            "redis://127.0.0.1:6379/0?password=***&db=1",
        ),
        (
            "https://api.example/v1?api_key=k1&x=1;token=t1",
            "https://api.example/v1?api_key=***&x=1;token=***",
        ),
        (
            "https://api.example/v1?Secret=a&AUTH=b&key=c",
            "https://api.example/v1?Secret=***&AUTH=***&key=***",
        ),
        ("http://tok-1234@host/x", "http://***@host/x"),
        ("http://127.0.0.1:8000/tenant-a", "http://127.0.0.1:8000/tenant-a"),
        ("http://[::1]:8000/v1?model=m", "http://[::1]:8000/v1?model=m"),
        # Malformed: a "/" in the password, a port that is not a number, a broken IPv6 host.
        ("redis://:pw/1234@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        ("redis://u:pw-1234@host:99999/0", "redis://***@host:99999/0"),
        ("redis://u:pw-1234@[::1:6379/0?password=pw-5678", "redis://***@[::1:6379/0?password=***"),
        ("redis://u:12#pw-1234@host/0", "redis://***@host/0"),
    ],
)
def test_mask_url_hides_userinfo_and_secret_query_values_and_keeps_the_rest(url, shown):
    assert mask_url(url) == shown


def test_mask_text_hides_a_urls_secrets_wherever_a_message_quotes_them():
    url = "redis://user:pw-1234/5678@127.0.0.1:6379/0"
    message = f"Port could not be cast to integer value as 'pw-1234' in {url}"
    masked = mask_text(message, url)
    assert "pw-1234" not in masked
    assert "5678" not in masked
    assert "redis://***@127.0.0.1:6379/0" in masked
    assert "pw-1234" in url_secrets(url)


# -- the sweep -------------------------------------------------------------------


def test_check_config_text_and_json_show_no_planted_secret(tmp_path):
    routes = routes_toml(
        tmp_path,
        with_userinfo_and_key("http://127.0.0.1:11434"),
        with_userinfo_and_key("https://api.example.com"),
    )
    good = environ(routes, redis_url(6379))
    for as_json in (False, True):
        code, text = run_check(good, as_json=as_json)
        assert code == 0, text
        assert "redis://***@127.0.0.1:6379/0?password=***" in text
        assert_clean(f"check-config (json={as_json})", text)
    malformed = [
        f"redis://user:{REDIS_MALFORMED}@[::1:6379/0",
        f"redis://:{REDIS_MALFORMED}/x@127.0.0.1:6379/0",
        f"redis://user:{REDIS_MALFORMED}@127.0.0.1:port/0",
        f"rediz://:{REDIS_MALFORMED}@127.0.0.1/0",
    ]
    for store_url in malformed:
        for as_json in (False, True):
            code, text = run_check(environ(routes, store_url), as_json=as_json)
            assert code == 2, text
            assert "TIERCHAIN_STORE_URL" in text
            assert_clean(f"check-config of {store_url!r} (json={as_json})", text)


def test_reprs_show_no_planted_secret(tmp_path):
    routes = routes_toml(
        tmp_path,
        with_userinfo_and_key("http://127.0.0.1:11434"),
        with_userinfo_and_key("https://api.example.com"),
    )
    settings = from_env(environ(routes, redis_url(6379)))
    assert settings.routes is not None
    hosted = settings.routes["echo"][1]
    assert hosted.headers["Authorization"] == f"Bearer {BACKEND_KEY}"
    store = settings.make_store()
    shown = {
        "Settings": repr(settings),
        "LayerSettings": repr(settings.layers["Admin"]),
        "Backend": repr(hosted),
        "Routes": repr(settings.routes),
        "RedisStore": repr(store),
        "MemoryStore": repr(MemoryStore()),
    }
    for what, text in shown.items():
        assert_clean(f"repr({what})", text)
    assert "https://***@api.example.com/?key=***" in shown["Backend"]
    assert "headers=<Authorization: values not shown>" in shown["Backend"]
    assert "redis://***@127.0.0.1:6379/0?password=***" in shown["RedisStore"]


def test_a_backend_urls_malformed_error_shows_no_secret():
    for url in (
        f"http://user:{BACKEND_USERINFO}@[::1/?key={BACKEND_QUERY}",
        f"ftp://user:{BACKEND_USERINFO}@host/?key={BACKEND_QUERY}",
    ):
        with pytest.raises(ValueError) as caught:
            Backend(name="b", url=url)
        assert_clean("Backend's ValueError", str(caught.value))


async def test_no_planted_secret_in_any_log_event_body_or_header_of_a_run(
    tmp_path, caplog, monkeypatch
):
    """Identity line, every tierchain log event, error bodies and trail headers of real requests.

    The tower's URL carries userinfo and ``?key=`` and refuses connections; the
    hosted tier carries them too plus an API key; Redis is unreachable with a
    password in its userinfo and in ``?password=``, so the store logs its
    outage and the Admin API answers 503.
    """
    caplog.set_level(logging.DEBUG, logger="tierchain")
    monkeypatch.setattr(identity, "PROCESS_ONCE", Once())
    async with FakeBackend("hosted", streams(["Hel", "lo"])) as hosted:
        routes = routes_toml(
            tmp_path, with_userinfo_and_key(refused_url()), with_userinfo_and_key(hosted.url)
        )
        settings = from_env(environ(routes, redis_url(closed_port())))
        assert_clean("identity fields", json.dumps(identity_fields(settings=settings)))

        store = settings.make_store()
        app = build_stack(None, settings, store=store)
        texts: list[tuple[str, str]] = []
        async with serve(app, lifespan="on") as base, httpx.AsyncClient(base_url=base) as client:
            admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
            replies = [
                await client.post("/v1/chat/completions", content=chat_request(stream=True)),
                await client.post("/v1/chat/completions", content=chat_request(stream=False)),
                await client.put(
                    "/admin/tierchain/pins/echo",
                    json={"backend": "tower", "ttl": 60},
                    headers=admin,
                ),
                await client.get("/admin/tierchain/pins", headers=admin),
            ]
            hosted.script = answers(503)
            replies.append(
                await client.post("/v1/chat/completions", content=chat_request(stream=False))
            )
        await store.aclose()
        statuses = [r.status_code for r in replies]
        assert statuses[:3] == [200, 200, 503], statuses
        for reply in replies:
            texts.append((f"{reply.request.url.path} body", reply.text))
            texts.append(
                (f"{reply.request.url.path} headers", json.dumps(list(reply.headers.items())))
            )
        assert any("x-tierchain-attempts" in h for _, h in texts)
        assert "redis://***@127.0.0.1" in replies[2].text
        # The hosted tier got credentials: the secrets were really in play.
        assert "authorization" in hosted.requests[0].headers

    events = {r.getMessage().split(" ", 1)[0] for r in caplog.records}
    assert {"tierchain.started", "store.redis_unavailable", "admin.store_unavailable"} <= events
    # tierchain's own events; httpx's request log is the host's logging to configure
    # (``tierchain serve`` quiets it), and an earlier test may have turned it on.
    for record in caplog.records:
        if record.name.split(".")[0] != "tierchain":
            continue
        fields = getattr(record, "tierchain", {})
        texts.append(
            (
                f"log {record.getMessage()[:40]}",
                record.getMessage() + json.dumps(fields, default=str),
            )
        )
    for where, text in texts:
        assert_clean(where, text)


def test_burst_probe_shows_no_secret_of_the_url_it_was_given():
    from tierchain.__main__ import burst_probe

    for url in (
        f"http://user:{BACKEND_USERINFO}@127.0.0.1:9/v1?key={BACKEND_QUERY}",
        f"ftp://user:{BACKEND_USERINFO}@127.0.0.1:9/v1?key={BACKEND_QUERY}",
    ):
        err = io.StringIO()
        assert burst_probe(url, model="m", yes=False, err=err) == 2
        assert "127.0.0.1:9" in err.getvalue()
        assert_clean(f"burst-probe's refusal for {url!r}", err.getvalue())


@pytest.mark.parametrize("log_format", ["json", "text"])
async def test_tierchain_serve_writes_no_planted_secret_on_any_line(tmp_path, log_format):
    """Every line ``tierchain serve`` writes (debug level, httpx's loggers included) is clean."""
    from .test_serve import START_TIMEOUT, tierchain_serve

    async with FakeBackend("hosted", streams(["Hel", "lo"])) as hosted:
        routes = routes_toml(
            tmp_path, with_userinfo_and_key(refused_url()), with_userinfo_and_key(hosted.url)
        )
        env = {
            **environ(routes, redis_url(closed_port())),
            "TIERCHAIN_LOG_FORMAT": log_format,
            "TIERCHAIN_LOG_LEVEL": "debug",
        }
        async with tierchain_serve(env) as served, httpx.AsyncClient(timeout=5) as client:
            listening = await served.until(
                lambda: next((x for x in served.lines if "serve.listening" in x), None),
                START_TIMEOUT,
            )
            address = re.search(r"127\.0\.0\.1:\d+", listening)
            assert address is not None
            base = f"http://{address[0]}"
            admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
            replies = [
                await client.post(f"{base}/v1/chat/completions", content=chat_request()),
                await client.put(
                    f"{base}/admin/tierchain/pins/echo",
                    json={"backend": "tower", "ttl": 60},
                    headers=admin,
                ),
            ]
            served.proc.send_signal(signal.SIGTERM)
            status = await served.exit_status(10.0)
    assert status == 0, "\n".join(served.lines)
    assert [r.status_code for r in replies] == [200, 503]
    text = "\n".join(served.lines)
    assert "tierchain.started" in text
    assert "store.redis_unavailable" in text
    assert "***@127.0.0.1" in text  # the URLs are there, masked
    assert_clean(f"tierchain serve's {log_format} log", text)
    for reply in replies:
        assert_clean("a reply under serve", reply.text + json.dumps(list(reply.headers.items())))
