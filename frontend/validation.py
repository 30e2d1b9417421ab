"""The checks a request passes at the router, before any worker sees it, whichever front end it came through
(`request_builder` runs them in order), and what they need to know of the model (`ModelInfo`). Every rejection
is an InvalidRequestError naming the field as the request's protocol spells it (`FieldNames`: `prompt`,
`prompt_token_ids`, `sampling_params.max_tokens`, `max_completion_tokens`, ...). Unset sampling fields take the
model's generation_config.json values; unset max_tokens takes the router's default, capped by the context left."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from pdserve.cluster.config import RouterConfig
from pdserve.engine.checks import check_context, check_token_ids
from pdserve.engine.sampling_params import MAX_PROMPT_LOGPROBS, SamplingParams, StructuredOutput
from pdserve.frontend.chat_template import ChatTemplate
from pdserve.model.args import ModelArgs
from pdserve.model.errors import InvalidRequestError
from pdserve.model.tokenizer import THINK_END, THINK_START, Tokenizer

_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(text: str) -> bool:
    """Whether `text` holds a surrogate code point, which no UTF-8 encoder, tokenizer or response can carry
    (JSON can spell one, `"\\ud800"`; a proto string cannot)."""
    return not text.isascii() and _SURROGATE.search(text) is not None


MAX_REQUEST_ID_CHARS = 256
"""Longest client `request_id` accepted: it is echoed in every response chunk."""


def check_request_id(request_id: str) -> None:
    """Raises InvalidRequestError for a client `request_id` too long to echo (its text is never quoted)."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            "request_id", f"{len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling values a request inherits when it leaves them unset (from generation_config.json)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    @classmethod
    def from_file(cls, path: Path) -> GenerationDefaults:
        if not path.is_file():
            return cls()
        config = json.loads(path.read_text())
        greedy = config.get("do_sample") is False
        return cls(
            temperature=0.0 if greedy else float(config.get("temperature", 1.0)),
            top_p=float(config.get("top_p", 1.0)),
            top_k=int(config.get("top_k", 0)) or -1,
            min_p=float(config.get("min_p", 0.0)),
        )


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the router knows about the model it serves (it never loads the weights)."""

    name: str
    vocab_size: int
    max_model_len: int
    bos_token_id: int | None
    defaults: GenerationDefaults
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None = None
    thinks: bool = False
    """The chat template closes a think block and the vocabulary has both think tokens (DeepSeek-R1's and
    V3.1's format): `reasoning_parser: auto` splits reasoning from content for such a model, each request from
    where its rendered prompt leaves off (inside a think block or not)."""
    max_text_bytes: int | None = None
    """Bytes of prompt text past which it cannot fit the context, whatever it says (`text_bytes_bound`);
    None: no such bound is known for this tokenizer."""

    @classmethod
    def load(cls, model_dir: Path, name: str) -> ModelInfo:
        args = ModelArgs.from_json(model_dir / "config.json")
        tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        defaults = GenerationDefaults.from_file(model_dir / "generation_config.json")
        template = ChatTemplate.load(model_dir) if tokenizer is not None else None
        thinks = (
            template is not None
            and THINK_END in template.source
            and None not in (tokenizer.token_id(THINK_START), tokenizer.token_id(THINK_END))
        )
        max_text_bytes = None
        if tokenizer is not None:
            spec = json.loads((model_dir / "tokenizer.json").read_text())
            max_text_bytes = text_bytes_bound(spec, args.max_position_embeddings)
        return cls(
            name, args.vocab_size, args.max_position_embeddings, args.bos_token_id, defaults,
            tokenizer, template, thinks, max_text_bytes,
        )  # fmt: skip


_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Split", "Sequence", "Digits", "Punctuation")
"""Pre-tokenizers that split text without dropping any of it (Split unless its behavior is Removed)."""


def text_bytes_bound(spec: dict, max_model_len: int) -> int | None:
    """The most bytes of text that `max_model_len` tokens can cover, for a byte-level BPE tokenizer
    (tokenizer.json's `spec`) that keeps every input byte in some token: no normalizer, byte-level
    pre-tokenizing that drops nothing, no added token that strips the whitespace around it. Each token then
    covers at most as many input bytes as its own text has in UTF-8 (a byte-level symbol is one input byte,
    and at least one UTF-8 byte). None for any other tokenizer: its tokens may swallow unbounded input."""
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return None
    kinds, stack = [], [spec.get("pre_tokenizer") or {}]
    while stack:
        node = stack.pop()
        kinds.append(node.get("type"))
        if node.get("type") == "Split" and node.get("behavior") == "Removed":
            return None
        stack.extend(node.get("pretokenizers") or ())
    if "ByteLevel" not in kinds or any(k not in _KEEPING_PRE_TOKENIZERS for k in kinds):
        return None
    added = spec.get("added_tokens") or ()
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    texts = [*(spec["model"].get("vocab") or {}), *(t["content"] for t in added)]
    return max_model_len * max(len(t.encode()) for t in texts)


def prompt_bytes_limit(router: RouterConfig, model: ModelInfo) -> tuple[int, str]:
    """The most bytes of prompt text worth reading, and what sets it: router.max_prompt_bytes, or less when
    no longer text can fit the model's context (`ModelInfo.max_text_bytes`). Request bodies and messages are
    sized from it, so that a prompt that cannot be served is refused before it is parsed."""
    bound = model.max_text_bytes
    if bound is not None and bound < router.max_prompt_bytes:
        return bound, f"the most prompt text that fits the context of {model.max_model_len} tokens"
    return router.max_prompt_bytes, "router.max_prompt_bytes"


def check_prompt_bytes(
    text: str, router: RouterConfig, field: str, model: ModelInfo | None = None
) -> None:
    """Raises InvalidRequestError for prompt text over router.max_prompt_bytes, or too long to fit `model`'s
    context whatever its tokens (`ModelInfo.max_text_bytes`): checked before tokenizing, which costs a CPU
    second per few MiB."""
    # A character is 1 to 4 bytes of UTF-8: most texts are decided without encoding them (a few ms per MiB
    # with the GIL held).
    context_bound = None if model is None else model.max_text_bytes
    bound = min(router.max_prompt_bytes, context_bound or router.max_prompt_bytes)
    if 4 * len(text) <= bound:
        return
    if len(text) > bound:
        num_bytes, size = len(text), f"at least {len(text)} bytes"
    else:
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        size = f"{num_bytes} bytes"
    if num_bytes > router.max_prompt_bytes:
        raise InvalidRequestError(
            field,
            f"{size} of text; this server takes at most {router.max_prompt_bytes} "
            "(router.max_prompt_bytes)",
        )
    if context_bound is not None and num_bytes > context_bound:
        raise InvalidRequestError(
            field,
            f"{size} of text cannot fit the context of {model.max_model_len} tokens "
            f"({model.name}'s tokens cover at most {context_bound // model.max_model_len} bytes each)",
        )


MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids one request may give (each is checked on every generated token)."""


MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
"""Stop strings per request, and characters per stop string, at most (each is matched in every text delta)."""


def check_stop_strings(stop: list[str], model: ModelInfo, field: str) -> tuple[str, ...]:
    """The request's stop strings, or InvalidRequestError naming `field`: too many, empty or too long ones, or
    a model without a tokenizer (stop strings are matched in the text)."""
    if not stop:
        return ()
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(field, f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not 1 <= len(s) <= MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                field, f"stop string {i} has {len(s)} characters; 1 to {MAX_STOP_STRING_CHARS}"
            )
        if has_lone_surrogate(s):
            raise InvalidRequestError(field, f"stop string {i} holds a lone surrogate: not Unicode")
    if model.tokenizer is None:
        raise InvalidRequestError(
            field, f"{model.name} has no tokenizer.json: stop strings need one (use stop_token_ids)"
        )
    return tuple(stop)


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingRequest:
    """A request's sampling fields as its front end received them (None: unset), before defaults and checks."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    """Alternatives per token with log-probabilities (None: no log-probabilities)."""
    prompt_logprobs: int | None = None
    """Alternatives per prompt token with the prompt's log-probabilities (None: none; vLLM's
    prompt_logprobs, or OpenAI's echo with logprobs)."""
    skip_special_tokens: bool | None = None
    relaxed_acceptance: bool | None = None
    """Opt in to relaxed acceptance of MTP drafts inside the think block (a model that thinks)."""
    structured: StructuredOutput | None = None
    """The output's constraint, checked already (`pdserve.frontend.structured_outputs`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class FieldNames:
    """What a front end's protocol calls the request fields an error may name (by default, OpenAI's)."""

    prompt_text: str = "prompt"
    prompt_ids: str = "prompt"
    """Where token ids go (the same field as text in OpenAI's completions API)."""
    messages: str = "messages"
    sampling_prefix: str = ""
    """The prefix of the sampling fields that have no name of their own here (`sampling_params.` in gRPC)."""
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"
    """The parameter the number of log-probability alternatives came from (`top_logprobs` in OpenAI's chat
    API)."""
    n: str = "n"
    stop: str = "stop"


def check_n(n: int, router: RouterConfig, field: str) -> None:
    """Raises InvalidRequestError naming `field` unless 1 <= n <= router.max_n."""
    if n < 1:
        raise InvalidRequestError(field, f"must be >= 1, got {n}")
    if n > router.max_n:
        raise InvalidRequestError(
            field, f"{n} choices exceed this server's limit of {router.max_n} (router.max_n)"
        )


INT_RANGES: dict[str, tuple[int, int]] = {
    "max_tokens": (1, 2**32 - 1),
    "top_k": (-1, 2**31 - 1),
    "seed": (0, 2**63 - 1),
    "min_tokens": (0, 2**32 - 1),
    "logprobs": (0, 2**32 - 1),
    "prompt_logprobs": (0, 2**32 - 1),
}
"""The range of each integer sampling field, whichever front end it came through: the gRPC API's field widths
(int32 top_k, uint32 counts; the seed as the engine takes it). A value past its range is refused naming the
field before anything is packed for the workers (msgpack and torch take 64-bit integers at most)."""


def check_int_ranges(given: SamplingRequest, names: FieldNames = FieldNames()) -> None:
    """Raises InvalidRequestError naming the first integer sampling field of `given` outside `INT_RANGES`."""
    for name, (low, high) in INT_RANGES.items():
        value = getattr(given, name)
        if value is not None and not low <= value <= high:
            if name == "max_tokens":
                field = names.max_tokens
            else:
                field = names.logprobs if name == "logprobs" else names.sampling_prefix + name
            shown = f"{value}" if abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
            raise InvalidRequestError(field, f"must be in [{low}, {high}], got {shown}")


def sampling_params(
    given: SamplingRequest, num_prompt_tokens: int, model: ModelInfo, router: RouterConfig,
    names: FieldNames = FieldNames(),
) -> SamplingParams:  # fmt: skip
    """`given` with the model's defaults for unset fields and the router's default max_tokens (capped by the
    context left), checked. Errors name the field as the front end spells it (`names`)."""
    check_int_ranges(given, names)
    prefix, max_tokens_field = names.sampling_prefix, names.max_tokens
    room = model.max_model_len - num_prompt_tokens
    limit = min(router.max_tokens_limit or model.max_model_len, room)
    if given.max_tokens is not None:
        max_tokens = given.max_tokens
        if router.max_tokens_limit is not None and max_tokens > router.max_tokens_limit:
            raise InvalidRequestError(
                max_tokens_field,
                f"{max_tokens} exceeds this server's limit of {router.max_tokens_limit}",
            )
        check_context(num_prompt_tokens, max_tokens, model.max_model_len, max_tokens_field)
    else:
        max_tokens = min(router.default_max_tokens, limit)
    if given.stop_token_ids:
        if len(given.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"{prefix}stop_token_ids",
                f"{len(given.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}",
            )
        check_token_ids(given.stop_token_ids, model.vocab_size, f"{prefix}stop_token_ids")
    if given.structured is not None and given.structured.start_after is not None:
        field = f"{prefix}structured_output.start_after_token_id"
        check_token_ids([given.structured.start_after], model.vocab_size, field)
    for field, value in ((names.logprobs, given.logprobs), (
        prefix + "prompt_logprobs", given.prompt_logprobs
    )):  # fmt: skip
        if value is not None and value > router.max_logprobs:
            raise InvalidRequestError(
                field,
                f"{value} alternatives exceed this server's limit of {router.max_logprobs} "
                "(router.max_logprobs)",
            )
    if given.prompt_logprobs is not None:
        entries = num_prompt_tokens * (1 + given.prompt_logprobs)
        if entries > MAX_PROMPT_LOGPROBS:
            raise InvalidRequestError(
                prefix + "prompt_logprobs",
                f"{num_prompt_tokens} prompt tokens with {given.prompt_logprobs} alternatives each "
                f"exceed the {MAX_PROMPT_LOGPROBS} entries a request may ask for (prompt tokens x "
                "(1 + alternatives); echo with logprobs asks for them too)",
            )
    d = model.defaults
    relaxed_think_ids = None
    if given.relaxed_acceptance:
        if not model.thinks:
            raise InvalidRequestError(
                f"{prefix}relaxed_acceptance",
                f"{model.name} has no think block (its chat template and vocabulary have no "
                f"{THINK_START} ... {THINK_END}): relaxed acceptance applies inside one",
            )
        relaxed_think_ids = (
            model.tokenizer.token_id(THINK_START),
            model.tokenizer.token_id(THINK_END),
        )

    def either(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=either(given.temperature, d.temperature),
            top_p=either(given.top_p, d.top_p),
            top_k=either(given.top_k, d.top_k),
            min_p=either(given.min_p, d.min_p),
            seed=given.seed,
            stop_token_ids=tuple(given.stop_token_ids),
            ignore_eos=given.ignore_eos,
            presence_penalty=either(given.presence_penalty, 0.0),
            frequency_penalty=either(given.frequency_penalty, 0.0),
            repetition_penalty=either(given.repetition_penalty, 1.0),
            min_tokens=either(given.min_tokens, 0),
            logprobs=given.logprobs,
            prompt_logprobs=given.prompt_logprobs,
            skip_special_tokens=either(given.skip_special_tokens, True),
            relaxed_think_ids=relaxed_think_ids,
            structured=given.structured,
        ).with_seed()
    except InvalidRequestError as e:
        if e.field == "max_tokens":
            field = max_tokens_field
        else:
            field = names.logprobs if e.field == "logprobs" else prefix + e.field
        raise InvalidRequestError(field, str(e).removeprefix(f"{e.field}: ")) from None
