"""A continued answer reads as one answer, asks for what is left, and says who wrote it
(issue 42), in every wire format.

Over real sockets, as tests/test_continuation.py: the README's stack on uvicorn, fake
upstreams speaking each format byte for byte (tests/support.py, tests/wire_fakes.py), a
virtual clock. The tower writes the first words of a story and dies; the hosted fake
does what a real model did on llama.cpp's server: it restarts the sentence (a
paraphrase, not the caller's bytes), or starts afresh after a word cut at the break, or
has nothing new to add; or the caller's ``max_tokens`` leaves it little or nothing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest

from .support import Exchange, Script, on_virtual_time
from .test_continuation import FORMATS, HEADERS, PATHS, gateway, stream_of

STORY = (
    "In the year 1850, there was a lighthouse keeper named Jameson who lived on a rocky "
    "island in the Caribbean. Every night he climbed the stairs to light the lamp before "
    "the storm came. The ships passed safely, and nobody ever knew his name."
)
WORDS = [w if i == 0 else " " + w for i, w in enumerate(STORY.split(" "))]
CUT = WORDS.index(" Caribbean.")  # the tower dies after "...rocky island in the"
RESTART = STORY[: STORY.index(" Every")]  # the first sentence again, whole
NO_PREFILL = ("chat", "responses")  # asked in words: a fresh message (the format's default)


def tower(fmt: str, pieces: list[str], *, finish: bool = False) -> Script:
    """``pieces`` of the story, then a reset (before the stream's own end)."""
    events, opening = stream_of(fmt, pieces, tier="tower")

    async def script(ex: Exchange) -> None:
        if ex.request.method == "GET":  # asked what server it is: not one that says
            await ex.respond(404, b"{}")
            return
        await ex.head(200, HEADERS.get(fmt))
        for event in events[: opening + len(pieces)]:
            await ex.write(event)
        await asyncio.sleep(0.1)
        await ex.reset()

    return script


def hosted(fmt: str, pieces: list[str], seen: list[dict[str, Any]]) -> Script:
    """Writes ``pieces`` whatever it is asked (its request kept in ``seen``)."""

    async def script(ex: Exchange) -> None:
        if ex.request.method == "GET":
            await ex.respond(404, b"{}")
            return
        seen.append(json.loads(ex.request.body))
        events, _ = stream_of(fmt, pieces, tier="hosted")
        await ex.head(200, HEADERS.get(fmt))
        for event in events:
            await ex.write(event)
        await ex.end()

    return script


async def ask(fmt: str, url: str, **extra: Any) -> bytes:
    body: dict[str, Any] = {"model": "echo", "stream": True, **extra}
    if fmt == "responses":
        body["input"] = "tell me a story"
    else:
        body["messages"] = [{"role": "user", "content": "tell me a story"}]
    if fmt == "anthropic":
        body.setdefault("max_tokens", 256)
    async with httpx.AsyncClient(timeout=30) as client:
        got = await client.post(url + PATHS[fmt], json=body)
    assert got.status_code == 200
    return got.content


def objects(fmt: str, content: bytes) -> list[dict[str, Any]]:
    lines = content.splitlines()
    if fmt == "ollama":
        return [json.loads(line) for line in lines if line.strip()]
    return [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]


def text_of(fmt: str, content: bytes) -> str:
    text = []
    for obj in objects(fmt, content):
        if fmt == "chat":
            for choice in obj.get("choices") or ():
                text.append(choice["delta"].get("content") or "")
        elif fmt == "anthropic" and obj["type"] == "content_block_delta":
            text.append(obj["delta"]["text"])
        elif fmt == "responses" and obj["type"] == "response.output_text.delta":
            text.append(obj["delta"])
        elif fmt == "ollama":
            text.append(obj["message"]["content"])
    return "".join(text)


def last_mark(fmt: str, content: bytes) -> Any:
    """The ``tierchain`` field of the event that ends the answer in ``fmt``."""
    found = objects(fmt, content)
    if fmt == "chat":
        (last,) = [o for o in found if o["choices"] and o["choices"][0]["finish_reason"]]
    elif fmt == "anthropic":
        (last,) = [o for o in found if o["type"] == "message_delta"]
    elif fmt == "responses":
        last = found[-1]
        assert last["type"] in ("response.completed", "response.incomplete")
    else:
        last = found[-1]
        assert last["done"] is True
    return last["tierchain"]


# -- 2: the seam survives a paraphrase ------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@on_virtual_time
async def test_a_next_tier_that_restarts_the_sentence_in_its_own_words_is_cut_at_the_break(fmt):
    # The restart is not the caller's bytes: its first sentence again, then the rest.
    rest = STORY[len(RESTART) :]
    pieces = [RESTART[i : i + 9] for i in range(0, len(RESTART), 9)] + [rest]
    seen: list[dict[str, Any]] = []
    async with gateway(tower(fmt, WORDS[:CUT]), hosted(fmt, pieces, seen)) as (url, _, _h):
        content = await ask(fmt, url)
    assert text_of(fmt, content) == STORY  # no sentence twice, no glued word
    # Byte for byte, the events at the seam: the restart's piece that holds the break, cut
    # to what goes on from the caller's text, then the next as it came, in the envelope.
    assert SEAM_EVENTS[fmt] in content


SEAM_EVENTS = {
    "chat": (
        b'data: {"id":"chatcmpl-tower","object":"chat.completion.chunk",'
        b'"created":1700000000,"model":"tower-model","system_fingerprint":null,'
        b'"choices":[{"index":0,"delta":{"content":" Ca"},"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
        b'data: {"id":"chatcmpl-tower","object":"chat.completion.chunk",'
        b'"created":1700000000,"model":"tower-model","system_fingerprint":null,'
        b'"choices":[{"index":0,"delta":{"content":"ribbean."},"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
    ),
    "anthropic": (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":" Ca"}}\n\n'
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"ribbean."}}\n\n'
    ),
    "responses": (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"item_id":"msg_01","output_index":0,"content_index":0,"delta":" Ca","logprobs":[],'
        b'"sequence_number":23}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"item_id":"msg_01","output_index":0,"content_index":0,"delta":"ribbean.",'
        b'"logprobs":[],"sequence_number":24}\n\n'
    ),
    "ollama": (
        b'{"model":"tower-model","created_at":"2023-08-04T08:52:19.385406455-07:00",'
        b'"message":{"role":"assistant","content":" Ca"},"done":false}\n'
        b'{"model":"tower-model","created_at":"2023-08-04T08:52:19.385406455-07:00",'
        b'"message":{"role":"assistant","content":"ribbean."},"done":false}\n'
    ),
}


