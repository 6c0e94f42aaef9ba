"""The README's first command: the demo tells the story and exits by itself."""

from __future__ import annotations

from tierchain.demo import run_demo


async def test_the_demo_shows_each_request_with_the_tiers_it_tried():
    printed: list[str] = []
    outcomes = await run_demo(fast=True, color=False, out=printed.append)
    text = "\n".join(printed)
    assert outcomes[0].trail == "tower;outcome=ok"
    assert outcomes[1].trail == "tower;outcome=connect_refused, hosted;outcome=ok"
    assert all(o.status == 200 and o.error is None for o in outcomes)
    assert "tiers tried: tower (connect_refused) -> hosted (ok)" in text
    assert "Hello from the hosted tier." in text
