"""Per-request sampling parameters and stop rules. Pure Python: used by routers and schedulers without torch."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Collection

from pdserve.model.errors import InvalidRequestError

MAX_SEED = (1 << 63) - 1
MAX_ADDITIVE_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-2, 2], as OpenAI's API takes them."""
MAX_PROMPT_LOGPROBS = 65536
"""The most prompt log-probability entries a request may ask for (`SamplingParams.prompt_logprobs`): its
prompt tokens times (1 + the alternatives asked for), e.g. 32768 tokens with one alternative. They travel in one
message with the request's first token, from a prefill worker in the handoff that goes with its KV pages
(`PrefillHandoff`, packed at 8 bytes an entry, within `kvtransfer.base.MAX_METADATA_BYTES`): the bound keeps
them to half a MiB."""


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
"""What a structured output may be constrained to (`StructuredOutput.kind`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on a request's output (OpenAI's `response_format`, vLLM's `structured_outputs` and
    `guided_*`): its kind (`STRUCTURED_KINDS`) and its text: the JSON schema as JSON text (json_schema), "" for
    any JSON object (json_object), the regular expression (regex), the choices as a JSON list of strings
    (choice), or a Lark grammar (grammar). Plain strings, so it travels as the request does (msgpack, the
    rank wire); `pdserve.engine.grammar` checks and compiles it. Equal constraints compile once per runner."""

    kind: str
    text: str = ""
    start_after: int | None = None
    """A token id: the output is free up to and including the first such token, and constrained after it (a
    reasoning model's think-end token where the prompt opened a think block: the reasoning is free, the answer
    after it parses, as vLLM's reasoning parsers have it); None: constrained from the first token."""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                "structured_output",
                f"kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}",
            )
        if self.start_after is not None and (
            isinstance(self.start_after, bool)
            or not isinstance(self.start_after, int)
            or self.start_after < 0
        ):
            raise InvalidRequestError(
                "structured_output.start_after",
                f"must be a token id (an integer >= 0), got {self.start_after!r}",
            )


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each generated token and when to stop. Invalid values raise InvalidRequestError naming the
    field."""

    max_tokens: int = 16
    """Tokens to generate at most (the first one, sampled by prefill, included)."""
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 or 0 disables."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 disables."""
    seed: int | None = None
    """Makes sampling reproducible; None draws a seed when the request is admitted."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated so far (OpenAI's); 0 disables."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated so far (OpenAI's); 0 disables."""
    repetition_penalty: float = 1.0
    """Divides the positive logits (multiplies the negative ones) of every token of the prompt and of the output
    so far (Hugging Face's); 1 disables. Penalties apply to the logits before the temperature."""
    min_tokens: int = 0
    """Tokens generated before an end-of-sequence or stop token may be sampled (they are masked until then)."""
    logprobs: int | None = None
    """Report each sampled token's log-probability and this many most likely alternatives (0: the sampled
    token's alone), from the log-softmax of the raw logits (before penalties and temperature); None: none."""
    prompt_logprobs: int | None = None
    """Report the log-probability of each prompt token after the first (given the tokens before it) and this
    many most likely alternatives at its position (vLLM's prompt_logprobs; 0: the prompt token's alone), on
    the request's first output; None: none. A request asking for them is prefilled in full (the prefix cache
    serves it nothing) and its prompt is bounded (`MAX_PROMPT_LOGPROBS`)."""
    skip_special_tokens: bool = True
    """The text leaves out special tokens (BOS, EOS, padding); token ids are never filtered."""
    relaxed_think_ids: tuple[int, int] | None = None
    """Opt-in relaxed acceptance of MTP drafts inside a think block: the ids that open and close it (the front
    end sets them from the tokenizer where the request asks). A speculating decode worker configured for it
    (`decode.speculative_relaxed_topk`) accepts a greedy request's draft inside the block when it is among the
    target's top-k within delta of the best log-probability; elsewhere, and on other workers, strict."""
    structured: StructuredOutput | None = None
    """Constrain the output to a grammar (`StructuredOutput`): every sampled token is masked to those the
    grammar allows next (a verify group's rows as if the drafts before them were taken), and end-of-sequence
    is allowed only where the grammar accepts. Such a request may not ignore EOS."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "token ids must be >= 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (
                math.isfinite(value) and -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY
            ):
                raise InvalidRequestError(
                    name,
                    f"must be in [-{MAX_ADDITIVE_PENALTY:g}, {MAX_ADDITIVE_PENALTY:g}], got {value}",
                )
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(
                "repetition_penalty", f"must be > 0, got {self.repetition_penalty}"
            )
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise InvalidRequestError("min_tokens", f"must be an integer, got {self.min_tokens!r}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.relaxed_think_ids is not None and (
            len(self.relaxed_think_ids) != 2 or min(self.relaxed_think_ids) < 0
        ):
            raise InvalidRequestError(
                "relaxed_think_ids", f"must be two token ids, got {self.relaxed_think_ids!r}"
            )
        if self.structured is not None and self.ignore_eos:
            raise InvalidRequestError(
                "ignore_eos",
                "cannot be combined with a structured output: its grammar ends the output",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise InvalidRequestError(name, f"must be None or an integer >= 0, got {value!r}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return any_penalty(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    def with_seed(self) -> SamplingParams:
        """A copy with a concrete seed (drawn at random when unset), so every worker samples alike."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=random.SystemRandom().randint(0, MAX_SEED))


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely alternatives, from the log-softmax of the raw
    logits (before penalties and temperature)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    """Most likely first (as many as the request asked for)."""
    top_logprobs: tuple[float, ...] = ()
    rank: int | None = None
    """The token's rank among the vocabulary by log-probability (1: the most likely; ties share the best),
    given for prompt tokens (vLLM's prompt_logprobs report it); None where not computed."""


def any_penalty(presence: float, frequency: float, repetition: float) -> bool:
    """Whether these penalties change the logits (0, 0 and 1 leave them as they are)."""
    return presence != 0 or frequency != 0 or repetition != 1


def min_tokens_ban(
    params: SamplingParams, eos_token_ids: Collection[int], stop_ids: Collection[int] | None = None
) -> tuple[int, ...]:
    """What min_tokens holds back, sorted: the request's stop tokens (`stop_ids`: them as a set, where the
    caller keeps one) and, unless it ignores EOS, `eos_token_ids`."""
    eos = () if params.ignore_eos else eos_token_ids
    return tuple(sorted({*eos, *(params.stop_token_ids if stop_ids is None else stop_ids)}))


def derive_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed of a request seeded `seed` that asks for several choices: choice 0 keeps `seed`
    (so a request's first choice is what it alone would give), the others get distinct seeds fixed by it."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & MAX_SEED


def check_stop(
    params: SamplingParams, token_id: int, num_generated: int, eos_token_ids: Collection[int],
    stop_ids: Collection[int] | None = None,
) -> str | None:  # fmt: skip
    """Finish reason after `token_id`, the `num_generated`-th generated token, or None to continue. stop_ids:
    `params.stop_token_ids` as a set (`Request.stop_ids`), where the caller keeps one."""
    if not params.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if token_id in (params.stop_token_ids if stop_ids is None else stop_ids):
        return FinishReason.STOP
    if num_generated >= params.max_tokens:
        return FinishReason.LENGTH
    return None
