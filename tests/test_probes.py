"""The status readers against the real formats, and the verdicts they lead to."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tierchain.probes import (
    Status,
    auto_reader,
    fetch_status,
    gate_status,
    judge,
    llamacpp_metrics,
    llamacpp_slots,
    parse_prometheus,
    vllm_metrics,
)

from .support import FakeBackend

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


VLLM = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.4375
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 90712.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 1234.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-8B"} 3.0
"""

LLAMACPP_METRICS = b"""\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 16185
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 394
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 125
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 0
"""


def slot(id: int, processing: bool, n_decoded: int = 0) -> dict:
    return {
        "id": id,
        "id_task": 7 if processing else -1,
        "n_ctx": 65536,
        "speculative": False,
        "is_processing": processing,
        "params": {"n_predict": -1, "temperature": 0.8},
        "next_token": {
            "has_next_token": True,
            "has_new_line": False,
            "n_remain": -1,
            "n_decoded": n_decoded,
            "stopping_word": "",
        },
    }


def test_the_gate_shape_with_a_generation_for_another_model_is_busy():
    body = json.dumps(
        {
            "active_generation_count": 1,
            "active_generations": [
                {
                    "id": "g-1",
                    "model": "some-other-model",
                    "path": "/v1/chat/completions",
                    "client_host": "10.0.0.7",
                    "started_at": "2026-08-12T18:00:00Z",
                    "age_s": 41.5,
                }
            ],
        }
    ).encode()
    status = gate_status(body)
    assert status == Status(busy=True, progress=None, detail="1 active (some-other-model)")
    assert judge(status, None) == "working"


def test_the_gate_shape_with_nothing_active_is_idle():
    status = gate_status(b'{"active_generation_count": 0, "active_generations": []}')
    assert status is not None
    assert judge(status, None) == "idle"


@pytest.mark.parametrize(
    "body",
    [b'{"active_generation_count": "one"}', b'{"active_generations": 3}', b"{}", b"[]", b"nope"],
)
def test_a_gate_body_of_another_shape_is_not_read(body):
    assert gate_status(body) is None


def test_vllm_metrics_read_running_and_waiting_and_progress():
    status = vllm_metrics(VLLM)
    assert status is not None
    assert status.busy
    assert status.progress == (90712.0, 1234.0, 0.4375)


def test_vllm_progress_moves_when_only_the_kv_cache_grows_during_a_prefill():
    # vLLM counts a prompt's tokens only once its prefill has finished; a long
    # chunked prefill moves only the KV-cache usage. That is progress.
    alone = VLLM.replace(b"} 2.0\n", b"} 0.0\n", 1)  # nothing waiting: it may be ours
    earlier = vllm_metrics(alone)
    later = vllm_metrics(alone.replace(b"} 0.4375", b"} 0.5"))
    assert earlier is not None
    assert later is not None
    assert judge(later, earlier.progress) == "working"
    assert judge(earlier, earlier.progress) == "no_progress"


def test_vllm_with_nothing_running_or_waiting_is_idle():
    body = VLLM.replace(b"} 1.0\n", b"} 0.0\n", 1).replace(b"} 2.0\n", b"} 0.0\n", 1)
    status = vllm_metrics(body)
    assert status is not None
    assert not status.busy


def test_llamacpp_metrics_use_the_decode_counter_as_progress():
    status = llamacpp_metrics(LLAMACPP_METRICS)
    assert status is not None
    assert status.busy
    assert status.progress == (125.0, 16185.0, 394.0)
    moved = llamacpp_metrics(LLAMACPP_METRICS.replace(b"n_decode_total 125", b"n_decode_total 126"))
    assert judge(moved, status.progress) == "working"
    assert judge(llamacpp_metrics(LLAMACPP_METRICS), status.progress) == "no_progress"


def test_llamacpp_slots_busy_and_generating_report_progress():
    body = json.dumps([slot(0, True, 17), slot(1, False)]).encode()
    status = llamacpp_slots(body)
    assert status is not None
    assert status.busy
    assert status.progress == (("0", 17),)
    assert status.detail == "1/2 busy"


def test_llamacpp_slots_still_processing_a_prompt_report_no_progress_value():
    # n_decoded stays 0 during prompt processing: flat is not starved there.
    status = llamacpp_slots(json.dumps([slot(0, True, 0)]).encode())
    assert status is not None
    assert status.busy
    assert status.progress is None
    assert judge(status, status.progress) == "working"


