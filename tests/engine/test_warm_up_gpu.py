"""After a worker's warm-up, the shapes serving runs compile no Triton kernel: prompts batched in ones and
dozens, of odd lengths, a prompt's later chunk, a pass filling the token budget, decode batches between
buckets. A kernel compiled in a client's request costs it 1-2 s on a GPU (measured: the first Poisson load after
SERVING had prefill steps of 2, 6 and 8 prompts take 1.3-2.1 s each, one compile each)."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.engine.runner import ModelRunner
from pdserve.engine.step import DecodeRow, PrefillRow, RankStep, SampleSpec, StepPlan
from pdserve.engine.warm_up import warm_up_plans
from pdserve.model.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PAGE, CHUNK, BUDGET, ROWS, CONTEXT = 64, 4096, 8192, 16, 1024
GREEDY = SampleSpec(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0, step=0)


def _prefill(lengths: list[int], start: int = 0) -> RankStep:
    pages = list(range(-(-(start + max(lengths)) // PAGE)))
    return RankStep(
        prefill=[PrefillRow(f"p{i}", [5] * n, start, pages, GREEDY) for i, n in enumerate(lengths)]
    )


def _decode(rows: int, position: int) -> RankStep:
    pages = list(range(position // PAGE + 1))
    return RankStep(decode=[DecodeRow(f"d{i}", 5, position, pages, GREEDY) for i in range(rows)])


SERVED = [
    *[_prefill([1024] * k) for k in range(1, 9)],
    _prefill([333, 1000, 17, 2048]),
    _prefill([7] * 5),
    _prefill([100] * 37),
    _prefill([1024], start=CHUNK),
    _prefill([CHUNK, CHUNK - 5]),
    _decode(5, 100),
    _decode(13, CONTEXT - 1),
]


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch-invariant"])
def test_no_kernel_compiles_after_warm_up(v2lite_dir, invariant):
    import triton

    compiled: list[str] = []
    served = [-1]  # the SERVED step running

    def hook(*args, **kwargs):  # triton's JIT hook: the kernel's repr names its specialization
        compiled.append(f"SERVED[{served[0]}]: {kwargs.get('repr', args)}")

    with kernels.use(batch_invariant=invariant):
        model = load_model(v2lite_dir, "cuda:0", torch.bfloat16, progress=False)
        runner = ModelRunner.sized(model, PAGE, 512, 0.5, 0)
        try:
            for plan in warm_up_plans(1, PAGE, runner.num_pages, CHUNK, ROWS, CONTEXT, BUDGET):
                result = runner.execute(plan)
                assert not (result.prefill_error or result.decode_error), result
            triton.knobs.runtime.jit_post_compile_hook = hook
            for step_id, step in enumerate(SERVED):
                served[0] = step_id
                result = runner.execute(StepPlan(step_id, [step]))
                assert not (result.prefill_error or result.decode_error), result
        finally:
            triton.knobs.runtime.jit_post_compile_hook = None
            runner.close()
            del runner, model
            torch.cuda.empty_cache()
    assert not compiled, "\n".join(compiled)
