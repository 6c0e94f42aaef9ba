"""Backend, Routes and current_attempt: validation and the handler's one call."""

from __future__ import annotations

import pytest

from tierchain import Backend, Routes, current_attempt
from tierchain.request import SCOPE_KEY, AttemptRecord, ReplicaRecord, TierRequest


def test_a_backend_name_outside_the_allowed_characters_is_refused_naming_it():
    with pytest.raises(ValueError, match="'tower 1'"):
        Backend("tower 1", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="1-64"):
        Backend("x" * 65, "http://127.0.0.1:1")


@pytest.mark.parametrize("url", ["127.0.0.1:11434", "ftp://host", "http://", "tower"])
def test_a_url_without_scheme_and_host_is_refused(url):
    with pytest.raises(ValueError, match="scheme and a host"):
        Backend("tower", url)


def test_a_bad_status_url_is_refused_too():
    with pytest.raises(ValueError, match="status_url"):
        Backend("tower", "http://127.0.0.1:1", status_url="nope")


def test_an_empty_chain_is_refused_naming_the_route():
    with pytest.raises(ValueError, match="'echo' has an empty chain"):
        Routes({"echo": []})


def test_a_duplicate_backend_name_is_refused_naming_both():
    a = Backend("tower", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="'echo' names backend 'tower' twice"):
        Routes({"echo": [a, Backend("tower", "http://127.0.0.1:2")]})


def test_routes_keep_the_chain_order_and_find_backends():
    a, b = Backend("tower", "http://127.0.0.1:1"), Backend("hosted", "https://api.example.com")
    routes = Routes({"echo": [a, b]})
    assert routes["echo"] == (a, b)
    assert routes.backend("echo", "hosted") is b
    assert routes.backend("echo", "nope") is None
    assert "echo" in routes
    assert len(routes) == 1


def test_backend_headers_are_frozen_and_hidden_from_repr():
    b = Backend("hosted", "https://api.example.com", headers={"authorization": "Bearer sk-secret"})
    assert "sk-secret" not in repr(b)
    with pytest.raises(TypeError):
        b.headers["x"] = "y"  # type: ignore[index]


def test_current_attempt_without_failover_says_what_to_add():
    with pytest.raises(RuntimeError, match=r"add Failover\(app, routes=\.\.\.\)"):
        current_attempt({"type": "http"})


def test_state_events_reach_listeners_in_order_and_a_broken_listener_breaks_nothing():
    scope: dict = {"type": "http"}
    req = TierRequest.of(scope)
    assert scope[SCOPE_KEY] is req
    assert TierRequest.of(scope) is req
    seen = []

    def broken(event):
        raise RuntimeError("display bug")

    req.subscribe(broken)
    unsubscribe = req.subscribe(seen.append)
    req.emit("attempt", n=1, of=2, backend="tower")
    req.emit("generating", backend="tower")
    unsubscribe()
    req.emit("backend_failed", backend="tower")
    assert [e["state"] for e in seen] == ["attempt", "generating"]
    assert req.state == {"state": "backend_failed", "backend": "tower"}


def test_an_attempt_record_is_equal_to_and_hashes_as_one_with_the_same_fields():
    # Not frozen (its construction's cost, docs/benchmarks.md), yet hashable by its fields.
    first = AttemptRecord(1, "tower", "saturated", 0.5, retry_after=2.0)
    again = AttemptRecord(1, "tower", "saturated", 0.5, retry_after=2.0)
    assert first == again
    assert hash(first) == hash(again)
    assert len({first, again, AttemptRecord(2, "hosted", "ok", 0.1)}) == 2
    replica = ReplicaRecord(1, "tower", "ok", 0.5, pool="gpus")
    assert replica.pool == "gpus"
    assert first.pool is None
    assert replica != ReplicaRecord(1, "tower", "ok", 0.5, pool="other")
    assert hash(replica) == hash(ReplicaRecord(1, "tower", "ok", 0.5, pool="gpus"))
