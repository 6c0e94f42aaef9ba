"""The seam's own rules, called directly with exact text (docs/continuation.md): the next
tier's request goes on from the caller's own prefill or adds the partial answer; a prefill
leaves out the caller's trailing whitespace, and what of it the next tier writes again is cut
(the whole of it, or the part it repeats before going its own way), also when the next
tier ends right there.

The end-to-end cases, over real sockets in every wire format, are
tests/test_continuation_seam.py; here the OpenAI chat seam stands for all (the rules are the
base class's).
"""

from __future__ import annotations

import json
from typing import Any

from tierchain.formats.openai_chat import ChatSeam
from tierchain.formats.seam import INSTRUCTION, tokens

from .support import openai_stream

ASKED = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "go"}]}


def events(pieces: list[str]) -> bytes:
    """The content events of an OpenAI chat stream (no finish, no [DONE])."""
    return b"".join(openai_stream(pieces)[: len(pieces)])


def continued(
    had: list[str], then: list[str], *, body: dict[str, Any] = ASKED, prefill: bool = True
) -> tuple[list[dict[str, Any]], list[str]]:
    """(the next tier's messages, the text of each event the caller then gets)."""
    seam = ChatSeam("tower", events(had))
    asked = seam.request(json.dumps(body).encode(), prefill=prefill)
    assert asked is not None
    out = seam.splice(events(then)) + seam.finish()
    texts = [
        json.loads(line[6:])["choices"][0]["delta"].get("content")
        for line in out.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    return json.loads(asked)["messages"], texts


def test_a_prefill_goes_on_from_the_callers_own_assistant_message():
    body = {**ASKED, "messages": [*ASKED["messages"], {"role": "assistant", "content": "Once"}]}
    messages, texts = continued([" upon", " a"], [" time"], body=body)
    assert messages == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Once upon a"},
    ]
    assert texts == [" time"]


def test_without_a_prefill_the_partial_answer_is_its_own_message_and_the_ask_follows():
    body = {**ASKED, "messages": [*ASKED["messages"], {"role": "assistant", "content": "Once"}]}
    messages, _ = continued([" upon", " a"], [" time"], body=body, prefill=False)
    assert messages[:3] == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Once"},
        {"role": "assistant", "content": " upon a"},
    ]
    assert messages[3]["role"] == "user"


def test_a_caller_message_that_is_not_plain_text_is_not_prefilled_into():
    parts = [{"type": "text", "text": "Once"}]
    body = {**ASKED, "messages": [*ASKED["messages"], {"role": "assistant", "content": parts}]}
    messages, _ = continued([" upon"], [" a"], body=body)
    assert messages[-2:] == [
        {"role": "assistant", "content": parts},
        {"role": "assistant", "content": " upon"},
    ]
    body = {**ASKED, "messages": [*ASKED["messages"], {"role": "user", "content": "Once"}]}
    messages, _ = continued([" upon"], [" a"], body=body)
    assert messages[-1] == {"role": "assistant", "content": " upon"}
    messages, _ = continued([" upon"], [" a"], body={**ASKED, "messages": []})
    assert messages == [{"role": "assistant", "content": " upon"}]


def test_the_trailing_whitespace_a_prefill_left_out_is_cut_when_written_again():
    messages, texts = continued(["Hi", " there.", "\n\n"], ["\n\nNew", " day"])
    assert messages[-1] == {"role": "assistant", "content": "Hi there."}
    assert texts == ["New", " day"]


def test_the_part_of_that_whitespace_written_again_is_cut_where_the_next_tier_turns():
    assert continued(["Hi", " there.", "\n\n"], ["\nNew", " day"])[1] == ["New", " day"]
    assert continued(["Hi", " there.", "\n\n\n"], ["\n\nNew", " day"])[1] == ["New", " day"]
    assert continued(["Hi", " there.", "\n\n"], ["New", " day"])[1] == ["New", " day"]


def test_a_next_tier_that_ends_inside_that_whitespace_adds_nothing():
    assert continued(["Hi", " there.", "\n\n"], ["\n"])[1] == []


def test_the_callers_own_prefill_after_earlier_turns_keeps_every_turn():
    system = {"role": "system", "content": "be brief"}
    body = {
        **ASKED,
        "messages": [system, *ASKED["messages"], {"role": "assistant", "content": "A"}],
    }
    messages, _ = continued([" b"], [" c"], body=body)
    assert messages == [system, ASKED["messages"][0], {"role": "assistant", "content": "A b"}]


def test_without_a_prefill_the_ask_to_go_on_is_a_user_message_of_its_own():
    messages, _ = continued([" upon", " a"], [" time"], prefill=False)
    assert messages[1:] == [
        {"role": "assistant", "content": " upon a"},
        {"role": "user", "content": INSTRUCTION},
    ]


