"""One check for every duration and count a user passes, and one grammar for a duration as text.

Every duration parameter of every public class takes seconds or a ``timedelta`` and refuses
NaN, infinity, negative values and ``bool`` in the same words; the variables, the routes file
and the Admin's pin ttl read a duration written as text with the same grammar.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import tierchain
from tierchain import (
    Admin,
    Allowance,
    Backend,
    Breaker,
    Budget,
    Endpoints,
    Failover,
    Forwarder,
    Heartbeats,
    Learned,
    MemoryStore,
    PreferBackend,
    RedisStore,
    Routes,
    SaturationWatchdog,
    Shed,
    _checks,
    env_parsers,
    routes_file,
)
from tierchain.__main__ import main
from tierchain.admin import app as admin_app
from tierchain.admin import parse_ttl
from tierchain.admission import Admission
from tierchain.config import ConfigError, from_env, load_routes
from tierchain.learned import LearnedGap
from tierchain.status import StatusBoard


async def _app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
    raise AssertionError("not called")


ROUTES = Routes({"echo": [Backend("tower", "http://127.0.0.1:1")]})
TOKEN = "a-token-long-enough-0123456789"

# What builds each public class (and the public helpers that take durations) with one
# keyword changed.
BUILDERS: dict[str, Callable[..., Any]] = {
    "Shed": lambda **kw: Shed(_app, **kw),
    "Heartbeats": lambda **kw: Heartbeats(_app, **kw),
    "Budget": lambda **kw: Budget(_app, **kw),
    "PreferBackend": lambda **kw: PreferBackend(_app, **kw),
    "Failover": lambda **kw: Failover(_app, routes=ROUTES, **kw),
    "Breaker": lambda **kw: Breaker(_app, **kw),
    "SaturationWatchdog": lambda **kw: SaturationWatchdog(_app, **kw),
    "Forwarder": lambda **kw: Forwarder(**kw),
    "Endpoints": lambda **kw: Endpoints(**kw),
    "Admin": lambda **kw: Admin(routes=ROUTES, store=MemoryStore(), token=TOKEN, **kw),
    "Backend": lambda **kw: Backend("b", "http://127.0.0.1:1", **kw),
    "Allowance": lambda **kw: Allowance(**kw),
    "Learned": lambda **kw: Learned(**kw),
    "LearnedGap": lambda **kw: LearnedGap(**kw),
    "RedisStore": lambda **kw: RedisStore(**kw),
    "StatusBoard": lambda **kw: StatusBoard(**kw),
    "Admission": lambda **kw: Admission(**kw),
}

# (class, parameter, where the checked seconds are kept, whether 0 is taken (0: off),
# whether None is taken)
DURATIONS: list[tuple[str, str, str, bool, bool]] = [
    ("Shed", "retry_after", "retry_after", True, False),
    ("Heartbeats", "interval", "interval", True, False),
    ("Heartbeats", "commit_after", "commit_after", True, False),
    ("Budget", "default", "default", False, True),
    ("Budget", "max", "max", False, True),
    ("PreferBackend", "pin_timeout", "pin_timeout", False, False),
    ("Failover", "lease", "admission.lease", False, False),
    ("Failover", "body_timeout", "body_timeout", False, True),
    ("Failover", "send_timeout", "send_timeout", False, True),
    ("Failover", "max_wait", "max_wait", False, False),
    ("Failover", "max_retry_wait", "max_retry_wait", True, False),
    ("Failover", "max_retry_wait", "max_retry_wait", True, False),
    ("Failover", "hedge_after", "hedge_after", True, True),
    ("Breaker", "failure_cooldown", "policy.failure_cooldown", True, False),
    ("Breaker", "probe_every", "policy.probe_every", True, False),
    ("Breaker", "saturation_cooldown", "policy.saturation_cooldown", True, False),
    ("Breaker", "saturation_backoff", "policy.saturation_backoff", True, False),
    ("Breaker", "retry_after_cap", "policy.retry_after_cap", True, False),
    ("Breaker", "probe_lease", "policy.probe_lease", False, False),
    ("Breaker", "rest_check_every", "rest.every", True, False),
    ("Breaker", "rest_check_timeout", "rest.timeout", False, False),
    ("SaturationWatchdog", "slow_after", "slow_after", True, False),
    ("SaturationWatchdog", "ceiling", "ceiling", False, False),
    ("SaturationWatchdog", "probe_timeout", "probe_timeout", False, False),
    ("SaturationWatchdog", "stall_after", "stall_after", True, False),
    ("SaturationWatchdog", "stall_floor", "learned_gap.floor", False, False),
    ("SaturationWatchdog", "stall_ceiling", "learned_gap.maximum", False, False),
    ("SaturationWatchdog", "reserve", "reserve", True, False),
    ("SaturationWatchdog", "reserve_floor", "reserve_floor", True, False),
    ("SaturationWatchdog", "progress_span", "progress_span", True, False),
    ("SaturationWatchdog", "ask_first", "ask_first", True, False),
    ("SaturationWatchdog", "status_late", "status_late", True, False),
    ("SaturationWatchdog", "status_interval", "board.interval", True, False),
    ("SaturationWatchdog", "status_stale", "board.stale_after", False, False),
    ("SaturationWatchdog", "suspect_for", "suspect_for", True, False),
    ("SaturationWatchdog", "decode_span", "decode.span", False, False),
    ("Forwarder", "connect_timeout", "connect_timeout", False, False),
    ("Forwarder", "body_timeout", "body_timeout", False, True),
    ("Endpoints", "snapshot_timeout", "snapshot_timeout", False, False),
    ("Admin", "max_ttl", "max_ttl", False, False),
    ("Admin", "session_ttl", "session_ttl", False, False),
    ("Backend", "stall_after", "stall_after", False, True),
    ("Backend", "first_token", "first_token", False, True),
    ("Allowance", "cold_start", "cold_start", True, False),
    ("Allowance", "base", "base", True, False),
    ("Allowance", "per_1k_tokens", "per_1k_tokens", True, False),
    ("Allowance", "ceiling", "ceiling", False, False),
    ("Learned", "maximum", "maximum", False, False),
    ("Learned", "floor", "floor", False, False),
    ("LearnedGap", "maximum", "maximum", False, False),
    ("LearnedGap", "floor", "floor", False, False),
    ("RedisStore", "timeout", "timeout", False, False),
    ("RedisStore", "reconnect_every", "reconnect_every", False, False),
    ("RedisStore", "ttl", "ttl", False, False),
    ("StatusBoard", "interval", "interval", False, False),
    ("StatusBoard", "stale_after", "stale_after", False, False),
    ("StatusBoard", "timeout", "timeout", False, False),
    ("StatusBoard", "idle_stop", "idle_stop", False, False),
    ("Admission", "lease", "lease", False, False),
]

# Float (or None) parameters of those classes that are not durations.
NOT_DURATIONS = {
    ("SaturationWatchdog", "normal_multiple"),  # a multiple of a learned batch wait
    ("SaturationWatchdog", "prompt_margin"),  # a multiple of the expected prefill
    ("SaturationWatchdog", "busy_kv_cache"),  # a fraction
    ("SaturationWatchdog", "slow_decode"),  # a fraction of the normal decode rate
    ("Failover", "waiting_key_share"),  # a fraction of the waiting room
    ("Learned", "quantile"),
    ("Learned", "margin"),
    ("Learned", "half_life"),  # in samples
    ("LearnedGap", "quantile"),
    ("LearnedGap", "margin"),
    ("LearnedGap", "half_life"),
}

# Options that take a word as well as seconds ("auto"; "allowance" from a variable).
TAKES_WORDS = {
    ("SaturationWatchdog", "slow_after"),
    ("SaturationWatchdog", "stall_after"),
    ("SaturationWatchdog", "reserve"),
}

# Dataclasses whose fields are annotated with what they keep (seconds as a float): they take a
# timedelta too, and keep it as seconds.
KEPT_AS_FLOAT = {"Allowance", "Learned", "LearnedGap"}

# The seconds each timedelta test passes (session_ttl has a floor of 60 s).
SECONDS = {"session_ttl": 90.0}

ONE_WORDING = re.compile(
    r"(^|\s)(?P<name>[a-z_0-9]+) must be a finite number of seconds (> 0|>= [0-9.]+) "
    r"\(or a timedelta\)(, or None|, or 'auto'|, a callable, or 'auto')?, got "
)


def ids(entry: tuple[str, str, str, bool, bool]) -> str:
    return f"{entry[0]}.{entry[1]}"


def kept(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1, -0.5, True, False, "30"])
@pytest.mark.parametrize("entry", DURATIONS, ids=ids)
def test_every_duration_refuses_nan_infinity_negatives_and_bools_in_one_wording(entry, bad):
    cls, param, *_ = entry
    with pytest.raises(ValueError, match=re.escape(param)) as caught:
        BUILDERS[cls](**{param: bad})
    message = str(caught.value)
    shape = ONE_WORDING.search(message)
    assert shape is not None, f"{cls}({param}={bad!r}) says {message!r}"
    assert shape["name"] == param
    assert ("'auto'" in message) == ((cls, param) in TAKES_WORDS)
    assert message.endswith(f"got {bad!r}")


@pytest.mark.parametrize("entry", DURATIONS, ids=ids)
def test_every_duration_takes_a_timedelta_and_keeps_it_as_seconds(entry):
    cls, param, where, _, _ = entry
    seconds = SECONDS.get(param, 7.5)
    built = BUILDERS[cls](**{param: timedelta(seconds=seconds)})
    value = kept(built, where)
    assert type(value) is float
    assert value == seconds
    assert kept(BUILDERS[cls](**{param: seconds}), where) == value


@pytest.mark.parametrize("entry", DURATIONS, ids=ids)
def test_zero_is_taken_only_where_it_means_off_and_none_only_where_it_means_none(entry):
    cls, param, where, zero_ok, none_ok = entry
    if zero_ok and (cls, param) == ("SaturationWatchdog", "status_interval"):
        assert BUILDERS[cls](**{param: 0}).board is None  # 0: no polling
        assert BUILDERS[cls](**{param: timedelta(0)}).board is None
    elif zero_ok:
        assert kept(BUILDERS[cls](**{param: 0}), where) == 0.0
        assert kept(BUILDERS[cls](**{param: timedelta(0)}), where) == 0.0
    else:
        with pytest.raises(ValueError, match=f"{param} must be a finite number of seconds"):
            BUILDERS[cls](**{param: 0})
    if none_ok:
        assert kept(BUILDERS[cls](**{param: None}), where) is None
    else:
        with pytest.raises(ValueError, match=f"{param} must be a finite number of seconds"):
            BUILDERS[cls](**{param: None})


def parameters(cls: str) -> dict[str, inspect.Parameter]:
    target = BUILDERS[cls]
    built = {
        "Shed": Shed,
        "Heartbeats": Heartbeats,
        "Budget": Budget,
        "PreferBackend": PreferBackend,
        "Failover": Failover,
        "Breaker": Breaker,
        "SaturationWatchdog": SaturationWatchdog,
        "Forwarder": Forwarder,
        "Endpoints": Endpoints,
        "Admin": Admin,
        "Backend": Backend,
        "Allowance": Allowance,
        "Learned": Learned,
        "LearnedGap": LearnedGap,
        "RedisStore": RedisStore,
        "StatusBoard": StatusBoard,
        "Admission": Admission,
    }[cls]
    assert callable(target)
    return dict(inspect.signature(built).parameters)


def annotation(cls: str, name: str) -> str:
    """The parameter's annotation as text, with a module-level alias (``SlowAfter``) spelt out."""
    text = str(parameters(cls)[name].annotation)
    module = sys.modules[type(BUILDERS[cls]()).__module__]
    return f"{text} = {getattr(module, text, '')}"


