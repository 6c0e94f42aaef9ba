"""The Grafana dashboard queries only metrics (and labels) that tierchain exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

import tierchain.telemetry  # noqa: F401  (registers every collector)

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"

# PromQL functions, aggregations and keywords: every other identifier must be a metric.
PROMQL_WORDS = frozenset(
    re.findall(
        r"\S+",
        """
    sum min max avg count stddev stdvar topk bottomk quantile count_values group
    rate irate increase delta idelta deriv predict_linear resets changes
    histogram_quantile abs ceil floor round clamp clamp_min clamp_max sqrt exp ln log2 log10
    sort sort_desc time timestamp vector scalar label_replace label_join absent absent_over_time
    avg_over_time min_over_time max_over_time sum_over_time count_over_time last_over_time
    quantile_over_time stddev_over_time present_over_time
    by without on ignoring group_left group_right bool and or unless offset
    label_values
    """,
    )
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER_SUFFIX = re.compile(r"\b\d+(\.\d+)?\b")


def exported() -> dict[str, set[str]]:
    """Every sample name tierchain registers, with the label names it carries."""
    names: dict[str, set[str]] = {}
    for name, collector in REGISTRY._names_to_collectors.items():
        if name.startswith("tierchain_"):
            labels = set(getattr(collector, "_labelnames", ()))
            if name.endswith("_bucket"):
                labels.add("le")
            names[name] = labels
    return names


def queries(node: Any) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and templating query in the dashboard."""
    found: list[tuple[str, str]] = []
    for panel in node.get("panels", []):
        found += queries(panel)
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in node.get("templating", {}).get("list", []):
        if variable["type"] == "query":
            found.append((f"variable {variable['name']}", variable["query"]["query"]))
    return found


def parse(expr: str) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """Metric names, the label names matched per metric, and the grouping labels."""
    text = _STRING.sub('""', expr)
    text = text.replace("$__rate_interval", "5m").replace("$__range", "1h")
    text = _RANGE.sub("", text)
    per_metric: dict[str, set[str]] = {}
    for match in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", text):
        per_metric.setdefault(match[1], set()).update(
            re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", match[2])
        )
    grouping = {
        label.strip() for _, inside in _GROUPING.findall(text) for label in inside.split(",")
    } - {""}
    bare = _GROUPING.sub(" ", _MATCHERS.sub(" ", text))
    bare = _NUMBER_SUFFIX.sub(" ", bare)
    # label_values(metric, label): the second argument is a label, not a metric.
    bare = re.sub(r"label_values\(([^,]*),\s*([A-Za-z_]+)\)", r"label_values(\1)", bare)
    grouping |= set(re.findall(r"label_values\([^,]*,\s*([A-Za-z_]+)\)", _MATCHERS.sub("", text)))
    metrics = {w for w in _IDENT.findall(bare) if w not in PROMQL_WORDS}
    return metrics, per_metric, grouping


def test_the_dashboard_is_a_grafana_dashboard_on_a_prometheus_datasource_variable():
    doc = json.loads(DASHBOARD.read_text())
    assert 36 <= doc["schemaVersion"] <= 41
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    for panel in doc["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def test_the_dashboard_covers_what_an_operator_asks_first():
    text = " ".join(expr for _, expr in queries(json.loads(DASHBOARD.read_text())))
    for metric in (
        "tierchain_attempts_total",
        "tierchain_backend_saturated_total",
        "tierchain_breaker_state",
        "tierchain_stream_heartbeats_total",
        "tierchain_time_to_first_chunk_seconds_bucket",
        "tierchain_budget_exhausted_total",
        "tierchain_backend_skipped_total",
        "tierchain_probe_answers_total",
    ):
        assert metric in text


@pytest.mark.parametrize(
    ("where", "expr"),
    [pytest.param(w, e, id=w) for w, e in queries(json.loads(DASHBOARD.read_text()))],
)
def test_every_metric_and_label_a_query_uses_is_exported(where, expr):
    names = exported()
    metrics, matched, grouping = parse(expr)
    assert metrics, f"{where}: no metric found in {expr!r}"
    unknown = sorted(m for m in metrics if m not in names)
    assert not unknown, f"{where} queries {unknown}, which tierchain does not export"
    for metric, labels in matched.items():
        missing = labels - names[metric]
        assert not missing, f"{where} matches {metric} on unknown labels {sorted(missing)}"
    carried = set().union(*(names[m] for m in metrics))
    assert grouping <= carried, f"{where} groups by {sorted(grouping - carried)}, never exported"


def test_the_check_catches_a_metric_that_is_not_exported():
    metrics, _, _ = parse('sum by (route) (rate(tierchain_attempts_totl{route=~"$route"}[5m]))')
    assert metrics == {"tierchain_attempts_totl"}
    assert "tierchain_attempts_totl" not in exported()
    metrics, _, grouping = parse("label_values(tierchain_attempts_total, backend)")
    assert metrics == {"tierchain_attempts_total"}
    assert grouping == {"backend"}
    assert parse("sum(up) / sum(process_cpu_seconds_total)")[0] == {
        "up",
        "process_cpu_seconds_total",
    }


def test_every_variable_the_dashboard_uses_is_defined_and_the_docs_say_how_it_is_chosen():
    text = DASHBOARD.read_text()
    board = json.loads(text)
    variables = {v["name"] for v in board["templating"]["list"]}
    inputs = {i["name"] for i in board.get("__inputs", [])}
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text))
    assert used
    assert used <= variables | inputs, used - variables - inputs
    reference = (DASHBOARD.parent / "reference.md").read_text()
    note = reference[reference.index("grafana-dashboard.json") :][:600]
    if not inputs:
        # No __inputs: Grafana's import asks nothing; the note must not promise a prompt.
        assert "nothing is asked on import" in note
        assert "DS_PROMETHEUS" in variables
