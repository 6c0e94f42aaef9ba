"""The docs site builds with --strict, and its reference pages list what the code emits."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from tierchain import breaker, config, identity, telemetry

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = sorted((ROOT / "src" / "tierchain").rglob("*.py"))


def source_names(pattern: str) -> set[str]:
    found: set[str] = set()
    for path in SOURCES:
        found.update(re.findall(pattern, path.read_text()))
    return found


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed")
def test_the_docs_site_builds_with_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet"]
    command += ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    outage = (tmp_path / "site" / "outage" / "index.html").read_text()
    assert 'class="mermaid"' in outage
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="tierchain.Failover"' in api  # rendered from the docstrings, not left as :::
    assert "::: tierchain" not in api
    assert ":class:" not in api  # the docstrings' roles became Markdown (docs/_ext)


# log_event calls whose event name is not a string literal, and the names they can take.
INDIRECT_EVENTS = {
    "EVENT": {identity.EVENT},
    "_TRANSITION_EVENT[to]": set(breaker._TRANSITION_EVENT.values()),
}


def test_every_log_event_is_in_the_reference():
    reference = (DOCS / "reference.md").read_text()
    indirect = source_names(r"(?<!def )log_event\(\s*([A-Za-z_][\w.]*(?:\[[^\]]*\])?)")
    unknown = indirect - set(INDIRECT_EVENTS)
    assert not unknown, f"log_event names this test cannot resolve (add them above): {unknown}"
    events = source_names(r'log_event\(\s*"([^"]+)"').union(*INDIRECT_EVENTS.values())
    assert events
    missing = sorted(e for e in events if f"`{e}`" not in reference)
    assert not missing, f"docs/reference.md does not list the log events {missing}"


def test_every_metric_span_and_span_attribute_is_in_the_reference():
    reference = (DOCS / "reference.md").read_text()
    metrics = {
        m.describe()[0].name + ("_total" if m._type == "counter" else "")
        for m in vars(telemetry).values()
        if isinstance(m, MetricWrapperBase)
    }
    spans = source_names(r'(?:start_span|start_as_current_span)\(\s*"([^"]+)"')
    attributes = source_names(r'ATTR_\w+ = "([^"]+)"') | source_names(
        r'set_attribute\(\s*"([^"]+)"'
    )
    span_events = source_names(r'add_event\(\s*"([^"]+)"')
    assert metrics
    assert spans
    assert attributes
    missing = sorted(
        name for name in metrics | spans | attributes | span_events if f"`{name}`" not in reference
    )
    assert not missing, f"docs/reference.md does not list {missing}"


def test_every_variable_is_in_the_configuration_page():
    page = (DOCS / "configuration.md").read_text()
    variables = [opt.env for layer in config.LAYERS for opt in layer.options]
    missing = [v for v in variables if f"`{v}`" not in page]
    assert not missing, f"docs/configuration.md does not list {missing}"


async def test_a_failure_after_commit_keeps_its_outcome_as_the_reference_says():
    import httpx
    from prometheus_client import REGISTRY

    from tierchain import Backend, Failover, Forwarder, Routes

    from .support import Exchange, FakeBackend, chat_request, openai_stream, serve

    async def dies_midway(ex: Exchange) -> None:
        await ex.head()
        await ex.write(openai_stream(["one"])[0])
        await ex.reset()

    route = "reference-after-commit"
    async with FakeBackend("tower", dies_midway) as tower:
        forwarder = Forwarder()
        app = Failover(forwarder, routes=Routes({route: [Backend("tower", tower.url)]}))
        async with serve(app) as url, httpx.AsyncClient(timeout=5) as client:
            body = chat_request(model=route)
            response = await client.post(url + "/v1/chat/completions", content=body)
        await forwarder.aclose()
    assert response.status_code == 200  # committed: the failure came after the first byte
    outcomes = {
        s.labels["outcome"]
        for metric in REGISTRY.collect()
        if metric.name == "tierchain_attempts"
        for s in metric.samples
        if s.labels.get("route") == route and s.value
    }
    assert outcomes == {"stream_broken"}  # no "_after_commit" suffix is ever added
    reference = (DOCS / "reference.md").read_text()
    assert "_after_commit" not in reference
    assert "`stream_broken`" in reference


def toml_blocks(path: Path) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", path.read_text(), re.S)


PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def routes_files() -> list[tuple[Path, int, str]]:
    """Every ```toml block of the README and docs/ that holds routes: (page, n, block)."""
    return [
        (path, n, block)
        for path in PAGES
        for n, block in enumerate(toml_blocks(path))
        if re.search(r"^\[\[?routes\.", block, re.M)
    ]


@pytest.mark.parametrize(
    ("path", "n", "block"), routes_files(), ids=[f"{p.name}-{n}" for p, n, _ in routes_files()]
)
def test_every_routes_file_in_the_docs_loads(path, n, block):
    import tomllib

    data = tomllib.loads(block)
    assert "routes" in data, f"{path.name}: toml block {n} names routes but holds none"
    variables = set(re.findall(r'api_key_env = "(\w+)"', block))
    config.routes_from_toml(data, environ={v: "sk-docs-example" for v in variables})


def test_the_routes_files_found_are_every_toml_block_that_has_routes():
    """The parametrisation above misses none: every toml block that parses to a ``routes``
    table is one of them, and there are as many as the pages show."""
    import tomllib

    holding = [
        (path.name, n)
        for path in PAGES
        for n, block in enumerate(toml_blocks(path))
        if "routes" in tomllib.loads(block)
    ]
    assert holding == [(path.name, n) for path, n, _ in routes_files()]
    assert len(holding) >= 10, holding


def test_every_key_of_the_routes_file_is_in_the_configuration_page():
    page = (DOCS / "configuration.md").read_text()
    missing = [k.name for k in config.BACKEND_KEYS if f"| `{k.name}` |" not in page]
    assert not missing, f"docs/configuration.md's table of backend keys lacks {missing}"


def documented_lines(after: str) -> list[str]:
    """The ``  - `` lines of the first plain block in configuration.md that follows ``after``."""
    page = (DOCS / "configuration.md").read_text()
    block = re.search(r"```\n(.*?)```", page[page.index(after) :], re.S)
    assert block is not None
    return [line for line in block[1].splitlines() if line.startswith("  - ")]


def test_the_documented_routes_problems_and_warning_are_what_check_config_prints(
    tmp_path, monkeypatch
):
    import io

    from tierchain.__main__ import check_config

    monkeypatch.chdir(tmp_path)
    Path("routes.toml").write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n'
        'stall_after = "soon"\nmax_in_flight = 0\n\n'
        '[[routes.echo.backends]]\nname = "hosted"\nurl = "https://api.example.com"\n'
        'api_key_env = "HOSTED_API_KEY"\n'
    )
    out = io.StringIO()
    assert check_config(environ={"TIERCHAIN_ROUTES_FILE": "routes.toml"}, out=out) == 2
    printed = out.getvalue().splitlines()
    assert documented_lines("### Problems and warnings") == printed[1:]
    Path("routes.toml").write_text(
        '[[routes.echo.backends]]\nname = "tower"\nurl = "http://127.0.0.1:11434"\n'
        'regime = "local"\n\n'
        '[[routes.echo.backends]]\nname = "proxy"\nurl = "http://127.0.0.1:4000/v1"\n'
    )
    out = io.StringIO()
    assert check_config(environ={"TIERCHAIN_ROUTES_FILE": "routes.toml"}, out=out) == 0
    (warning,) = documented_lines("`tierchain check-config` warns about it")
    assert out.getvalue().splitlines()[-1] == warning
