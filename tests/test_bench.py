"""The benchmark scripts the docs quote still run and print what the docs read from them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_overhead_benchmark_reports_the_added_cost_per_request_and_the_chunk_ratio():
    out = run(str(BENCH / "overhead.py"), "--quick", "--skip-loopback")
    added = re.search(r"added (\d+\.\d) us", out)
    ratio = re.search(r"ratio (\d\.\d+)", out)
    assert added is not None, out
    assert ratio is not None, out
    assert float(added.group(1)) > 0  # the stack costs something: it really ran the layers
    assert 0 < float(ratio.group(1)) < 1.5


def test_the_layer_breakdown_names_every_layer_against_failover_alone():
    out = run(str(BENCH / "layers.py"), "--requests", "50", "--rounds", "1")
    for name in ("SaturationWatchdog", "Breaker", "PreferBackend", "Budget", "Heartbeats"):
        assert re.search(rf"\+ {name} .* vs Failover", out), out
    assert "whole stack" in out


def test_one_stack_alone_runs_for_an_instruction_count():
    assert run(str(BENCH / "layers.py"), "--only", "whole stack", "--requests", "20") == ""


def test_the_waiting_streams_benchmark_holds_every_stream_and_each_hears_from_the_gateway():
    out = run(
        str(BENCH / "waiting.py"),
        "40",
        "--only",
        "stack",
        "--batch",
        "40",
        "--settle",
        "0",
        "--window",
        "1",
        "--interval",
        "1",
    )
    line = re.search(r"held (\d+) failed (\d+) committed (\d+) without a line (\d+)", out)
    assert line is not None, out
    assert [int(n) for n in line.groups()] == [40, 0, 40, 0], out
    assert "breaker closed" in out, out