@pytest.mark.parametrize("cls", sorted(BUILDERS))
def test_the_table_names_every_duration_parameter_of_the_class(cls):
    """A new float option is either a duration (then it is in the table above) or named here as
    something else."""
    tested = {param for c, param, *_ in DURATIONS if c == cls}
    floats = {
        name
        for name, p in parameters(cls).items()
        if isinstance(p.default, float) or "timedelta" in str(p.annotation)
    }
    untested = sorted(floats - tested - {p for c, p in NOT_DURATIONS if c == cls})
    assert not untested, f"{cls}: add {untested} to DURATIONS or NOT_DURATIONS"
    if cls not in KEPT_AS_FLOAT:
        said = {name for name in tested if "timedelta" not in annotation(cls, name)}
        assert not said, (
            f"{cls}: {sorted(said)} take a timedelta but their annotation does not say so"
        )


# Public classes the package builds itself, whose float fields are facts, not options.
NOT_BUILT_BY_USERS = {
    "Attempt": "one attempt of a request, built by Failover (reserve: what the watchdog kept)",
}

# Public classes whose float fields are numbers of another kind (each checked where it is).
NOT_DURATIONS_AT_ALL = {
    "PickWeights": "the weights of a pool replica's score (finite numbers >= 0, picker.py)",
}


