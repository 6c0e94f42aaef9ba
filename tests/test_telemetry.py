"""The hot-path collectors expose exactly what prometheus-client's own would."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tierchain.telemetry import LoopCounter, LoopHistogram

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
LABELS = st.sampled_from([("chat", "tower"), ("chat", "hosted"), ("code", "tower")])


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text exposition without the ``_created`` timestamps (they differ by run)."""
    text = generate_latest(registry).decode()
    return [re.sub(r"(_created\{.*\}) .*", r"\1", line) for line in text.splitlines()]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(LABELS, st.floats(0, 100, allow_nan=False)), max_size=40))
def test_the_loop_histogram_exposes_the_same_samples_as_prometheus_clients(observations):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopHistogram("t_seconds", "doc", ["route", "backend"], BUCKETS, registry=ours)
    reference = Histogram(
        "t_seconds", "doc", ["route", "backend"], buckets=BUCKETS, registry=theirs
    )
    for labels, value in observations:
        mine.labels(*labels).observe(value)
        reference.labels(*labels).observe(value)
    assert _exposition(ours) == _exposition(theirs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(LABELS, st.integers(1, 5)), max_size=40))
def test_the_loop_counter_exposes_the_same_samples_as_prometheus_clients(increments):
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LoopCounter("t_things", "doc", ["route", "backend"], registry=ours)
    reference = Counter("t_things", "doc", ["route", "backend"], registry=theirs)
    for labels, amount in increments:
        mine.labels(*labels).inc(amount)
        reference.labels(*labels).inc(amount)
    assert _exposition(ours) == _exposition(theirs)
    for labels, amount in increments:
        named = {"route": labels[0], "backend": labels[1]}
        total = sum(n for seen, n in increments if seen == labels)
        assert ours.get_sample_value("t_things_total", named) == float(total) >= amount


def test_a_counter_without_labels_shows_zero_before_its_first_increment():
    registry = CollectorRegistry()
    counter = LoopCounter("t_shed", "doc", registry=registry)
    assert registry.get_sample_value("t_shed_total") == 0.0
    counter.inc()
    assert registry.get_sample_value("t_shed_total") == 1.0


def test_wrong_label_counts_are_refused_like_prometheus_clients():
    registry = CollectorRegistry()
    counter = LoopCounter("t_x", "doc", ["a", "b"], registry=registry)
    histogram = LoopHistogram("t_y", "doc", ["a"], BUCKETS, registry=registry)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("only-one")
    with pytest.raises(ValueError, match="takes labels"):
        histogram.labels("a", "b")


def test_under_multiprocess_mode_every_workers_attempts_are_summed(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR set, the hot metrics are prometheus-client's own."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    worker = (
        "from tierchain.telemetry import ATTEMPTS, TIME_TO_FIRST_CHUNK\n"
        "ATTEMPTS.labels('chat', 'tower', 'ok').inc()\n"
        "TIME_TO_FIRST_CHUNK.labels('chat', 'tower').observe(0.3)\n"
    )
    for _ in range(2):  # two workers, one process each
        subprocess.run([sys.executable, "-c", worker], env=env, check=True, timeout=60)
    scrape = (
        "from prometheus_client import CollectorRegistry, multiprocess\n"
        "registry = CollectorRegistry()\n"
        "multiprocess.MultiProcessCollector(registry)\n"
        "labels = {'route': 'chat', 'backend': 'tower'}\n"
        "print(registry.get_sample_value('tierchain_attempts_total', {**labels, 'outcome': 'ok'}),"
        " registry.get_sample_value('tierchain_time_to_first_chunk_seconds_count', labels))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", scrape], env=env, check=True, timeout=60, capture_output=True
    )
    assert out.stdout.split() == [b"2.0", b"2.0"]