def test_llamacpp_slots_all_idle_and_the_older_state_field():
    assert llamacpp_slots(json.dumps([slot(0, False), slot(1, False)]).encode()) == Status(
        busy=False, progress=None, detail="0/2 busy", slots=2, slots_busy=0, prefilling=0
    )
    old = [{"id": 0, "state": 1, "next_token": {"n_decoded": 3}}, {"id": 1, "state": 0}]
    status = llamacpp_slots(json.dumps(old).encode())
    assert status is not None
    assert status.busy
    assert status.progress == (("0", 3),)


@pytest.mark.parametrize("body", [b"[]", b'[{"id": 0}]', b"[1, 2]", b'{"slots": []}'])
def test_a_slots_body_of_another_shape_is_not_read(body):
    assert llamacpp_slots(body) is None


def test_auto_reader_recognises_every_built_in_shape():
    assert auto_reader(VLLM) == vllm_metrics(VLLM)
    assert auto_reader(LLAMACPP_METRICS) == llamacpp_metrics(LLAMACPP_METRICS)
    assert auto_reader(json.dumps([slot(0, True, 2)]).encode()) is not None
    assert auto_reader(b'{"active_generation_count": 2}') == Status(True, None, "2 active")
    assert auto_reader(b'{"status": "ok"}') is None  # /health is presence, not capacity
    assert auto_reader(b"\xff\xfe") is None


def test_parse_prometheus_sums_label_sets_and_skips_junk():
    text = (
        '# TYPE x gauge\nx{model_name="a"} 1\nx{model_name="b",path="/{x} y"} 2.5\n'
        "y 3 1700000000000\nbroken\nz NaN\nw notanumber\n"
    )
    assert parse_prometheus(text) == {"x": 3.5, "y": 3.0}


def test_the_verdicts():
    assert judge(None, None) == "unknown"
    assert judge(Status(busy=False, progress=5), 5) == "idle"
    assert judge(Status(busy=True, progress=5), None) == "working"
    assert judge(Status(busy=True, progress=6), 5) == "working"
    assert judge(Status(busy=True, progress=5), 5) == "no_progress"
    assert judge(Status(busy=True), None) == "working"


async def test_fetch_status_answers_unknown_for_errors_and_odd_bodies():
    def broken(body: bytes) -> Status | None:
        raise RuntimeError("bad reader")

    async def script(ex):
        if ex.request.path == "/metrics":
            await ex.respond(200, VLLM, {"content-type": "text/plain; version=0.0.4"})
        elif ex.request.path == "/teapot":
            await ex.respond(418, b"{}")
        else:
            await ex.wait_closed_by_peer()

    async with FakeBackend("tower", script) as tower, httpx.AsyncClient() as client:
        ok = await fetch_status(client, tower.url + "/metrics", limit=1, reader=auto_reader)
        teapot = await fetch_status(client, tower.url + "/teapot", limit=1, reader=auto_reader)
        hang = await fetch_status(client, tower.url + "/hang", limit=0.05, reader=auto_reader)
        raised = await fetch_status(client, tower.url + "/metrics", limit=1, reader=broken)
        spent = await fetch_status(client, tower.url + "/metrics", limit=0, reader=auto_reader)
    assert ok is not None
    assert ok.busy
    assert teapot is None
    assert hang is None
    assert raised is None
    assert spent is None


# -- bodies in today's shapes (tests/fixtures) ------------------------------------------


def test_llamacpp_metrics_with_a_deferred_request_mean_ours_is_queued():
    status = llamacpp_metrics(fixture("llamacpp_metrics_deferred.txt"))
    assert status is not None
    assert status.busy
    assert status.waiting == 1
    assert status.queued
    assert status.detail == "1 running, 1 waiting"
    # The counters move (another request is generating): still not ours.
    moved = llamacpp_metrics(
        fixture("llamacpp_metrics_deferred.txt").replace(
            b"n_decode_total 1874", b"n_decode_total 1900"
        )
    )
    assert judge(moved, status.progress) == "queued"
    assert judge(status, None) == "queued"


def test_llamacpp_metrics_idle():
    status = llamacpp_metrics(fixture("llamacpp_metrics_idle.txt"))
    assert status is not None
    assert not status.busy
    assert status.waiting == 0
    assert judge(status, None) == "idle"


def test_a_request_that_does_not_stream_is_not_judged_by_the_queue():
    # It sends nothing until complete, so it may be the one generating.
    status = llamacpp_metrics(fixture("llamacpp_metrics_deferred.txt"))
    assert judge(status, None, streaming=False) == "working"
    assert judge(status, status.progress if status else None, streaming=False) == "no_progress"


