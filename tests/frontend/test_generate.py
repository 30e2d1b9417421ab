"""The service end to end on CPU: real Ray actors (one prefill, one decode worker), the real grpc.aio router on
loopback, real gRPC clients. Outputs equal the offline path's; cancel and deadline free the pages on both sides;
bad inputs are refused naming the field while the server keeps serving; health and reflection work; a
conversation's next turn gets only the KV pages its decode worker does not hold."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving import all_pages_free, collect, greedy, pages_in_use, scrape, wait_for, workload

from pdserve.cli.client import Client, generate_request
from pdserve.v1 import generation_pb2


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address) as client:
        yield client


def test_health_is_serving_after_warm_up(client):
    reply = client.health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert client.is_serving()


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        request = reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="pdserve.v1.Generation"
        )
        (described,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert {"pdserve.v1.Generation", "pdserve.v1.Admin", "grpc.health.v1.Health"} <= names
    # What grpcurl needs to call the API without the .proto: the file descriptor.
    (proto,) = described.file_descriptor_response.file_descriptor_proto
    assert b"pdserve/v1/generation.proto" in proto and b"GenerateRequest" in proto


def test_32_concurrent_streams_equal_offline(client, reference):
    requests = workload(32, seed=1)

    def run(i: int):
        prompt, max_tokens = requests[i]
        return collect(client, greedy(prompt, max_tokens, request_id=f"c{i}"))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, range(32)))
    for (prompt, max_tokens), chunks in zip(requests, results, strict=True):
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == reference(prompt, max_tokens)
        *body, last = chunks
        assert all(c.finish_reason == generation_pb2.FINISH_REASON_UNSPECIFIED for c in body)
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), max_tokens)
        t = last.timings
        assert 0 < t.time_to_first_token_s <= t.total_s
        assert (t.prefill_worker, t.decode_worker) == ("prefill-0", "decode-0")
        # the stage times: every stage ran (each worker's clock), none longer than the request
        stages = (t.queued_s, t.prefill_queue_s, t.prefill_s, t.kv_transfer_s, t.decode_queue_s)
        assert all(0 < s < t.total_s for s in stages[1:]), stages
        assert 0 < t.queued_s < t.time_to_first_token_s, stages
    assert len({c.request_id for chunks in results for c in chunks}) == 32
    wait_for(lambda: all_pages_free(client), 10, "pages freed after the requests finished")


def test_text_prompt_equals_pdserve_offline_cli(client, model_dir):
    offline = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "offline", "--model", str(model_dir),
         "--prompt", "The quick brown fox", "--max-new-tokens", "12", "--dtype", "fp32",
         "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    expected = json.loads(offline.stdout)
    chunks = collect(client, greedy("The quick brown fox", 12))
    assert [t for c in chunks for t in c.token_ids] == expected["token_ids"]
    assert "".join(c.text for c in chunks) == expected["text"]


def test_pdserve_generate_and_status_cli(server, reference):
    prompt = [0, 5, 6, 7]
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "generate", "--addr", server.address,
         "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "6", "--temperature", "0",
         "--ignore-eos", "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout)["token_ids"] == reference(prompt, 6)
    status = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "status", "--addr", server.address],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "prefill-0" in status.stdout and "decode-0" in status.stdout
    assert "KV rows auto" in status.stdout


def test_client_cancel_mid_stream_frees_pages_on_both_sides(client):
    call = client.generate(greedy([0, *range(10, 200)], 3000), timeout_s=120)
    chunks = [next(call) for _ in range(3)]
    assert all(c.token_ids for c in chunks)
    held = pages_in_use(client)
    assert held["decode-0"] > 0, held
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    wait_for(lambda: all_pages_free(client), 10, "pages freed after cancel")


def test_cancel_during_prefill_frees_pages_on_both_sides(client):
    # About half a second of prefill on a CPU, then 2000 decode steps (several seconds) if left alone.
    long_prompt = [0, *[(7 * i) % 900 + 3 for i in range(2000)]]
    call = client.generate(greedy(long_prompt, 2000), timeout_s=120)
    held = wait_for(
        lambda: (p := pages_in_use(client))["prefill-0"] > 0 and p, 30,
        "the prompt on the prefill worker", interval_s=0.01,
    )  # fmt: skip
    assert held["decode-0"] > 0, held  # the decode worker reserved its pages first
    call.cancel()
    wait_for(lambda: all_pages_free(client), 3, "pages freed at once after cancel during prefill")
    chunks = collect(client, greedy([0, 1, 2], 4))  # still serving
    assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH


def test_deadline_returns_deadline_exceeded_and_frees_pages(client):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, greedy([0, 3, 4, 5], 3000), timeout_s=1.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: all_pages_free(client), 10, "pages freed after the deadline")


BAD_REQUESTS = [
    ("empty text prompt", generate_request("", max_tokens=4), "prompt"),
    ("empty prompt ids", generate_request([], max_tokens=4), "prompt_token_ids"),
    ("no prompt", generation_pb2.GenerateRequest(), "prompt"),
    ("prompt longer than context", generate_request([1] * 4096, max_tokens=1), "prompt_token_ids"),
    ("max_tokens 0", generate_request([0, 1], max_tokens=0), "max_tokens"),
    ("max_tokens above context", generate_request([0, 1], max_tokens=5000), "max_tokens"),
    ("negative temperature", generate_request([0, 1], temperature=-0.5), "temperature"),
    ("top_p 0", generate_request([0, 1], top_p=0.0), "top_p"),
    ("top_p above 1", generate_request([0, 1], top_p=1.5), "top_p"),
    ("top_k below -1", generate_request([0, 1], top_k=-2), "top_k"),
    ("token id outside vocab", generate_request([0, 1024], max_tokens=2), "prompt_token_ids"),
    ("stop id outside vocab", generate_request([0], stop_token_ids=[5000]), "stop_token_ids"),
    ("n above router.max_n", generate_request([0, 1], n=17), "sampling_params.n"),
    (
        "logprobs above router.max_logprobs",
        generate_request([0], logprobs=21),
        "sampling_params.logprobs",
    ),
    (
        "min_tokens above max_tokens",
        generate_request([0], max_tokens=2, min_tokens=3),
        "min_tokens",
    ),
    ("repetition_penalty 0", generate_request([0], repetition_penalty=0), "repetition_penalty"),
]


@pytest.mark.parametrize(
    "request_, field", [(r, f) for _, r, f in BAD_REQUESTS], ids=[n for n, _, _ in BAD_REQUESTS]
)
def test_bad_input_is_invalid_argument_naming_the_field(client, request_, field):
    with pytest.raises(grpc.RpcError) as info:
        collect(client, request_, timeout_s=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details(), info.value.details()
    # The server keeps serving.
    chunks = collect(client, greedy([0, 9], 2))
    assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH


CLIENT_SCRIPT = """
import sys, grpc
sys.path.insert(0, sys.argv[1])
import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
stub = pb_grpc.GenerationStub(grpc.insecure_channel(sys.argv[2]))
request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[0, 5, 6, 7]),
                             sampling_params=pb.SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
