"""A finished request leaves nothing for the garbage collector.

Every object a request makes through the whole stack must be freed by
reference counting the moment the request ends. A reference cycle (a callback
that points back at its owner, an exception whose traceback holds the frame
that keeps it) keeps the request's whole object graph alive until the next
collection, and makes the collector run often and long at high request rates.
"""

from __future__ import annotations

import gc
from collections import Counter

import pytest

from .support import answering, on_virtual_time, one_request, whole_stack


@pytest.mark.parametrize("tower", ["answers", "raises", "503"])
@on_virtual_time  # the 503's same-tier retries wait their random pause on the virtual clock
async def test_a_request_through_the_whole_stack_leaves_no_reference_cycle(tower):
    app = whole_stack(answering(tower))
    await one_request(app)  # warm: first-use caches are not per-request garbage
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        sent = [await one_request(app) for _ in range(20)]
        gc.collect()
        left = Counter(type(o).__qualname__ for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    assert all(s[0]["status"] == 200 for s in sent), sent[0]
    assert all(b"data: [DONE]" in b"".join(m.get("body", b"") for m in s) for s in sent)
    assert left == Counter(), f"objects left in reference cycles: {left.most_common(8)}"
