"""A short soak through the README stack under uvicorn: nothing lost that should not be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .support import load_script

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def load_soak() -> Any:
    return load_script(SOAK, "tierchain_bench_soak")


@pytest.mark.soak
@pytest.mark.timeout(120)
async def test_fifty_callers_through_a_randomly_failing_tower_lose_only_by_design():
    result = await load_soak().soak(callers=50, seconds=20, seed=7)
    detail = result["samples"]
    # Enough traffic for the checks below to mean something: four requests a caller. How
    # many more is the machine's speed (about 1,000 quiet; 441 under stress-ng --cpu 8 with
    # other tests beside it), not the gateway's behaviour.
    assert result["requests"] > 4 * 50
    assert result["completed"] + result["continued"] > result["requests"] * 0.8
    assert result["continued"] > 0  # streams the tower broke, finished by hosted
    assert result["lost_should_not_have_been"] == 0, detail
    assert result["corrupted"] == 0, detail
    # Everything the load made has gone: tasks, and connections (idle ones after keep-alive).
    assert result["end"]["tasks"] == result["start"]["tasks"], (result["start"], result["end"])
    assert result["end"]["fds"] == result["start"]["fds"]
    assert "hosted" not in result["breaker_opened"]