def test_the_table_covers_every_public_class_that_takes_a_duration():
    public = {
        name
        for name in tierchain.__all__
        if inspect.isclass(getattr(tierchain, name))
        and not issubclass(getattr(tierchain, name), BaseException)
    }
    for name in sorted(
        public - set(BUILDERS) - set(NOT_BUILT_BY_USERS) - set(NOT_DURATIONS_AT_ALL)
    ):
        cls = getattr(tierchain, name)
        fields = (
            {f.name: f.default for f in dataclasses.fields(cls)}
            if dataclasses.is_dataclass(cls)
            else {}
        )
        try:
            params = {n: p.default for n, p in inspect.signature(cls).parameters.items()}
        except (TypeError, ValueError):
            params = {}
        floats = [n for n, d in {**fields, **params}.items() if isinstance(d, float)]
        assert not floats, f"{name} takes {floats}: add it to BUILDERS and DURATIONS"


# -- counts ----------------------------------------------------------------------------

COUNTS: list[tuple[str, str, int, bool]] = [
    ("Shed", "max_concurrent", 1, True),
    ("Heartbeats", "max_queued", 1, False),
    ("Failover", "max_headers", 1, False),
    ("Failover", "max_header_bytes", 1, False),
    ("Failover", "max_body", 0, False),
    ("Failover", "retries", 0, False),
    ("Failover", "hold_limit", 0, False),
    ("Forwarder", "max_headers", 1, False),
    ("Forwarder", "max_header_bytes", 1, False),
    ("Forwarder", "max_body", 0, False),
    ("Forwarder", "max_keepalive", 0, False),
    ("Breaker", "failure_threshold", 1, False),
    ("Breaker", "saturation_threshold", 1, False),
    ("SaturationWatchdog", "busy_waiting", 1, False),
    ("Admin", "max_body", 1024, False),
    ("Backend", "max_in_flight", 1, True),
    ("Learned", "min_samples", 1, False),
    ("LearnedGap", "min_samples", 1, False),
]


