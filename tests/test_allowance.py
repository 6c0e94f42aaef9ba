"""The continuous allowance (seed 002): no step ladder, never narrower than a cold load."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierchain import Allowance
from tierchain.allowance import estimate_tokens

COLD_MODEL_LOAD = 138.5  # seconds, measured in seed 002 for a 4-token prompt


@pytest.mark.parametrize(
    ("tokens", "seconds"),
    [(10_000, 400.0), (50_000, 560.0), (90_700, 722.8), (131_072, 884.288)],
)
def test_the_defaults_reproduce_the_measured_table(tokens, seconds):
    assert Allowance().for_tokens(tokens) == pytest.approx(seconds)


@given(st.floats(min_value=0, max_value=10_000_000, allow_nan=False))
def test_never_narrower_than_a_cold_model_load(tokens):
    assert Allowance().for_tokens(tokens) > COLD_MODEL_LOAD + 100


@given(
    st.floats(min_value=0, max_value=500_000, allow_nan=False),
    st.floats(min_value=0, max_value=500_000, allow_nan=False),
)
def test_monotone_in_the_token_count(a, b):
    allowance = Allowance()
    lo, hi = sorted((a, b))
    assert allowance.for_tokens(lo) <= allowance.for_tokens(hi)


def test_continuous_where_the_old_ladder_jumped():
    allowance = Allowance()
    for edge in (50_000, 100_000):
        below, above = allowance.for_tokens(edge - 1), allowance.for_tokens(edge + 1)
        assert above - below == pytest.approx(0.008)  # 2 tokens at 4 s per 1k


def test_clamped_to_the_ceiling():
    allowance = Allowance(ceiling=900)
    assert allowance.for_tokens(10**9) == 900
    assert allowance.for_tokens(float("inf")) == 900


def test_the_estimate_counts_message_text_bytes_over_four():
    body = json.dumps(
        {
            "model": "echo",
            "messages": [
                {"role": "system", "content": "x" * 400},
                {"role": "user", "content": [{"type": "text", "text": "y" * 800}]},
            ],
            "max_tokens": 99999,
        }
    ).encode()
    assert estimate_tokens(body) == 300
    assert Allowance()(body) == pytest.approx(360 + 4 * 0.3)


def test_cjk_text_is_not_undercounted_like_chars_over_four():
    body = json.dumps({"messages": [{"content": "世界" * 1000}]}, ensure_ascii=False).encode()
    assert estimate_tokens(body) == 1500  # 6000 UTF-8 bytes / 4, not 2000 chars / 4


def test_the_estimate_grows_with_the_prompt_not_with_other_fields():
    small = json.dumps({"messages": [{"content": "hi"}], "temperature": 0.2}).encode()
    padded = json.dumps({"messages": [{"content": "hi"}], "metadata": "z" * 9000}).encode()
    assert estimate_tokens(small) == estimate_tokens(padded) == 1
    tools = json.dumps({"messages": [], "tools": [{"name": "t" * 396}]}).encode()
    assert estimate_tokens(tools) > 100


def test_a_body_that_is_not_json_counts_as_all_prompt():
    assert estimate_tokens(b"plain text " * 40) == 110
    assert estimate_tokens(b"") == 0


def test_a_tokenizer_replaces_the_estimate_and_a_broken_one_falls_back():
    body = json.dumps({"messages": [{"content": "a b c"}]}).encode()
    assert Allowance(tokenizer=lambda text: 5000).tokens(body) == 5000

    def broken(text: str) -> int:
        raise RuntimeError("no vocab")

    assert Allowance(tokenizer=broken).tokens(body) == estimate_tokens(body)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cold_start": -1},
        {"per_1k_tokens": float("nan")},
        {"ceiling": 0},
        {"cold_start": 0, "base": 0},
    ],
)
def test_bad_options_are_refused(kwargs):
    with pytest.raises(ValueError, match="Allowance"):
        Allowance(**kwargs)
