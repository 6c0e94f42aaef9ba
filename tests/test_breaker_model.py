"""Model-based test: the stores' breaker against a plain restatement of the rules.

Hypothesis drives random interleavings of acquires (many may be outstanding at
once, which is the concurrency of the half-open gate), outcomes recorded in any
order, forced attempts, probes that never report, and time passing. After every
step the store must agree with the reference model, and no two probes may ever
hold the half-open gate at once.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from tierchain import MemoryStore, RedisStore
from tierchain.store import BreakerPolicy, Ticket

POLICY = BreakerPolicy(
    failure_threshold=3,
    failure_cooldown=30.0,
    saturation_threshold=2,
    saturation_cooldown=900.0,
    retry_after_cap=100.0,
    probe_lease=60.0,
    probe_every=2.0,
)
KEYS = [("echo", "tower"), ("echo", "hosted")]
STEPS = [0.5, 1.0, 2.0, 4.0, 29.5, 30.0, 45.0, 60.0, 120.0, 899.0, 900.0]


# -- the reference model ---------------------------------------------------------


@dataclass
class Verdict:
    """What the model says about one acquire."""

    admitted: bool
    probe: bool
    state: str
    retry_in: float | None
    era: int
    token: int


class Reference:
    """One breaker, written from the issue's sentences rather than from store.py."""

    def __init__(self) -> None:
        self.state = "closed"
        self.failures = 0
        self.saturations = 0
        self.reopen_at = 0.0
        self.reopens = 0  # failed probes since it last closed
        self.era = 0  # how many times it has opened
        self.holder: int | None = None  # the probe holding the gate
        self.holder_until = 0.0
        self.tokens = itertools.count(1)

    def look(self, now: float) -> str:
        if self.state == "open" and now >= self.reopen_at:
            self.state = "half_open"  # a cooldown that ended lets a probe go
        return self.state

    def acquire(self, now: float, force: bool) -> Verdict:
        state = self.look(now)
        if state == "closed":
            return Verdict(True, False, state, None, self.era, 0)
        if force:  # "try the soonest": the breaker lets a forced attempt through
            return Verdict(True, False, state, None, self.era, 0)
        if state == "open":
            return Verdict(False, False, state, self.reopen_at - now, self.era, 0)
        gate_free = self.holder is None or self.holder_until <= now
        if not gate_free:
            return Verdict(False, False, state, 1.0, self.era, 0)
        token = next(self.tokens)
        self.holder, self.holder_until = token, now + POLICY.probe_lease
        return Verdict(True, True, state, None, self.era, token)

    def open_for(self, now: float, seconds: float) -> None:
        if self.state != "open":
            self.era += 1
            self.holder = None
        self.state = "open"
        self.reopen_at = max(self.reopen_at, now + seconds)  # never shortened

    def record(self, now: float, verdict: Verdict, outcome: str, retry_after: float | None) -> None:
        state = self.look(now)
        if verdict.probe and self.holder == verdict.token:
            self.holder = None  # whatever happened, the probe gives the gate back
        current = verdict.era == self.era
        if outcome == "success":
            if current:  # one good attempt clears both counts and closes
                self.failures = self.saturations = 0
                if state != "closed":
                    self.state = "closed"
                    self.reopen_at = 0.0
                    self.reopens = 0
                    self.holder = None
            return
        if outcome == "neutral":
            return
        if outcome == "failure":
            self.failures += 1
            # Envoy's ejection backoff: the base times the opens in a row, capped
            own = min(POLICY.failure_cooldown, POLICY.probe_every * (self.reopens + 1))
            over = self.failures >= POLICY.failure_threshold
        else:
            self.saturations += 1
            own = POLICY.saturation_cooldown
            over = self.saturations >= POLICY.saturation_threshold
        if state != "closed":
            if current:  # the probe (or a forced attempt) failed: re-open
                hinted = 0.0 if retry_after is None else min(retry_after, POLICY.retry_after_cap)
                if outcome == "saturation":
                    # re-opens grow from 30 s, doubling, up to the saturation cooldown
                    own = min(POLICY.saturation_cooldown, 30.0 * 2**self.reopens)
                else:  # one probe_every longer per failed probe, up to the failure cooldown
                    own = min(POLICY.failure_cooldown, POLICY.probe_every * (self.reopens + 2))
                self.reopens += 1
                self.open_for(now, max(own, hinted))
            return  # an old verdict is counted, nothing more
        seconds = own if over else 0.0
        if retry_after is not None:
            seconds = max(seconds, min(retry_after, POLICY.retry_after_cap))
            over = True
        if over:
            self.open_for(now, seconds)