@pytest.mark.parametrize("fmt", NO_PREFILL)
@pytest.mark.parametrize(
    ("upto", "fresh", "expected"),
    [
        # The break at a word's end: the fresh message's first word gets its space.
        (CUT, "Caribbean. Every", " Caribbean. Every"),
        # The break inside a word: the fresh message writes it whole; it is completed.
        (CUT + 1, "Caribbean. Every", " Caribbean. Every"),
    ],
    ids=["at-a-word", "inside-a-word"],
)
@on_virtual_time
async def test_a_word_cut_at_the_break_is_completed_not_glued(fmt, upto, fresh, expected):
    pieces = WORDS[:upto]
    if upto > CUT:
        pieces[-1] = " Carib"  # the tower died inside the word
    seen: list[dict[str, Any]] = []
    async with gateway(tower(fmt, pieces), hosted(fmt, [fresh], seen)) as (url, _, _h):
        content = await ask(fmt, url)
    assert text_of(fmt, content) == "".join(WORDS[:CUT]) + expected


@pytest.mark.parametrize("fmt", FORMATS)
@on_virtual_time
async def test_a_continuation_that_adds_nothing_new_ends_the_stream_as_it_would_have(fmt):
    # The tower wrote the whole story and died before its end; hosted only restarts the
    # last sentence: nothing of it reaches the caller, and its own end ends the stream.
    last = STORY[STORY.index("The ships") :]
    seen: list[dict[str, Any]] = []
    async with gateway(tower(fmt, WORDS), hosted(fmt, [last], seen)) as (url, _, _h):
        content = await ask(fmt, url)
    assert text_of(fmt, content) == STORY
    if fmt == "chat":
        assert content.endswith(b"data: [DONE]\n\n")
        (finish,) = [o for o in objects(fmt, content) if o["choices"][0]["finish_reason"]]
        assert finish["choices"][0]["finish_reason"] == "stop"
    elif fmt == "anthropic":
        assert content.count(b"event: message_stop") == 1
    elif fmt == "responses":
        done = [o for o in objects(fmt, content) if o["type"] == "response.output_text.done"]
        assert [d["text"] for d in done] == [STORY]
    else:
        assert objects(fmt, content)[-1]["done"] is True


# -- 4: a continuation asks for what is left ------------------------------------------------

LIMITS = {
    "chat": {"max_tokens": 20},
    "anthropic": {"max_tokens": 20},
    "responses": {"max_output_tokens": 20},
    "ollama": {"options": {"num_predict": 20}},
}


def limit_in(fmt: str, body: dict[str, Any]) -> int:
    if fmt == "ollama":
        return int(body["options"]["num_predict"])
    return int(body["max_output_tokens" if fmt == "responses" else "max_tokens"])


@pytest.mark.parametrize("fmt", FORMATS)
@on_virtual_time
async def test_a_continuation_asks_for_what_the_callers_limit_leaves(fmt):
    seen: list[dict[str, Any]] = []
    rest = [" w"] * 30  # a model that writes until its limit: one token an event

    def obeys(fmt: str) -> Script:
        async def script(ex: Exchange) -> None:
            limit = limit_in(fmt, json.loads(ex.request.body))
            await hosted(fmt, rest[:limit], seen)(ex)

        return script

    async with gateway(tower(fmt, WORDS[:10]), obeys(fmt)) as (url, _, _h):
        content = await ask(fmt, url, **LIMITS[fmt])
    # Ten events of a token each (none longer than a token is): 10 left.
    assert limit_in(fmt, seen[0]) == 10
    assert text_of(fmt, content) == "".join(WORDS[:10]) + " w" * 10


