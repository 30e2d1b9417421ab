"""`ModelRunner.execute` on the CPU with the tiny model: a step plan's rows give the tokens a direct forward of
the model gives, a plan that went through the wire (msgpack) runs alike, and a failing pass is returned, not
raised, while the other pass of the step still runs."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.ranks import channel as plan_channel
from pdserve.engine.ranks.wire import plan_from_wire, plan_to_wire
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step import DecodeRow, PrefillRow, RankStep, SampleSpec, StepPlan
from pdserve.model.batch import SeqChunk, build_forward_batch
from pdserve.model.loader import load_model
from pdserve.model.random_checkpoint import make_checkpoint

PAGE = 4
GREEDY = SampleSpec.of(SamplingParams(max_tokens=8, seed=0), 0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    make_checkpoint(out, "tiny", dtype="fp32", shard_bytes=2 << 20, progress=False)
    return load_model(out, dtype=torch.float32)


def direct_next_tokens(model, chunks: list[SeqChunk], decode: bool) -> list[int]:
    """Greedy next token of each chunk from the model's own forward over a fresh cache."""
    runner = ModelRunner(model, PAGE, 16, cuda_graphs=False)
    with torch.inference_mode():
        if decode:  # the prompts first, as the step under test finds them
            prompts = [
                SeqChunk(list(range(5, 5 + c.num_computed_tokens)), 0, c.page_ids) for c in chunks
            ]
            model(build_forward_batch(prompts, PAGE, "cpu", decode=False), runner.cache)
        batch = build_forward_batch(chunks, PAGE, "cpu", decode=decode)
        hidden = model(batch, runner.cache)
        return model.compute_logits(hidden[batch.logits_indices]).argmax(-1).tolist()


def test_rows_give_the_model_s_tokens_and_survive_msgpack(model):
    prompts = [list(range(5, 15)), list(range(5, 12))]
    prefill = RankStep(
        prefill=[
            PrefillRow("a", prompts[0], 0, [0, 1, 2], GREEDY),
            PrefillRow("b", prompts[1][:4], 0, [3, 4], None),  # a first chunk: nothing sampled
        ]
    )
    result = ModelRunner(model, PAGE, 16, cuda_graphs=False).execute(StepPlan(7, [prefill]))
    expected = direct_next_tokens(model, [SeqChunk(prompts[0], 0, [0, 1, 2])], decode=False)
    assert result.step_id == 7 and result.prefill_tokens == [expected[0], None]
    assert result.decode_tokens == [] and result.prefill_error is None

    decode = RankStep(
        decode=[DecodeRow("a", 30, 10, [0, 1, 2], GREEDY), DecodeRow("b", 31, 7, [3, 4], GREEDY)]
    )
    expected = direct_next_tokens(
        model, [SeqChunk([30], 10, [0, 1, 2]), SeqChunk([31], 7, [3, 4])], decode=True
    )
    message = plan_channel.encode(plan_to_wire(StepPlan(8, [decode])))
    wired = plan_from_wire(plan_channel.decode(message))
    for plan in (StepPlan(8, [decode]), wired):
        runner = ModelRunner(model, PAGE, 16, cuda_graphs=False)
        first = RankStep(
            prefill=[PrefillRow(r, list(range(5, 5 + r_len)), 0, pages, None)
                     for r, r_len, pages in (("a", 10, [0, 1, 2]), ("b", 7, [3, 4]))]
        )  # fmt: skip
        runner.execute(StepPlan(0, [first]))
        assert runner.execute(plan).decode_tokens == expected


def test_a_failing_pass_is_returned_and_the_other_pass_runs(model):
    runner = ModelRunner(model, PAGE, 16, cuda_graphs=False)
    step = RankStep(
        prefill=[PrefillRow("a", list(range(5, 15)), 0, [0], GREEDY)],  # 10 tokens, one page of 4
        decode=[DecodeRow("b", 9, 0, [5], GREEDY)],
    )
    result = runner.execute(StepPlan(1, [step]))
    assert result.prefill_tokens == [] and "cannot hold 10 tokens" in result.prefill_error
    assert len(result.decode_tokens) == 1 and result.decode_error is None


def test_a_runner_executes_its_own_rank_s_rows(model):
    runner = ModelRunner(model, PAGE, 16, cuda_graphs=False, rank=1)
    plan = StepPlan(2, [RankStep(), RankStep(decode=[DecodeRow("b", 9, 0, [5], GREEDY)])])
    assert len(runner.execute(plan).decode_tokens) == 1
    assert ModelRunner(model, PAGE, 16, cuda_graphs=False).execute(plan).decode_tokens == []
