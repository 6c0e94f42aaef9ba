"""The watchdog's suspect marks (tierchain.suspect_marks): one verdict spares the next callers.

What a gateway does with a judged backend end to end is tests/test_shared_normals.py's; here,
the marks' own rules: the callers after are turned away as busy while the mark holds, then
one caller goes through as its probe, and a store that fails never fails a request. The
stores are the package's own MemoryStore, asked both without a coroutine (this process's
marks) and through the store protocol's coroutines (as a RedisStore is asked).
"""

from __future__ import annotations

import logging

import pytest

from tierchain import Backend, MemoryStore
from tierchain.errors import BackendBusy
from tierchain.request import Attempt
from tierchain.suspect_marks import SuspectMarks

from .support import on_virtual_time


class Remote(MemoryStore):
    """A MemoryStore that is not this process's own: asked through its coroutines."""


def attempt(name: str = "tower") -> Attempt:
    return Attempt(1, 2, Backend(name, "http://127.0.0.1:9"), "echo")


@on_virtual_time
async def test_a_marked_backend_is_busy_for_the_callers_after_then_one_probes_it():
    import asyncio

    store = MemoryStore()
    marks = SuspectMarks(store, 10.0)
    assert marks.local
    assert marks.check_now(attempt()) is None  # nothing marked
    marks.mark("echo", "tower", "too_slow")
    with pytest.raises(BackendBusy, match="suspect: too_slow on an earlier request"):
        marks.check_now(attempt())
    assert marks.check_now(attempt("other")) is None  # per backend
    await asyncio.sleep(10.0)
    probe = marks.check_now(attempt())
    assert probe is not None
    assert probe.probe
    assert probe.why == "too_slow"
    with pytest.raises(BackendBusy):  # one probe at a time
        marks.check_now(attempt())
    marks.passed("tower", marked=False, healthy=True)  # the probe answered whole
    assert marks.check_now(attempt()) is None


@on_virtual_time
async def test_a_remote_store_is_asked_through_its_coroutines_with_the_same_rules():
    import asyncio

    marks = SuspectMarks(Remote(), 10.0)
    assert not marks.local
    marks.mark("echo", "tower", "stalled")
    await asyncio.sleep(0)  # the write, in the background
    with pytest.raises(BackendBusy, match="stalled"):
        await marks.check(attempt())
    await asyncio.sleep(10.0)
    probe = await marks.check(attempt())
    assert probe is not None
    assert probe.probe
    marks.passed("tower", marked=True, healthy=False)  # judged again: the mark stands anew
    await asyncio.sleep(0)
    with pytest.raises(BackendBusy):
        await marks.check(attempt())


def test_no_mark_is_written_with_suspect_for_0():
    store = MemoryStore()
    marks = SuspectMarks(store, 0.0)
    marks.mark("echo", "tower", "too_slow")
    assert marks.check_now(attempt()) is None


@on_virtual_time
async def test_a_failing_store_never_fails_a_request(caplog, monkeypatch):
    def away(self: MemoryStore, backend: str, lease: float) -> None:
        raise ConnectionError("store away")

    caplog.set_level(logging.WARNING, logger="tierchain")
    monkeypatch.setattr(MemoryStore, "suspect_check_now", away)  # (every MemoryStore's)
    assert SuspectMarks(MemoryStore(), 10.0).check_now(attempt()) is None
    assert await SuspectMarks(Remote(), 10.0).check(attempt()) is None
    assert caplog.text.count("watchdog.suspect_store_failed") == 2
