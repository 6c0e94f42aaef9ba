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