@pytest.mark.parametrize(
    ("cls", "param", "minimum", "none_ok"), COUNTS, ids=[f"{c}.{p}" for c, p, *_ in COUNTS]
)
def test_every_count_refuses_fractions_bools_and_values_below_its_minimum_in_one_wording(
    cls, param, minimum, none_ok
):
    for bad in (minimum - 1, minimum + 0.5, True, math.nan, "8"):
        with pytest.raises(ValueError) as caught:
            BUILDERS[cls](**{param: bad})
        none = ", or None" if none_ok else ""
        assert str(caught.value).endswith(
            f"{param} must be a whole number >= {minimum}{none}, got {bad!r}"
        )
    assert BUILDERS[cls](**{param: minimum + 7}) is not None
    assert BUILDERS[cls](**{param: float(minimum + 7)}) is not None  # 8.0 is a whole number


# -- one text grammar ----------------------------------------------------------------

TEXTS = [
    ("30", 30.0),
    ("2.5", 2.5),
    ("1500ms", 1.5),
    ("2.5s", 2.5),
    ("90s", 90.0),
    ("1m", 60.0),
    ("1.5 m", 90.0),
    ("15m", 900.0),
    (" 2H ", 7200.0),
    ("1d", 86400.0),
    ("3.", 3.0),
]
NOT_TEXTS = [
    "",
    "-1",
    "+5",
    "1e3",
    "nan",
    "inf",
    "5 minutes",
    "1x",
    "1..2",
    "ms",
    "1 h 2 m",
    "1h30m",
]


