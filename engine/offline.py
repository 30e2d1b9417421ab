"""The single-process reference generation path (`pdserve offline`): one request through the same scheduler core
and runner the workers run (the aggregated policy): prefill the prompt (optionally in chunks), sample the first
token, then decode one token per step over the paged cache. Workers are checked against it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pdserve.engine.checks import check_context, check_token_ids
from pdserve.engine.drafter import MTPDrafter, check_speculation
from pdserve.engine.pages import PageAllocator, pages_needed
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import FinishReason, SamplingParams, TokenLogprobs
from pdserve.engine.scheduler import Scheduler
from pdserve.model.deepseek import Transformer
from pdserve.model.kv_cache import PagedKVCache, resolve_cache_dtype


@dataclasses.dataclass(frozen=True, slots=True)
class Generation:
    token_ids: list[int]
    finish_reason: str
    num_steps: int = 0
    """Decode steps and prefill chunks it took."""
    num_drafted: int = 0
    """Draft tokens its steps verified, and of them accepted."""
    num_accepted: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Where the params asked for them: per prompt token after the first, its log-probability given the
    tokens before it (`SamplingParams.prompt_logprobs`)."""


class OfflineGenerationError(RuntimeError):
    """A forward pass failed (the runner logged its traceback)."""


class OfflineGenerator:
    """Generates for one prompt at a time with a private cache sized for the longest sequence it will see, and no
    CUDA graphs (every step runs eagerly, as the reference)."""

    def __init__(
        self, model: Transformer, page_size: int = 64, prefill_chunk: int | None = None,
        kv_cache_dtype: str = "auto", num_drafts: int = 0,
        drafter: Callable[[Transformer, PagedKVCache], MTPDrafter] | None = None,
    ):  # fmt: skip
        """prefill_chunk: prefill the prompt this many tokens per step (None: all at once); num_drafts: the
        MTP module's draft tokens a step (0: one token a step); drafter: makes the runner's drafter from the
        model and its cache (tests and benchmarks: `OracleDrafter`)."""
        check_speculation(model, num_drafts)
        self.model, self.page_size, self.prefill_chunk = model, page_size, prefill_chunk
        self.num_drafts, self.drafter = num_drafts, drafter
        resolve_cache_dtype(
            kv_cache_dtype, model.dtype
        )  # a bad name fails here, not at the first prompt
        self.kv_cache_dtype = kv_cache_dtype

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        args = self.model.args
        check_token_ids(prompt_ids, args.vocab_size, "prompt_token_ids")
        check_context(len(prompt_ids), params.max_tokens, args.max_position_embeddings)
        lookahead = (
            2 * self.num_drafts
        )  # the drafts' rows and the MTP chain (`Scheduler.lookahead`)
        num_pages = pages_needed(len(prompt_ids) + params.max_tokens + lookahead, self.page_size)
        runner = ModelRunner(
            self.model, self.page_size, num_pages, self.kv_cache_dtype, cuda_graphs=False
        )
        if self.drafter is not None:
            runner.drafter = self.drafter(self.model, runner.cache)
        chunk = self.prefill_chunk or len(prompt_ids)
        scheduler = Scheduler(
            PageAllocator(num_pages), self.page_size, chunk, chunk, args.vocab_size,
            args.max_position_embeddings, args.eos_token_ids, worker_kind="offline generator",
            num_drafts=self.num_drafts,
        )  # fmt: skip
        request = Request("offline", list(prompt_ids), params.with_seed(), Policy.AGGREGATED)
        scheduler.add(request)
        finish_reason = prompt_logprobs = None
        num_steps = 0
        while request.state not in (RequestState.FINISHED, RequestState.ABORTED):
            plan, _ = scheduler.schedule()  # one request in a cache sized for it: never preempted
            num_steps += 1
            for out in scheduler.finish_step(plan, [runner.execute(plan)]).outputs:
                if out.finish_reason == FinishReason.ABORT:
                    raise OfflineGenerationError(out.error)
                finish_reason = out.finish_reason
                prompt_logprobs = prompt_logprobs or out.prompt_logprobs
        return Generation(
            request.token_ids[len(prompt_ids) :], finish_reason, num_steps, request.num_drafted,
            request.num_accepted, prompt_logprobs,
        )  # fmt: skip


def generate_greedy(model: Transformer, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """Convenience for tests: greedy tokens, ignoring EOS."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return OfflineGenerator(model).generate(prompt_ids, params).token_ids
