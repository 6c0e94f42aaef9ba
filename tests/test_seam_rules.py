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
