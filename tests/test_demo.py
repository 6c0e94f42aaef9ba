"""The README's first command: the demo tells the story and exits by itself."""

from __future__ import annotations

from tierchain.demo import run_demo, trail_of


async def test_the_demo_tells_the_outage_story_with_the_tiers_each_request_tried():
    printed: list[str] = []
    outcomes = await run_demo(fast=True, color=False, out=printed.append)
    text = "\n".join(printed)
    trails = [trail_of(o) for o in outcomes]
    assert trails[0] == [("tower", "ok")]
    assert trails[1] == [("tower", "connect_refused"), ("hosted", "ok")]
    assert trails[2] == [("tower", "http_500"), ("hosted", "ok")]
    assert trails[4] == [("hosted", "ok")]  # X-Prefer-Backend: hosted
    assert trails[5] == [("tower", "saturated"), ("hosted", "ok")]
    assert trails[6] == [("tower", "saturated"), ("hosted", "ok")]
    assert trails[7] == [("tower", "skipped"), ("hosted", "ok")]
    assert trails[8] == [("tower", "ok")]
    assert all(o.status == 200 and o.error is None for o in outcomes)
    # The skipped tower costs no wait; the quiet one cost about slow_after.
    assert outcomes[7].seconds < outcomes[5].seconds
    assert "backend_saturated" in text
    assert "log: breaker.opened" in text
    assert "tiers tried: tower (connect_refused) -> hosted (ok)" in text
