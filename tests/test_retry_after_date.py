"""A ``Retry-After`` given as an HTTP date is honoured as the seconds until that date
(docs/breaker.md: "seconds or an HTTP date"; RFC 9110 section 10.2.3).

The date is epoch seconds, whole: it is read against the wall clock, which virtual time
does not switch. A date ``AHEAD`` seconds away is so read as at most ``AHEAD`` seconds (time
only goes forward) and at least what is left once the test ran, so the bounds below are the
date's own whole-second rounding plus any time the machine took, never a deadline on it.
"""

from __future__ import annotations

import time
from email.utils import formatdate

import pytest

from tierchain import MemoryStore
from tierchain._responses import retry_after

from .test_breaker import Tiers, call, chain

AHEAD = 600


def http_date(seconds_ahead: int) -> bytes:
    """An IMF-fixdate (``Wed, 21 Oct 2015 07:28:00 GMT``) ``seconds_ahead`` whole seconds on."""
    return formatdate(int(time.time()) + seconds_ahead, usegmt=True).encode()


def test_a_retry_after_date_is_read_as_the_seconds_until_it():
    seconds = retry_after([(b"retry-after", http_date(AHEAD))])
    assert seconds is not None
    assert AHEAD - 60 < seconds <= AHEAD
    assert retry_after([(b"retry-after", b"120")]) == 120.0
    assert retry_after([(b"retry-after", http_date(-60))]) == 0.0  # a date gone by: now
    assert retry_after([(b"retry-after", b"Someday, soon")]) is None


async def test_a_503_with_a_retry_after_date_opens_the_breaker_until_that_date(manual_clock):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower=(503, [(b"retry-after", http_date(AHEAD))]))
    app = chain(tiers, store, failure_threshold=5, failure_cooldown=30.0)
    result = await call(app)
    assert result.status == 200  # hosted answered
    snap = await store.breaker_snapshot("echo", "tower")
    # One failure of five opens it, for the date's seconds, not failure_cooldown's 30.
    assert (snap.state, snap.failures) == ("open", 1)
    assert AHEAD - 60 < snap.retry_in <= AHEAD
    manual_clock.advance(snap.retry_in - 1)
    await call(app)
    assert tiers.calls["tower"] == 1  # skipped until the date
    manual_clock.advance(1)
    tiers.modes["tower"] = "ok"
    assert (await call(app)).headers["x-tierchain-backend"] == "tower"


@pytest.mark.parametrize("status", [429, 503])
async def test_a_retry_after_date_past_the_cap_holds_the_breaker_for_the_cap(manual_clock, status):
    store = MemoryStore(clock=manual_clock)
    tiers = Tiers(tower=(status, [(b"retry-after", http_date(7200))]))
    await call(chain(tiers, store, retry_after_cap=900.0))
    assert (await store.breaker_snapshot("echo", "tower")).retry_in == pytest.approx(900.0)
