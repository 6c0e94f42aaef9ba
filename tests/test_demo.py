"""The README's first command: the demo tells the story and exits by itself."""

from __future__ import annotations

from tierchain.demo import FAST, run_demo, trail_of

from .support import now, on_virtual_time


@on_virtual_time
async def test_the_demo_tells_the_outage_story_with_the_tiers_each_request_tried():
    printed: list[str] = []
    t0 = now()
    outcomes = await run_demo(fast=True, color=False, out=printed.append)
    took = now() - t0
    text = "\n".join(printed)
    trails = [trail_of(o) for o in outcomes]
    assert trails[0] == [("tower", "ok")]
    assert trails[1] == [("tower", "connect_refused"), ("hosted", "ok")]
    assert trails[2] == [("tower", "http_500"), ("tower", "http_500"), ("hosted", "ok")]
    assert trails[4] == [("hosted", "ok")]  # X-Prefer-Backend: hosted
    assert trails[5] == [("tower", "saturated"), ("hosted", "ok")]
    assert trails[6] == [("tower", "saturated"), ("hosted", "ok")]
    assert trails[7] == [("tower", "skipped"), ("hosted", "ok")]
    assert trails[8] == [("tower", "ok")]  # recovered by status, not by the cooldown
    assert took < FAST.saturation_cooldown
    assert trails[9] == [("tower", "busy"), ("hosted", "ok")]  # max_in_flight=1
    assert trails[10] == [("tower", "ok")]  # the long answer that held the tower
    assert outcomes[9].seconds < outcomes[5].seconds  # a busy skip costs no wait
    assert all(o.status == 200 and o.error is None for o in outcomes)
    # The skipped tower costs no wait; the quiet one cost about slow_after.
    assert outcomes[7].seconds < outcomes[5].seconds
    assert "backend_saturated" in text
    assert "log: breaker.opened" in text
    assert "tiers tried: tower (connect_refused) -> hosted (ok)" in text
    assert "backend_busy  backend=tower, in_flight=1, failing_over=True" in text
    assert 'reason="queued"' in text  # the status said requests were waiting: not ours
    # The log lines' own words are said plainly, once each.
    assert text.count('(verdict="queued": before giving up on the tower, the gateway asked') == 1
    assert "its status says requests are waiting in its queue" in text
    assert text.count("kept back for the later tiers (hosted)") == 1
    assert "log: breaker.half_open" in text  # woken by the status, long before the cooldown
