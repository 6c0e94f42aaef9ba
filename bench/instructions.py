#!/usr/bin/env python3
"""Instructions the whole stack adds to the bare handler: a request's, a streamed chunk's.

The cost targets of docs/benchmarks.md are counted, not timed: instruction counts do not
move with the load of a shared machine. Six runs of ``bench/layers.py --virtual-time``
under ``valgrind --tool=callgrind`` (``PYTHONHASHSEED=0``), the whole stack and the bare
handler each at ``--requests 200 --chunks 1``, ``--requests 1200 --chunks 1`` and
``--requests 1000 --chunks 51``, then:

- a request added: ((whole at 1,200 - at 200) - (bare at 1,200 - at 200)) / 1,000;
- a chunk added: ((whole at 1,000 x 51 - at 1,000 x 1) - (bare, the same)) / 50,000, the
  1,000 x 1 count read on the line through the 200 and 1,200 runs.

Run: ``python3 dev.py instructions`` (or ``.venv/bin/python bench/instructions.py``; a few
minutes: callgrind runs Python fifty times slower). ``--counts FILE`` reads the six
counts from a file of ``stack | requests | chunks | count`` lines (what a run prints)
instead of running valgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = [(200, 1), (1200, 1), (1000, 51)]
STACKS = ["whole stack", "bare handler"]
Counts = dict[tuple[str, int, int], int]


def count(stack: str, requests: int, chunks: int) -> int:
    """Instructions callgrind collects over one run of ``bench/layers.py``."""
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         str(ROOT / "bench" / "layers.py"), "--only", stack, "--requests", str(requests),
         "--chunks", str(chunks), "--virtual-time"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"no count in callgrind's output:\n{done.stderr}")
    return int(found.group(1))


def added(counts: Counts) -> tuple[float, float]:
    """(instructions a request, instructions a streamed chunk) the whole stack adds."""

    def per_request(stack: str) -> float:
        return (counts[stack, 1200, 1] - counts[stack, 200, 1]) / 1000

    def per_chunk(stack: str) -> float:
        at_1000 = counts[stack, 200, 1] + 800 * per_request(stack)  # on the line through both
        return (counts[stack, 1000, 51] - at_1000) / 50_000

    return (
        per_request("whole stack") - per_request("bare handler"),
        per_chunk("whole stack") - per_chunk("bare handler"),
    )


def read(path: str) -> Counts:
    counts: Counts = {}
    for line in Path(path).read_text().splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 4 and fields[0] in STACKS:
            counts[fields[0], int(fields[1]), int(fields[2])] = int(fields[3])
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", help="read the six counts from this file")
    args = parser.parse_args()
    if args.counts:
        counts = read(args.counts)
    else:
        counts = {}
        for requests, chunks in RUNS:
            for stack in STACKS:
                n = counts[stack, requests, chunks] = count(stack, requests, chunks)
                print(f"{stack} | {requests} | {chunks} | {n}", flush=True)
    request, chunk = added(counts)
    print(f"instructions a request added to the bare handler: {request / 1000:.1f} k")
    print(f"instructions a streamed chunk added to the bare handler: {chunk / 1000:.2f} k")


if __name__ == "__main__":
    main()
