"""Requests are keyed by the router's own ids (real Ray, real gRPC, on CPU): a client that cancels and at once
resends under the same `request_id`, hundreds of times while other streams run, gets each resend's own output,
equal to `pdserve offline`. Cancels are logged at INFO without tracebacks; request bytes that do not decode get
INVALID_ARGUMENT; a long `request_id` is refused without being quoted; a shutdown ends open requests with a last
chunk whose finish_reason is abort."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from serving import all_pages_free, collect, greedy, start_server, wait_for

from pdserve.cli.client import Client
from pdserve.v1 import generation_pb2

NUM_CLIENTS = 4
CYCLES_PER_CLIENT = 60
"""240 cancel-then-resend cycles in all."""
RESEND_PROMPTS = [[0, *range(20 + 7 * k, 30 + 11 * k)] for k in range(6)]
"""The resends' prompts (few, so that their offline references are computed once)."""


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir):
    with start_server(model_dir, router={"shutdown_grace_s": 0.5}) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def _background_load(client: Client, stop: threading.Event, index: int) -> int:
    """Streams long requests until `stop`; returns how many it finished."""
    done = 0
    while not stop.is_set():
        call = client.generate(greedy([0, *range(300 + index, 340 + index)], 40), timeout_s=120)
        for chunk in call:
            if stop.is_set():
                call.cancel()
                break
            if chunk.finish_reason:
                done += 1
    return done


def _cancel_then_resend(client: Client, reference, index: int) -> list[str]:
    """CYCLES_PER_CLIENT times: start a request, cancel it (before its first chunk or after it), and at once
    resend under the same id with another prompt. Returns a description of every wrong resend."""
    wrong = []
    for cycle in range(CYCLES_PER_CLIENT):
        request_id = f"same-{index}"
        old_prompt = [0, *range(500 + cycle, 520 + cycle + index)]
        old = client.generate(greedy(old_prompt, 30, request_id=request_id), timeout_s=60)
        if cycle % 2:
            next(old)  # the old request holds pages on both workers and has streamed a token
        old.cancel()
        prompt = RESEND_PROMPTS[(cycle + index) % len(RESEND_PROMPTS)]
        max_tokens = 6 + cycle % 5
        try:
            chunks = collect(client, greedy(prompt, max_tokens, request_id=request_id), 60)
        except grpc.RpcError as e:
            wrong.append(f"client {index} cycle {cycle}: {e.code()} {e.details()}")
            continue
        got = tokens(chunks)
        if got != reference(prompt, max_tokens):
            wrong.append(f"client {index} cycle {cycle}: {got} != {reference(prompt, max_tokens)}")
        if {c.request_id for c in chunks} != {request_id}:
            wrong.append(f"client {index} cycle {cycle}: echoed {[c.request_id for c in chunks]}")
        if chunks[-1].finish_reason != generation_pb2.FINISH_REASON_LENGTH:
            wrong.append(f"client {index} cycle {cycle}: finish_reason {chunks[-1].finish_reason}")
    return wrong


@pytest.mark.slow
def test_cancel_then_resend_under_the_same_id_under_load(client, reference, caplog):
    for prompt in RESEND_PROMPTS:  # offline references first, outside the timed part
        for max_tokens in range(6, 11):
            reference(prompt, max_tokens)
    stop = threading.Event()
    caplog.set_level(logging.INFO)
    with ThreadPoolExecutor(NUM_CLIENTS + 2) as pool:
        load = [pool.submit(_background_load, client, stop, i) for i in range(2)]
        cycles = [
            pool.submit(_cancel_then_resend, client, reference, i) for i in range(NUM_CLIENTS)
        ]
        wrong = [w for f in cycles for w in f.result()]
        stop.set()
        finished_under_load = sum(f.result() for f in load)
    assert not wrong, (
        f"{len(wrong)} of {NUM_CLIENTS * CYCLES_PER_CLIENT} resends wrong: {wrong[:5]}"
    )
    assert finished_under_load > 0
    wait_for(lambda: all_pages_free(client), 20, "pages freed after the cycles")
    # Every cancel is an ordinary event: INFO lines, never an ERROR or a traceback.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert any("cancelled by the client" in r.getMessage() for r in caplog.records)


def test_undecodable_request_bytes_are_invalid_argument(server, client, caplog):
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.address) as channel:
        generate = channel.unary_stream("/pdserve.v1.Generation/Generate")
        status = channel.unary_unary("/pdserve.v1.Admin/GetStatus")
        for call in (generate, status):
            for data in (b"\xff\xff\xff\xff", b"\x0a\x05ab"):  # bad tag; a field cut short
                with pytest.raises(grpc.RpcError) as info:
                    result = call(data, timeout=10)
                    list(result) if call is generate else result
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details().startswith("request: cannot be decoded as")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    chunks = collect(client, greedy([0, 9], 2))  # still serving
    assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH


def test_long_request_id_is_refused_without_quoting_it(client, caplog):
    caplog.set_level(logging.DEBUG)
    request_id = "x\n" * 100_000
    with pytest.raises(grpc.RpcError) as info:
        collect(client, greedy([0, 5], 2, request_id=request_id))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "request_id: 200000 characters; at most 256"
    assert not [r for r in caplog.records if "x\nx\n" in r.getMessage()]
    chunks = collect(client, greedy([0, 5], 2, request_id="y" * 256))
    assert {c.request_id for c in chunks} == {"y" * 256}


def test_requests_in_flight_may_share_an_id(client, reference):
    prompts = [[0, 3, 4], [0, 7, 8, 9]]

    def run(prompt):
        return tokens(collect(client, greedy(prompt, 12, request_id="shared")))

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, prompts))
    assert results == [reference(p, 12) for p in prompts]


def test_shutdown_ends_open_requests_with_an_abort_chunk(server, client):
    """Stops this module's server: keep it the module's last test."""
    calls = [
        client.generate(greedy([0, 3 + i, 4], 3000, request_id=f"long-{i}"), 120) for i in range(3)
    ]
    for call in calls:
        next(call)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    for i, call in enumerate(calls):
        chunks = list(call)
        assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_ABORT
        assert chunks[-1].request_id == f"long-{i}"
        assert len(tokens(chunks)) < 3000
    stopper.join(timeout=120)
    assert not stopper.is_alive()