def test_llamacpp_slots_list_form_reads_n_decoded():
    status = llamacpp_slots(fixture("llamacpp_slots_list_generating.json"))
    assert status is not None
    assert status.busy
    assert status.progress == (("0", 1873),)
    assert (status.slots, status.slots_busy, status.prefilling) == (1, 1, 0)
    assert status.detail == "1/1 busy, all generating"


def test_every_slot_busy_generating_for_others_means_ours_is_queued():
    status = llamacpp_slots(fixture("llamacpp_slots_list_generating.json"))
    assert status is not None
    assert status.queued
    assert judge(status, None) == "queued"
    body = json.loads(fixture("llamacpp_slots_list_generating.json"))
    body[0]["next_token"][0]["n_decoded"] = 1999
    later = llamacpp_slots(json.dumps(body).encode())
    assert judge(later, status.progress) == "queued"  # progress, but someone else's


def test_llamacpp_slots_list_form_idle():
    status = llamacpp_slots(fixture("llamacpp_slots_list_idle.json"))
    assert status is not None
    assert not status.busy
    assert judge(status, None) == "idle"


def test_a_slot_still_processing_a_prompt_may_be_ours_so_it_is_working():
    status = llamacpp_slots(fixture("llamacpp_slots_object_prefilling.json"))
    assert status is not None
    assert status.busy
    assert (status.slots, status.slots_busy, status.prefilling) == (2, 2, 1)
    assert not status.queued
    assert status.progress is None  # a prefilling slot shows no counter yet
    assert judge(status, None) == "working"


def test_vllm_metrics_with_requests_waiting_mean_ours_is_queued():
    status = vllm_metrics(fixture("vllm_metrics_waiting.txt"))
    assert status is not None
    assert status.busy
    assert status.waiting == 3
    assert status.kv_cache == pytest.approx(0.8421, abs=1e-4)
    assert status.queued
    assert judge(status, None) == "queued"


def test_the_gate_shape_says_nothing_about_a_queue():
    status = gate_status(fixture("gate_busy.json"))
    assert status is not None
    assert status.busy
    assert status.waiting is None
    assert not status.queued
    assert judge(status, None) == "working"


@pytest.mark.parametrize(
    "name",
    [
        "llamacpp_metrics_deferred.txt",
        "llamacpp_metrics_idle.txt",
        "llamacpp_slots_list_generating.json",
        "llamacpp_slots_list_idle.json",
        "llamacpp_slots_object_prefilling.json",
        "vllm_metrics_waiting.txt",
        "gate_busy.json",
        "llamacpp_metrics_captured_idle.txt",
        "llamacpp_metrics_captured_deferred.txt",
        "llamacpp_slots_captured_idle.json",
        "llamacpp_slots_captured_generating.json",
    ],
)
def test_auto_reader_knows_every_fixture(name):
    assert auto_reader(fixture(name)) is not None


# -- captured from a real llama-server (one slot, --metrics --slots) ------------------------


def test_captured_llama_server_metrics_while_another_generation_runs_and_ours_waits():
    status = llamacpp_metrics(fixture("llamacpp_metrics_captured_deferred.txt"))
    assert status is not None
    assert (status.busy, status.waiting, status.queued) == (True, 1, True)
    assert judge(status, None) == "queued"
    idle = llamacpp_metrics(fixture("llamacpp_metrics_captured_idle.txt"))
    assert idle is not None
    assert judge(idle, None) == "idle"


def test_captured_llama_server_slots_generating_for_another_caller():
    status = llamacpp_slots(fixture("llamacpp_slots_captured_generating.json"))
    assert status is not None
    assert status.progress == (("0", 205),)  # next_token is a list in this build
    assert (status.slots, status.slots_busy, status.prefilling) == (1, 1, 0)
    assert judge(status, None) == "queued"


def test_captured_llama_server_idle_slot_has_no_next_token():
    status = llamacpp_slots(fixture("llamacpp_slots_captured_idle.json"))
    assert status == Status(
        busy=False, progress=None, detail="0/1 busy", slots=1, slots_busy=0, prefilling=0
    )


def test_a_prefilling_slot_shows_progress_by_its_prompt_counter():
    body = json.loads(fixture("llamacpp_slots_captured_generating.json"))
    body[0]["next_token"][0]["n_decoded"] = 0  # still processing its prompt
    earlier = llamacpp_slots(json.dumps(body).encode())
    body[0]["n_prompt_tokens_processed"] = 135
    later = llamacpp_slots(json.dumps(body).encode())
    assert earlier is not None
    assert later is not None
    assert earlier.prefilling == 1
    assert not earlier.queued  # a prefilling slot may be ours
    assert judge(later, earlier.progress) == "working"
    assert judge(earlier, earlier.progress) == "no_progress"