@on_virtual_time
async def test_max_completion_tokens_is_asked_for_what_is_left_too():
    seen: list[dict[str, Any]] = []
    async with gateway(tower("chat", WORDS[:2]), hosted("chat", [" x"], seen)) as (url, _, _h):
        await ask("chat", url, max_completion_tokens=40, max_tokens=50)
    # Two events, a token each.
    assert (seen[0]["max_completion_tokens"], seen[0]["max_tokens"]) == (38, 48)


@on_virtual_time
async def test_an_event_longer_than_a_token_counts_at_four_characters_a_token():
    # As Anthropic's API streams: several tokens an event.
    pieces = ["In the year 1850, there was", " a lighthouse keeper"]  # 27 and 20 characters
    seen: list[dict[str, Any]] = []
    async with gateway(tower("anthropic", pieces), hosted("anthropic", [" x"], seen)) as (
        url,
        _,
        _h,
    ):
        await ask("anthropic", url, max_tokens=40)
    assert seen[0]["max_tokens"] == 40 - 7 - 5


ENDINGS = {
    "chat": (
        b'data: {"id":"chatcmpl-tower","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"tower-model","system_fingerprint":null,"choices":[{"index":0,"delta":{},'
        b'"finish_reason":"length"}],"tierchain":{"continued_from":"tower","after_chars":%d,'
        b'"written_by":["tower"]}}\n\ndata: [DONE]\n\n'
    ),
    "anthropic": (
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        b'"max_tokens","stop_sequence":null},"usage":{"output_tokens":20},"tierchain":'
        b'{"continued_from":"tower","after_chars":%d,"written_by":["tower"]}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    ),
    "ollama": (
        b'{"model":"tower-model","created_at":"2023-08-04T08:52:19.385406455-07:00",'
        b'"message":{"role":"assistant","content":""},"done_reason":"length","done":true,'
        b'"tierchain":{"continued_from":"tower","after_chars":%d,"written_by":["tower"]}}\n'
    ),
}


@pytest.mark.parametrize("fmt", FORMATS)
@on_virtual_time
async def test_a_break_at_the_callers_limit_ends_the_answer_in_its_format_without_asking(
    fmt, metric
):
    labels = {"route": "echo", "from": "tower", "to": "hosted", "outcome": "length"}
    before = metric("tierchain_continuations_total", **labels)
    pieces = [" w"] * 20
    seen: list[dict[str, Any]] = []
    async with gateway(tower(fmt, pieces), hosted(fmt, [" more"], seen)) as (url, _, _h):
        content = await ask(fmt, url, **LIMITS[fmt])
    assert seen == []  # nothing to ask for
    assert metric("tierchain_continuations_total", **labels) - before == 1
    assert text_of(fmt, content) == " w" * 20
    assert b"failed mid-stream" not in content
    if fmt in ENDINGS:
        assert content.endswith(ENDINGS[fmt] % 40)
        return
    found = objects(fmt, content)
    assert [o["type"] for o in found[-4:]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [o["sequence_number"] for o in found] == list(range(len(found)))
    last = found[-1]["response"]
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["output"][0]["content"][0]["text"] == " w" * 20
    assert found[-1]["tierchain"]["written_by"] == ["tower"]


# -- 5: who wrote the answer ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@on_virtual_time
async def test_a_continued_answers_last_event_says_which_tiers_wrote_it(fmt):
    seen: list[dict[str, Any]] = []
    rest = STORY[len("".join(WORDS[:CUT])) :]
    async with gateway(tower(fmt, WORDS[:CUT]), hosted(fmt, [rest], seen)) as (url, _, _h):
        content = await ask(fmt, url)
    assert last_mark(fmt, content) == {
        "continued_from": "tower",
        "after_chars": len("".join(WORDS[:CUT])),
        "written_by": ["tower", "hosted"],
    }
    mark = (
        b'"tierchain":{"continued_from":"tower","after_chars":96,"written_by":["tower","hosted"]}'
    )
    assert content.count(mark) == 1  # in the one event that ends the answer


@on_virtual_time
async def test_the_openai_sdk_reads_the_mark_as_an_extra_field_without_error():
    seen: list[dict[str, Any]] = []
    rest = STORY[len("".join(WORDS[:CUT])) :]
    async with gateway(tower("chat", WORDS[:CUT]), hosted("chat", [rest], seen)) as (url, _, _h):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "tell me a story"}],
                stream=True,
            )
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == STORY
    marks = [c.model_extra.get("tierchain") for c in chunks if c.model_extra]
    assert marks[-1]["written_by"] == ["tower", "hosted"]
