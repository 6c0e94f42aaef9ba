"""The benchmark scripts the docs quote still run and print what the docs read from them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .support import load_script

BENCH = Path(__file__).resolve().parent.parent / "bench"


def run(*args: str, timeout: float = 60.0) -> str:
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_overhead_benchmark_reports_the_added_cost_per_request_and_the_chunk_ratio():
    # What it prints, not what it measured: a figure of a loaded machine is no test's to bound.
    out = run(str(BENCH / "overhead.py"), "--quick", "--skip-loopback")
    assert "layers: Failover, Heartbeats, Budget, PreferBackend, Breaker" in out, out
    assert re.search(r"per request: bare -?\d+\.\d us, stack -?\d+\.\d us, added -?\d+\.\d us", out)
    ratio = re.search(r"streamed chunks/s: bare [\d,]+, stack [\d,]+, ratio (\d+\.\d+)", out)
    assert ratio is not None, out
    assert float(ratio.group(1)) > 0  # chunks went through the stack


def test_the_layer_breakdown_names_every_layer_against_failover_alone():
    out = run(str(BENCH / "layers.py"), "--requests", "50", "--rounds", "1")
    for name in ("SaturationWatchdog", "Breaker", "PreferBackend", "Budget", "Heartbeats"):
        assert re.search(rf"\+ {name} .* vs Failover", out), out
    assert "whole stack" in out


def test_one_stack_alone_runs_for_an_instruction_count():
    assert run(str(BENCH / "layers.py"), "--only", "whole stack", "--requests", "20") == ""


def wakes(*flags: str) -> int:
    """The scheduler's wake-ups in a child's run of 3,000 requests through the whole stack."""
    code = (
        "import runpy, sys\n"
        "from tierchain._runtime import deadlines\n"
        "fired = []\n"
        "wake = deadlines._Timers._fire\n"
        "deadlines._Timers._fire = lambda self: (fired.append(1), wake(self))\n"
        f"sys.argv = [{str(BENCH / 'layers.py')!r}, '--only', 'whole stack', '--requests', "
        f"'3000', *{list(flags)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "print(len(fired))\n"
    )
    return int(run("-c", code))


def test_the_instruction_count_run_is_on_virtual_time_and_no_timer_falls_due_in_it():
    # What --virtual-time is for: the scheduler never wakes, so callgrind counts the
    # requests' own work; on real time the same run wakes it (the disconnect guards'
    # 20 ms watch falls due several times in the run).
    assert wakes() > 0
    assert wakes("--virtual-time") == 0


def waiting(kind: str, k: int) -> tuple[list[int], str]:
    """bench/waiting.py for ``k`` streams of one gateway, quickly: (held, failed, committed,
    without a line), and the whole output. Real seconds (a window of 1 s, keepalives every
    1 s), as it cannot be otherwise: the benchmark's gateway is another process. No wait for
    the fds to come back after the callers leave: nothing here asserts them."""
    out = run(str(BENCH / "waiting.py"), str(k), "--only", kind, "--batch", str(k),
              "--settle", "0", "--window", "1", "--interval", "1", "--fds-wait", "0")  # fmt: skip
    line = re.search(r"held (\d+) failed (\d+) committed (\d+) without a line (\d+)", out)
    assert line is not None, out
    return [int(n) for n in line.groups()], out


def test_the_waiting_streams_benchmark_holds_every_stream_and_each_hears_from_the_gateway():
    counts, out = waiting("stack", 40)
    assert counts == [40, 0, 40, 0], out
    assert "breaker closed)" in out, out


def test_the_waiting_streams_benchmark_runs_tierchain_serve_itself_for_serve():
    # Its own server and its own /metrics (the breaker's state is read there).
    counts, out = waiting("serve", 20)
    assert counts == [20, 0, 20, 0], out
    assert "breaker closed)" in out, out


def test_the_waiting_streams_benchmark_measures_a_bare_proxy_that_only_sends_keepalives():
    # The floor the parked-streams figure is read against: no tierchain, one comment a
    # stream every interval, every stream held.
    counts, out = waiting("bare-keepalive", 20)
    assert counts == [20, 0, 20, 0], out


# Beside other tests: the script binds its servers' sockets before it starts them (a
# redis-server it starts tries another port when another process took its own meanwhile).
# Its processes do real work: 15 to 19 s on the quiet machine, over 60 s under stress-ng.
@pytest.mark.timeout(300)
def test_the_pools_benchmark_compares_the_picker_with_round_robin_and_random():
    out = run(str(BENCH / "pools.py"), "--quick", timeout=240.0)
    rows = re.findall(
        r"replicas (\d)  (\S+)\s+p50 ([0-9.]+) s  p99 ([0-9.]+) s  cache hits (\d+)%", out
    )
    assert {(n, mode) for n, mode, *_ in rows} == {
        (n, mode) for n in "24" for mode in ("tierchain", "round-robin", "random")
    }, out
    hits = {(n, mode): int(h) for n, mode, _, _, h in rows}
    for n in "24":
        # A conversation stays on the replica that holds its history; at random it cannot.
        assert hits[n, "tierchain"] > hits[n, "random"], out


def test_the_benchmarks_page_describes_the_fake_replicas_as_they_are():
    pools = load_script(BENCH / "pools.py", "bench_pools")
    page = (BENCH.parent / "docs" / "benchmarks.md").read_text()
    assert pools.PER_BYTE == 20e-6
    assert "20 µs a byte" in page
    assert pools.CACHED_SHARE == 0.1
    assert "a tenth of an uncached one" in page
    assert pools.SLOTS == 4
    assert "4 requests at once" in page
    assert pools.CONTENTION == 0.25
    assert "by a quarter" in page
    assert 4000 <= len(pools.SYSTEM) <= 4300
    assert 900 <= len(pools.TURN) <= 1100


def test_the_instruction_figures_are_the_differences_the_docs_define(tmp_path: Path):
    # The stack: 12,300 instructions over the bare handler's a request, 4,560 more a chunk
    # (the 1,000 x 1 count is read on the line through the 200 and 1,200 ones).
    lines = []
    for stack, request, chunk in (("whole stack", 12_300, 4_560), ("bare handler", 0, 0)):
        for requests, chunks in ((200, 1), (1200, 1), (1000, 51)):
            n = 5_000 + requests * (900 + request + (chunks - 1) * (40 + chunk))
            lines.append(f"{stack} | {requests} | {chunks} | {n}")
    counts = tmp_path / "counts.txt"
    counts.write_text("\n".join(lines))
    out = run(str(BENCH / "instructions.py"), "--counts", str(counts))
    assert "instructions a request added to the bare handler: 12.3 k" in out, out
    assert "instructions a streamed chunk added to the bare handler: 4.56 k" in out, out
