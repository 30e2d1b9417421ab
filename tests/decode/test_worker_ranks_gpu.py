"""A decode worker of 2 or 4 GPUs (attention data-parallel, experts split over all: DP2 + EP2, DP4 + EP4, NCCL)
replaying its decode steps as CUDA graphs after its warm-up, in batch-invariant mode: every request streams
exactly the tokens the one-GPU offline path generates (the MoE sums its experts as a tree no expert split
changes), while the ranks run different batch sizes and ranks idle as their requests finish."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.decode import DecodeConfig, DecodeWorker
from pdserve.engine.messages import DecodeRequest
from pdserve.engine.offline import OfflineGenerator
from pdserve.engine.ranks.runner import start_rank_group
from pdserve.engine.sampling_params import SamplingParams
from pdserve.model.loader import load_model
from pdserve.model.parallel import WorkerLayout, rows_per_rank

from .test_worker import drain

pytestmark = [pytest.mark.multi_gpu, pytest.mark.slow]
PAGE = 16


@pytest.fixture(scope="module")
def model_dir(v2lite_dir):
    return v2lite_dir


@pytest.mark.parametrize("ranks", [2, 4], ids=["dp2-ep2", "dp4-ep4"])
def test_dp_ep_graphs_give_the_one_gpu_tokens(model_dir, ranks):
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA GPUs")
    g = torch.Generator().manual_seed(7)
    prompts = [
        [0, *torch.randint(3, 100000, (n - 1,), generator=g).tolist()] for n in (5, 130, 47, 300, 9)
    ]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 12, 25, 33, 3)]
    with kernels.use(batch_invariant=True):
        model = load_model(model_dir, "cuda:0", torch.bfloat16, progress=False)
        generator = OfflineGenerator(model, PAGE, prefill_chunk=64)  # as the worker cuts prompts
        want = {
            f"r{i}": (generator.generate(p, s).token_ids, "length")
            for i, (p, s) in enumerate(zip(prompts, params, strict=True))
        }
        del generator, model
        torch.cuda.empty_cache()
        config = DecodeConfig(
            page_size=PAGE, num_pages=256, max_prefill_chunk=64, max_running=16,
            warm_up_context=1024, layout=WorkerLayout(ranks, "data", expert_parallel=ranks),
        )  # fmt: skip
        group = start_rank_group(
            config, str(model_dir), "bf16", "auto", backend="nccl", kernel_choice=(None, True)
        )
        decode = DecodeWorker("d0", None, config, ranks=group)
        try:
            decode.warm_up()
            graphs = decode.runner.graphs
            assert graphs is not None and graphs.enabled
            captured = set(graphs._graphs)
            # a data-parallel rank holds at most its share of max_running: its graphs go up to that many rows
            rows = rows_per_rank(config.max_running, ranks)
            assert {(1, 16), (rows, 16)} <= captured, captured
            for i, (p, s) in enumerate(zip(prompts, params, strict=True)):
                decode.add_request(DecodeRequest(f"r{i}", p, s))
            got = drain(decode, list(want))
            assert (
                graphs.enabled and set(graphs._graphs) == captured
            )  # nothing captured while serving
            assert decode.num_used_pages == 0
        finally:
            decode.close()
    assert got == want