def test_the_variables_and_the_admin_read_text_with_the_same_function():
    # the variables and the routes file through text_seconds, which reads parse_duration
    assert env_parsers.text_seconds is _checks.text_seconds
    assert routes_file.text_seconds is _checks.text_seconds
    assert admin_app.parse_duration is _checks.parse_duration


@pytest.mark.parametrize(("text", "seconds"), TEXTS)
def test_a_duration_reads_the_same_from_a_variable_the_routes_file_and_the_admin_ttl(
    tmp_path: Path, text, seconds
):
    assert _checks.parse_duration(text) == seconds
    routes = tmp_path / "routes.toml"
    routes.write_text(
        '[[routes.echo.backends]]\nname = "t"\nurl = "http://127.0.0.1:1"\n'
        f'stall_after = "{text}"\n'
    )
    settings = from_env(
        {"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_PREFER_PIN_TIMEOUT": text}
    )
    assert settings.middleware_kwargs("PreferBackend")["pin_timeout"] == seconds
    (backend,) = load_routes(str(routes), environ={})["echo"]
    assert backend.stall_after == seconds
    assert parse_ttl(text, 7 * 86400.0) == seconds


@pytest.mark.parametrize("text", NOT_TEXTS)
def test_text_that_is_not_a_duration_is_refused_by_each_reader(tmp_path: Path, text):
    with pytest.raises(ValueError, match="not a duration"):
        _checks.parse_duration(text)
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes.echo.backends]]\nname = "t"\nurl = "http://127.0.0.1:1"\n')
    with pytest.raises(ConfigError) as caught:
        from_env({"TIERCHAIN_ROUTES_FILE": str(routes), "TIERCHAIN_PREFER_PIN_TIMEOUT": text})
    assert caught.value.problems == (
        f"TIERCHAIN_PREFER_PIN_TIMEOUT={text!r}: expected seconds such as 30, 2.5, 500ms, 15m "
        "or 2h, > 0",
    )
    with pytest.raises(ValueError, match="is not a duration"):
        parse_ttl(text, 7 * 86400.0)


def test_a_text_duration_too_long_to_be_a_float_is_refused_by_the_range_not_taken():
    digits = "9" * 400
    assert _checks.parse_duration(digits) == math.inf
    with pytest.raises(ValueError, match="ttl must be between 1s and 7d"):
        parse_ttl(digits, 7 * 86400.0)
    with pytest.raises(ValueError):
        env_parsers.seconds()(digits)


def test_the_admin_ttl_now_takes_milliseconds_like_the_variables():
    assert parse_ttl("2500ms", 7 * 86400.0) == 2.5
    with pytest.raises(ValueError, match=r"ttl must be between 1s and 7d, got 0\.25 seconds"):
        parse_ttl("250ms", 7 * 86400.0)


@pytest.mark.parametrize(("text", "shown"), [("3m", "180"), ("90s", "90"), ("2.5", "2.5")])
def test_the_burst_probe_timeout_reads_the_same_grammar(capsys, text, shown):
    code = main(["burst-probe", "http://127.0.0.1:9/v1", "--model", "m", "--timeout", text])
    assert code == 2  # without --yes: the plan, nothing sent
    assert f"each call bounded at {shown} s" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "soon"])
def test_the_burst_probe_refuses_a_timeout_that_is_not_a_duration(capsys, text):
    code = main(["burst-probe", "http://127.0.0.1:9/v1", "--model", "m", "--timeout", text])
    assert code == 2
    assert "expected seconds such as 30, 2.5, 500ms, 15m or 2h" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, 0, True])
async def test_a_store_refuses_a_pin_ttl_that_is_not_a_duration(bad):
    with pytest.raises(ValueError, match=r"ttl must be a finite number of seconds > 0"):
        await MemoryStore().set_pin("echo", "tower", bad)
    assert await MemoryStore().set_pin("echo", "tower", 30) > 0