def test_a_next_tier_ending_inside_an_echo_of_the_partial_answer_sends_it_before_its_end():
    # " upon" could still be the start of an echo of " upon a": held until the finish event
    # comes, then sent before it
    seam = ChatSeam("tower", events([" upon", " a"]))
    assert seam.request(json.dumps(ASKED).encode(), prefill=True) is not None
    finish = openai_stream([" upon"])[1]
    out = seam.splice(events([" upon"]) + finish) + seam.finish()
    choices = [json.loads(e[6:])["choices"][0] for e in out.split(b"\n\n") if e[:7] == b"data: {"]
    assert [(c["delta"].get("content"), c["finish_reason"]) for c in choices] == [
        (" upon", None),
        (None, "stop"),
    ]


def test_what_follows_an_echo_of_the_prefill_is_sent_on_at_once():
    # the word rules wait for three words; the rest of an exact echo is not theirs to hold
    seam = ChatSeam("tower", events(["The cat sat.", " The dog"]))
    assert seam.request(json.dumps(ASKED).encode(), prefill=True) is not None
    first = seam.splice(events(["The cat sat. The dog ran"]))
    assert [
        json.loads(e[6:])["choices"][0]["delta"]["content"] for e in first.split(b"\n\n") if e
    ] == [" ran"]
    assert seam.spliced


def test_a_continuation_request_built_has_spliced_nothing_yet():
    seam = ChatSeam("tower", events([" upon"]))
    assert seam.request(json.dumps(ASKED).encode(), prefill=True) is not None
    assert seam.spliced is False


def test_an_anthropic_event_through_the_seam_keeps_its_name():
    from tierchain.formats.anthropic import MessagesSeam

    def sse(name: str, data: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"

    def delta(text: str) -> bytes:
        return sse(
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": text},
            },
        )

    start = {"type": "message_start", "message": {"id": "m1", "role": "assistant", "content": []}}
    block = {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    had = sse("message_start", start) + sse("content_block_start", block) + delta("Once upon a")
    seam = MessagesSeam("tower", had)
    body = {"model": "m", "stream": True, "max_tokens": 50, "messages": ASKED["messages"]}
    assert seam.request(json.dumps(body).encode(), prefill=True) is not None
    stop = {"type": "content_block_stop", "index": 0}
    out = seam.splice(
        sse("message_start", start)
        + sse("content_block_start", block)
        + delta("Once")
        + sse("content_block_stop", stop)
    )
    names = [e.split(b"\n")[0] for e in out.split(b"\n\n") if e]
    assert names == [b"event: content_block_delta", b"event: content_block_stop"]


def test_the_tokens_the_caller_has_count_an_event_of_up_to_12_characters_as_one():
    assert tokens(["a" * 12]) == 1
    assert tokens(["a" * 13]) == 4  # several tokens an event: at 4 characters a token
    assert tokens(["", "a"]) == 1


def test_a_token_limit_of_zero_is_no_limit_and_of_one_leaves_nothing_after_a_token():
    seam = ChatSeam("tower", events([" upon"]))
    assert seam.request(json.dumps({**ASKED, "max_tokens": 0}).encode(), prefill=True)
    assert seam.left is None
    seam = ChatSeam("tower", events([" upon"]))
    assert seam.request(json.dumps({**ASKED, "max_tokens": 1}).encode(), prefill=True)
    assert seam.left == 0


def test_a_prefilled_request_gains_the_fields_the_backend_asks_for_it():
    seam = ChatSeam("tower", events([" upon"]))
    adds = {"continue_final_message": True, "add_generation_prompt": False}
    asked = seam.request(json.dumps(ASKED).encode(), prefill=True, adds=adds)
    assert asked is not None
    assert {k: json.loads(asked)[k] for k in adds} == adds
    asked = seam.request(json.dumps(ASKED).encode(), prefill=False, adds=adds)
    assert asked is not None
    assert not adds.keys() & json.loads(asked).keys()


def test_a_continuation_asks_for_what_the_tightest_of_the_callers_limits_leaves():
    seam = ChatSeam("tower", events([" upon", " a"]))  # two tokens
    body = {**ASKED, "max_tokens": 20, "max_completion_tokens": 50}
    asked = seam.request(json.dumps(body).encode(), prefill=True)
    assert asked is not None
    assert seam.left == 18
    assert (json.loads(asked)["max_tokens"], json.loads(asked)["max_completion_tokens"]) == (18, 48)


def test_a_limit_that_leaves_one_token_asks_for_one():
    seam = ChatSeam("tower", events([" upon"]))
    asked = seam.request(json.dumps({**ASKED, "max_tokens": 2}).encode(), prefill=True)
    assert asked is not None
    assert (seam.left, json.loads(asked)["max_tokens"]) == (1, 1)


def test_an_echo_of_the_partial_answer_split_across_events_is_cut_whole():
    # "H" could still begin an echo of "Hi": held, then cut with the rest of the echo (the
    # word rules, which wait for three words, would let all of it through)
    assert continued(["Hi"], ["H", "i there"])[1] == [" there"]


def test_without_a_prefill_nothing_of_the_next_tiers_text_is_cut_as_left_out_whitespace():
    # (a fresh start after the caller's text gets its space: the word rules)
    assert continued(["Treasure map:"], ["X marks", " the spot."], prefill=False)[1] == [
        " X marks",
        " the spot.",
    ]
