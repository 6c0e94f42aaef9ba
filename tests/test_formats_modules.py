"""Each wire format's module (tierchain.formats), asked as the layers ask it.

One case per format of ``formats.TABLE``, each stream written as the real service writes it
(the fakes of tests/support.py and tests/wire_fakes.py, whose docstrings say where each shape
comes from: OpenAI's chat.completion.chunk stream, Anthropic's "Streaming Messages", OpenAI's
Responses streaming events, Ollama's docs/api.md "Chat request (streaming)"). For each: the
path it is recognised by, what the observer judges complete (with its terminator, a clean end
without it, an end after an error), the error it writes after the response began (byte for
byte), the usage it reads, and the seam of a broken answer.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tierchain import formats, wire
from tierchain.formats.base import WireFormat, has_finish_reason
from tierchain.observer import Observer
from tierchain.sse import data_values
from tierchain.usage import read_usage

from .support import openai_stream
from .wire_fakes import anthropic_stream, ollama_chat_lines, responses_stream

PIECES = ["Hel", "lo", " wor", "ld"]
SSE_HEADERS = [(b"content-type", b"text/event-stream")]
NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson")]
FORMATS_DIR = Path(formats.__file__).parent


@dataclass
class Case:
    name: str
    path: str  # a path that speaks it ("" for none)
    stream: list[bytes]  # a healthy stream, event by event (line by line)
    ndjson: bool
    ends: int  # how many of the stream's last events are its terminator
    without_end: bool  # complete at a clean end without them?
    upstream_error: bytes  # an error as the upstream itself writes it mid-stream
    error: bytes  # the error the gateway writes after commit ("boom", upstream_error)
    usage: tuple[int | None, int | None]
    broken_at: int  # the events the caller had when the stream broke
    text: str  # the seam's text at that break ("" with no continuation)
    ending: bytes  # the start of the seam's own end at the caller's limit


# The OpenAI error a chat stream carries: the openai SDK raises APIError for it
# (openai/_streaming.py); Anthropic's "error" event: docs.anthropic.com/en/api/messages-streaming
# ("Error events", overloaded_error); Responses' ResponseErrorEvent (type, code, message, param);
# Ollama's {"error": "..."} line (ollama/_client.py raises ResponseError).
OPENAI_ERROR = (
    b'data: {"error":{"message":"boom","type":"upstream_error","code":"stream_broken"}}\n\n'
)
CASES = [
    Case(
        "openai",
        "/v1/chat/completions",
        openai_stream(PIECES),
        False,
        2,  # the finish_reason chunk and data: [DONE]
        False,
        b'data: {"error": {"message": "upstream overloaded", "type": "server_error"}}\n\n',
        OPENAI_ERROR,
        (None, None),  # no stream_options.include_usage: no usage in the stream
        3,
        "Hello wor",
        b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
        b'"model":"m","choices":[{"index":0,"delta":{},"finish_reason":"length"}],'
        b'"tierchain":{"continued_from":"tower","after_chars":9,"written_by":["tower"]}}\n\n'
        b"data: [DONE]\n\n",
    ),
    Case(
        "anthropic",
        "/v1/messages",
        anthropic_stream(PIECES),
        False,
        3,  # content_block_stop, message_delta, message_stop
        False,
        b"event: error\n"
        b'data: {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}'
        b"\n\n",
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom"}}\n\n',
        (25, 4),  # message_start's input_tokens, message_delta's output_tokens
        5,
        "Hello",
        b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        b"event: message_delta\n"
        b'data: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
        b'"usage":{"output_tokens":2},'
        b'"tierchain":{"continued_from":"tower","after_chars":5,"written_by":["tower"]}}\n\n'
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
    ),
    Case(
        "responses",
        "/v1/responses",
        responses_stream(PIECES),
        False,
        1,  # response.completed
        False,
        b"event: error\n"
        b'data: {"type": "error", "code": "server_error", "message": "boom", "param": null, '
        b'"sequence_number": 9}\n\n',
        b'event: error\ndata: {"type":"error","code":"stream_broken","message":"boom",'
        b'"param":null,"error":{"type":"upstream_error","code":"stream_broken","message":"boom"}}'
        b"\n\n",
        (5, 4),  # response.completed's response.usage
        6,
        "Hello",
        b"event: response.output_text.done\n"
        b'data: {"type":"response.output_text.done","item_id":"msg_01","output_index":0,'
        b'"content_index":0,"text":"Hello","logprobs":[],"sequence_number":6}\n\n',
    ),
    Case(
        "ollama",
        "/api/chat",
        ollama_chat_lines(PIECES),
        True,
        1,  # the "done": true line
        False,
        b'{"error":"an error was encountered while running the model"}\n',
        b'{"error":"boom"}\n',
        (26, 282),  # the done line's prompt_eval_count and eval_count
        3,
        "Hello wor",
        b'{"model":"llama3.2","created_at":"2023-08-04T08:52:19.385406455-07:00",'
        b'"message":{"role":"assistant","content":""},"done_reason":"length","done":true,'
        b'"tierchain":{"continued_from":"tower","after_chars":9,"written_by":["tower"]}}\n',
    ),
    Case(
        "plain",
        "",
        openai_stream(PIECES),
        False,
        2,
        True,  # any clean end after data is complete
        b'data: {"error": {"message": "upstream overloaded", "type": "server_error"}}\n\n',
        OPENAI_ERROR,
        (None, None),
        3,
        "",  # no continuation: the gateway cannot tell an event's answer text
        b"",
    ),
]
BY_NAME = {case.name: case for case in CASES}


def observed(case: Case, chunks: list[bytes]) -> Observer:
    observer = Observer(wire=case.name)
    observer.start(200, NDJSON_HEADERS if case.ndjson else SSE_HEADERS)
    for chunk in chunks:
        assert observer.body(chunk) == chunk  # whole events (lines) pass as they came
    return observer


# -- the table --------------------------------------------------------------------------


def test_the_table_has_every_format_and_the_cases_cover_it():
    assert (
        list(formats.TABLE)
        == list(wire.FORMATS)
        == [c.name for c in CASES[:1]]
        + [
            "responses",
            "anthropic",
            "ollama",
            "plain",
        ]
    )
    assert {case.name for case in CASES} == set(formats.TABLE)
    assert all(isinstance(fmt, WireFormat) and fmt.name == n for n, fmt in formats.TABLE.items())


def test_each_format_module_holds_one_format_of_the_table():
    """Adding a format is one module and one line of the table: every module but the
    shared ones defines exactly one WireFormat subclass, and the table holds its object."""
    classes = {type(fmt).__name__: fmt for fmt in formats.TABLE.values()}
    seen = []
    for path in sorted(FORMATS_DIR.glob("*.py")):
        if path.name in ("__init__.py", "base.py", "seam.py"):
            continue
        tree = ast.parse(path.read_text())
        found = [
            node.name
            for node in tree.body
            if isinstance(node, ast.ClassDef)
            and any(isinstance(b, ast.Name) and b.id == "WireFormat" for b in node.bases)
        ]
        assert len(found) == 1, f"{path.name}: {found}"
        assert found[0] in classes, f"{path.name}: {found[0]} is not in formats.TABLE"
        seen.append(found[0])
    assert sorted(seen) == sorted(classes)


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/chat/completions", "openai"),
        ("/v1/completions/", "openai"),
        ("/v1/embeddings", "openai"),
        ("/v1/responses", "responses"),
        ("/v1/messages", "anthropic"),
        ("/api/chat", "ollama"),
        ("/api/generate", "ollama"),
        ("/api/embed", "ollama"),
        ("/api/embeddings", "ollama"),
        ("/anything/else", "openai"),
    ],
)
def test_a_path_is_recognised_as_its_format(path, name):
    assert formats.recognise(path.encode()).name == name
    assert wire.recognise(path) == name


def test_the_gateways_own_errors_on_an_ollama_prefix_take_ollamas_shape():
    assert formats.error_owner(b"/api/tags") is formats.TABLE["ollama"]
    assert formats.error_owner(b"/v1/models") is None
    assert wire.error_format("/api/tags") == "ollama"
    assert wire.error_format("/v1/messages") == "anthropic"


def test_an_unnamed_or_unknown_format_is_openai_chat():
    assert formats.of(None) is formats.of("nonesuch") is formats.TABLE["openai"]


# -- per format -------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_format_is_recognised_from_its_path_or_only_when_named(case):
    if case.path:
        assert formats.recognise(case.path.encode()).name == case.name
    else:
        assert all(formats.recognise(p).name != case.name for p in (b"/", b"/events", b"/v1/x"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_healthy_stream_with_its_terminator_is_complete(case):
    observer = observed(case, case.stream)
    # Whole before the transport ends (a glitch after it is no failure), when it has an end.
    assert observer.reached_end() is not case.without_end
    observer.end()
    assert (observer.complete, observer.verdict()) == (True, "ok")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_clean_end_without_the_terminator_is_truncated_unless_the_format_has_none(case):
    observer = observed(case, case.stream[: -case.ends])
    assert not observer.reached_end() or case.without_end
    observer.end()
    assert observer.complete is case.without_end
    assert observer.verdict() == ("ok" if case.without_end else "truncated")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_stream_the_upstream_ended_with_its_own_error_is_not_whole(case):
    observer = observed(case, [*case.stream[:2], case.upstream_error])
    observer.end()
    assert observer.complete is case.without_end  # plain cannot tell an error event


def test_an_openai_stream_with_a_finish_reason_and_no_done_is_whole():
    case = BY_NAME["openai"]
    observer = observed(case, case.stream[:-1])  # (llama.cpp's old servers sent no [DONE])
    observer.end()
    assert observer.complete


def test_finish_reason_counts_only_with_a_string_value():
    assert has_finish_reason(b'data: {"choices":[{"finish_reason": "stop"}]}\n\n')
    assert has_finish_reason(b'data: {"choices":[{"finish_reason":"length"}]}\n\n')
    assert not has_finish_reason(b'data: {"choices":[{"finish_reason":null}]}\n\n')
    assert not has_finish_reason(b'data: {"choices":[{"delta":{"content":"finish_reason"}}]}\n\n')


def test_an_anthropic_ping_after_message_stop_does_not_unmake_the_end():
    case = BY_NAME["anthropic"]
    ping = b'event: ping\ndata: {"type": "ping"}\n\n'
    observer = observed(case, [*case.stream, ping])
    observer.end()
    assert observer.complete


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_error_written_after_commit_is_the_formats_own_byte_for_byte(case):
    fmt = formats.TABLE[case.name]
    framing = formats.NDJSON if case.ndjson else formats.SSE
    assert fmt.error_bytes(framing, "boom", "upstream_error", "stream_broken") == case.error
    observer = observed(case, case.stream[:2])
    assert observer.error_bytes("boom", "upstream_error", "stream_broken") == case.error
    masked = fmt.error_bytes(framing, "at http://user:secret@host/x", "upstream_error")
    assert b"secret" not in masked


def test_a_saturation_reads_as_anthropics_overloaded_error():
    event = formats.TABLE["anthropic"].error_bytes(formats.SSE, "busy", "backend_saturated")
    assert json.loads(data_values(event)[0])["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_usage_is_read_where_the_format_reports_it(case):
    whole = b"".join(case.stream)
    values = whole.splitlines() if case.ndjson else data_values(whole)
    assert read_usage(case.name, values) == case.usage


def test_openai_usage_is_read_from_the_usage_chunk_a_request_asked_for():
    chunk = {
        "id": "chatcmpl-1",
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 12},
    }
    assert formats.TABLE["openai"].usage(chunk) == (9, 12)
    assert formats.TABLE["openai"].usage({"usage": {"prompt_tokens": 7}}) == (7, 0)  # embeddings


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_broken_answer_has_its_formats_seam_and_ending(case):
    fmt = formats.TABLE[case.name]
    sent = b"".join(case.stream[: case.broken_at])
    seam = fmt.seam("tower", sent, ndjson=case.ndjson)
    assert seam.ok is bool(case.text), seam.why
    if not seam.ok:
        assert seam.why == "format"
        return
    assert seam.text == case.text
    assert seam.ending().startswith(case.ending)
    assert b'"written_by":["tower"]' in seam.ending()
    # The other framing has no continuation in this format.
    assert not fmt.seam("tower", sent, ndjson=not case.ndjson).ok


@pytest.mark.parametrize(
    ("name", "comments", "prefill", "path"),
    [
        ("openai", True, "ask", b"/v1/chat/completions"),
        ("anthropic", True, "native", b"/v1/messages"),
        ("responses", True, "never", b"/v1/responses"),
        ("ollama", False, "native", b"/api/generate"),
        ("plain", True, "never", b"/v1/chat/completions"),
    ],
)
def test_comments_prefill_and_the_check_request_are_the_formats_own(name, comments, prefill, path):
    fmt = formats.TABLE[name]
    assert (fmt.comments, fmt.prefill) == (comments, prefill)
    got, body, _ = fmt.check_request("m", "Hi")
    assert got == path
    assert (body["model"], body["stream"]) == ("m", True)