# -- the machine ---------------------------------------------------------------------


class BreakerMachine(RuleBasedStateMachine):
    """Drive one store and one Reference per key with the same steps."""

    redis_url: str | None = None
    prefixes = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self.now = 1_000_000.0
        self.loop = asyncio.new_event_loop()
        if self.redis_url is None:
            self.store: MemoryStore | RedisStore = MemoryStore(clock=self.clock)
        else:
            # The rules are under test here, not outages: a reply slowed by a
            # busy machine must not send the store to its local fallback.
            self.store = RedisStore(
                self.redis_url,
                clock=self.clock,
                prefix=f"model{next(self.prefixes)}:",
                timeout=30.0,
            )
        self.models = {key: Reference() for key in KEYS}
        self.outstanding: list[tuple[tuple[str, str], Ticket, Verdict, float]] = []

    def clock(self) -> float:
        return self.now

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def teardown(self) -> None:
        if isinstance(self.store, RedisStore):
            self.run(self.store.aclose())
        self.loop.close()

    tickets = Bundle("tickets")

    @rule(target=tickets, key=st.sampled_from(KEYS), force=st.sampled_from([False] * 4 + [True]))
    def acquire(self, key, force):
        got = self.run(self.store.breaker_acquire(*key, POLICY, force=force))
        want = self.models[key].acquire(self.now, force)
        assert (got.admitted, bool(got.probe), got.state) == (
            want.admitted,
            want.probe,
            want.state,
        )
        if want.retry_in is None:
            assert got.retry_in is None
        else:
            assert got.retry_in == pytest.approx(want.retry_in, abs=1e-3)
        if not got.admitted:
            return multiple()  # nothing to report later
        entry = (key, got, want, self.now)
        self.outstanding.append(entry)
        return entry

    @rule(
        entry=consumes(tickets),
        outcome=st.sampled_from(["success", "failure", "saturation", "neutral", "lost"]),
        retry_after=st.sampled_from([None, None, None, 1.0, 45.0, 500.0]),
    )
    def record(self, entry, outcome, retry_after):
        key, got, want, _ = entry
        self.outstanding.remove(entry)
        if outcome == "lost":
            return  # the attempt's replica died: its ticket is never recorded
        if outcome != "failure":
            retry_after = None
        self.run(
            self.store.breaker_record(
                *key,
                POLICY,
                outcome,
                gen=got.gen,
                probe=got.probe,
                retry_after=retry_after,
            )
        )
        self.models[key].record(self.now, want, outcome, retry_after)

    @rule(seconds=st.sampled_from(STEPS))
    def time_passes(self, seconds):
        self.now += seconds

    @invariant()
    def the_store_agrees_with_the_model(self):
        for key, model in self.models.items():
            snap = self.run(self.store.breaker_snapshot(*key))
            state = model.look(self.now)
            assert (snap.state, snap.failures, snap.saturations) == (
                state,
                model.failures,
                model.saturations,
            )
            if state == "open":
                assert snap.retry_in == pytest.approx(model.reopen_at - self.now, abs=1e-3)
            else:
                assert snap.retry_in is None

    @invariant()
    def at_most_one_probe_holds_the_gate(self):
        # A probe holds the gate while its lease runs and the breaker has not
        # re-opened since it was let through. (Once the lease has run out, a
        # second probe may go: the first is presumed lost with its replica. If
        # it answers after all and the breaker re-opens, it holds no gate.)
        for key in KEYS:
            era = self.models[key].era
            live = [
                t
                for k, t, want, at in self.outstanding
                if k == key and t.probe and at + POLICY.probe_lease > self.now and want.era == era
            ]
            assert len(live) <= 1


def test_memory_store_follows_the_model():
    run_state_machine_as_test(
        BreakerMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


@pytest.mark.redis
def test_redis_store_follows_the_model(redis_server):
    class OnRedis(BreakerMachine):
        redis_url = redis_server.url

    run_state_machine_as_test(
        OnRedis,
        settings=settings(
            max_examples=25,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