print(",".join(str(t) for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids))
"""


def test_client_built_from_the_proto_alone_can_generate(server, tmp_path, reference):
    from grpc_tools import protoc

    from pdserve.protos import PROTO_ROOT

    (tmp_path / "generation.proto").write_text(
        (PROTO_ROOT / "pdserve/v1/generation.proto").read_text()
    )
    args = ["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    assert protoc.main([*args, "generation.proto"]) == 0
    out = subprocess.run(
        [sys.executable, "-I", "-c", CLIENT_SCRIPT, str(tmp_path), server.address],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert [int(t) for t in out.stdout.strip().split(",")] == reference([0, 5, 6, 7], 5)


def test_the_next_turn_travels_only_the_pages_its_decode_worker_lacks(server, client, reference):
    """Real Ray actors and the torch.distributed (gloo) transfer: a conversation's second turn gets from the
    prefill worker only the pages after those the decode worker kept of the first (its prompt's 3 full
    64-token pages), as the prefill worker's counters say, and streams the offline tokens."""
    url = f"{server.http_url.removesuffix('/v1')}/metrics"

    def pages() -> tuple[float, float]:
        families = scrape(url)
        return tuple(
            sum(
                s.value
                for s in families[name].samples
                if s.name == f"{name}_total" and s.labels["worker"] == "prefill-0"
            )  # fmt: skip
            for name in ("pdserve:kv_transfer_pages", "pdserve:kv_transfer_pages_not_sent")
        )

    def settled():  # the stats polled after the earlier tests' transfers
        seen = pages()
        time.sleep(1.5)
        return pages() == seen and seen

    sent, not_sent = wait_for(settled, 30, "the prefill worker's counters settling")
    g = torch.Generator().manual_seed(47)
    first = torch.randint(3, 1000, (201,), generator=g).tolist()  # 4 pages, 3 full
    answer = [t for c in collect(client, greedy(first, 4)) for t in c.token_ids]
    assert answer == reference(first, 4)
    wait_for(lambda: pages() == (sent + 4, not_sent), 10, "the first turn's 4 pages sent")
    second = [*first, *answer, *torch.randint(3, 1000, (60,), generator=g).tolist()]  # 265: 5 pages
    tokens = [t for c in collect(client, greedy(second, 4)) for t in c.token_ids]
    assert tokens == reference(second, 4)
    wait_for(lambda: pages() == (sent + 6, not_sent + 3), 10, "the second turn's 2 pages sent")
