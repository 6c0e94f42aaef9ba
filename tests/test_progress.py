"""The watchdog's status conversation on its own: before sending (is there room?) and after a
window ended (is it still working?), judged on an asker of the test's own making, so that each
rule of docs/watchdog.md is seen apart from the watchdog's timer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import httpx
import pytest

from tierchain import Backend
from tierchain.errors import BackendBusy
from tierchain.probes import Status, auto_reader
from tierchain.progress import Progress, check_room
from tierchain.status import Fullness

URL = "http://127.0.0.1:1/slots"
TOWER = Backend(name="tower", url="http://127.0.0.1:1", status_url=URL)


@dataclass
class Board:
    """What check_room reads of a status board: a status already polled, and the limits."""

    status: Status | None
    limits: Fullness = field(default_factory=Fullness)
    cut: bool = False

    def peek(self, url, reader):
        return self.status

    def finishing_cut(self, url):
        return self.cut


@dataclass
class Normal:
    """A learned normal time to first data (seconds), or none yet."""

    seconds: float | None

    def normal(self, backend, body):
        return self.seconds


@dataclass
class Asker:
    board: Board | None = None
    ask_first: float = 0.0
    status_late: float = 0.25
    probe_timeout: float = 4.0
    progress_span: float = 30.0
    normal_multiple: float = 4.0
    ceiling: float = 1800.0
    prompt_rate: None = None
    learned: Normal | None = None
    steps: dict[str, float] = field(default_factory=dict)

    @property
    def client(self) -> httpx.AsyncClient:
        raise AssertionError("no GET in these tests")

    def reader_for(self, backend):
        return auto_reader


# -- before sending ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "why"),
    [
        (Status(busy=True, waiting=5), "5 waiting"),
        (Status(busy=True, kv_cache=0.9), "kv_cache 0.90"),
        (Status(busy=True, slots=2, slots_busy=2), "all slots busy"),
    ],
    ids=["waiting", "kv cache", "every slot"],
)
def test_a_polled_status_past_a_fullness_threshold_is_busy_before_sending(status, why):
    with pytest.raises(BackendBusy) as raised:
        check_room(Asker(board=Board(status)), "tower", URL)
    assert raised.value.why == why


def test_a_full_status_while_a_cut_request_finishes_its_batch_says_so():
    board = Board(Status(busy=True, waiting=5), cut=True)
    with pytest.raises(BackendBusy) as raised:
        check_room(Asker(board=board), "tower", URL)
    assert raised.value.why == "5 waiting, finishing a prompt batch of a request we cut"


def test_a_status_with_room_sends_at_once():
    assert check_room(Asker(board=Board(Status(busy=True, waiting=1))), "tower", URL) is None


def test_a_status_never_read_sends_at_once_unless_asked_first():
    assert check_room(Asker(board=Board(None), ask_first=0.0), "tower", URL) is None
    asked = check_room(Asker(board=Board(None), ask_first=0.1), "tower", URL)
    assert asked is not None  # the awaitable that asks the status first
    asked.close()  # type: ignore[attr-defined]


# -- after a window: the verdict -----------------------------------------------------


def _progress(asker: Asker, body: bytes | None = None) -> Progress:
    return Progress(asker, TOWER, "echo", body, start=100.0)


def test_no_answer_from_the_status_is_unknown_and_moves_nothing():
    progress = _progress(Asker())
    assert progress.verdict(None, 110.0, math.inf, 130.0, streaming=True, prompt_due=False) == (
        "unknown",
        130.0,
    )


def test_an_idle_backend_with_our_request_in_it_is_idle():
    verdict, _ = _progress(Asker()).verdict(
        Status(busy=False), 110.0, math.inf, math.inf, streaming=True, prompt_due=False
    )
    assert verdict == "idle"


def test_a_queue_at_the_backend_is_queued_for_a_streaming_request():
    verdict, _ = _progress(Asker()).verdict(
        Status(busy=True, waiting=2), 110.0, math.inf, math.inf, streaming=True, prompt_due=False
    )
    assert verdict == "queued"


def test_progress_that_does_not_move_is_working_within_the_span_and_no_progress_after():
    progress = _progress(Asker(progress_span=30.0))
    progress.working(Status(busy=True, progress=7))
    same = Status(busy=True, progress=7)
    within, _ = progress.verdict(same, 129.9, math.inf, math.inf, streaming=False, prompt_due=False)
    past, _ = progress.verdict(same, 130.0, math.inf, math.inf, streaming=False, prompt_due=False)
    assert (within, past) == ("working", "no_progress")


def test_working_past_the_normal_multiple_of_the_learned_normal_is_too_slow():
    progress = _progress(Asker(learned=Normal(2.0), normal_multiple=4.0))
    moving = Status(busy=True, progress=1)
    at, _ = progress.verdict(moving, 108.0, math.inf, math.inf, streaming=False, prompt_due=False)
    past, _ = progress.verdict(
        moving, 108.01, math.inf, math.inf, streaming=False, prompt_due=False
    )
    assert (at, past) == ("working", "too_slow")


def test_a_slot_still_reading_a_prompt_past_its_expected_prefill_is_too_slow():
    reading = Status(busy=True, progress=3, prefilling=1)
    progress = _progress(Asker())
    before, _ = progress.verdict(reading, 110.0, math.inf, 120.0, streaming=False, prompt_due=False)
    due, _ = progress.verdict(reading, 121.0, math.inf, 120.0, streaming=False, prompt_due=True)
    assert (before, due) == ("working", "too_slow")


def test_a_prompt_read_too_slowly_to_finish_before_the_end_is_too_slow():
    # About 4,000 prompt tokens (16,000 bytes); 100 tokens read in 10 s: 10 tokens a second
    # leaves 3,900 tokens, 390 s, against 50 s left before the attempt must end.
    body = b"x" * 16_000
    progress = _progress(Asker(), body)
    first = Status(busy=True, progress=1, prompt_done=100)
    second = Status(busy=True, progress=2, prompt_done=200)
    v1, _ = progress.verdict(first, 110.0, 170.0, math.inf, streaming=False, prompt_due=False)
    progress.working(first)
    v2, _ = progress.verdict(second, 120.0, 170.0, math.inf, streaming=False, prompt_due=False)
    assert (v1, v2) == ("working", "too_slow")


def test_a_prompt_read_fast_enough_to_finish_before_the_end_is_working():
    body = b"x" * 16_000
    progress = _progress(Asker(), body)
    first = Status(busy=True, progress=1, prompt_done=100)
    second = Status(busy=True, progress=2, prompt_done=2100)  # 200 tokens a second
    progress.verdict(first, 110.0, 170.0, math.inf, streaming=False, prompt_due=False)
    progress.working(first)
    verdict, _ = progress.verdict(second, 120.0, 170.0, math.inf, streaming=False, prompt_due=False)
    assert verdict == "working"
