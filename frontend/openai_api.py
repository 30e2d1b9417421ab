"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions: a JSON body -> an
`OpenAIRequest` (its `RequestInput` for `request_builder`: the prompt, untokenized, the sampling fields and what
OpenAI calls them; and how to answer), and the response and stream-chunk objects.

Every parameter a client may send is either used; accepted only at the value that asks for nothing
(`best_of: 1`, `echo: false`, `logit_bias: {}`, ...) and otherwise refused with InvalidRequestError naming it;
or ignored, as vLLM ignores it: OpenAI's parameters that change nothing a model computes
(`openai_fields.IGNORED`: `store`, `metadata`, `service_tier`, ...; their types still checked) and names this
API does not know. An ignored name is listed in `OpenAIRequest.ignored`, which the HTTP server logs and
answers in a header. The values are checked by `request_builder`, as the gRPC API's are. Pure Python: no I/O,
no event loop."""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from pdserve.engine.messages import SpecCounts
from pdserve.engine.sampling_params import TokenLogprobs
from pdserve.frontend import structured_outputs
from pdserve.frontend.openai_fields import IGNORED, IGNORED_STREAM_OPTIONS
from pdserve.frontend.prompt_batch import MAX_CHOICES, completion_prompts
from pdserve.frontend.request_builder import RequestInput
from pdserve.frontend.tool_request import message_tool_fields, parse_tools
from pdserve.frontend.validation import FieldNames, SamplingRequest
from pdserve.model.errors import InvalidRequestError

COMPLETIONS, CHAT = "completions", "chat"

_UNSUPPORTED_HINT = "not supported by this server yet"
# Parameters accepted only at the value (or values) that asks for nothing; anything else is refused by name.
_INERT: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "continue_final_message": (None, False),
}
_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
    "stop", "stop_token_ids", "ignore_eos", "user", "logprobs", "n", "best_of", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "skip_special_tokens",
    "prompt_logprobs", "return_tokens_as_token_ids", "relaxed_acceptance",
    *structured_outputs.FIELDS,
}  # fmt: skip
_KNOWN = {
    COMPLETIONS: _COMMON | {"prompt", "echo", "suffix"},
    CHAT: _COMMON
    | {
        "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
        "parallel_tool_calls", "functions", "function_call",
        "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    },
}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A request whose JSON shape is checked: what to generate (`inputs`: one per prompt, each with exactly one
    of its three prompt fields set, its values checked by `request_builder.build_request`) and how to
    answer."""

    kind: str
    """COMPLETIONS or CHAT."""
    model: str | None
    inputs: tuple[RequestInput, ...]
    """One per prompt (several only for a completions request listing prompts), in the request's order; each
    without a client id: the server makes the response's id."""
    stream: bool
    include_usage: bool
    continuous_usage: bool = False
    """Every streamed chunk carries the usage so far (vLLM's `stream_options.continuous_usage_stats`, which
    takes effect with `include_usage`, as in vLLM)."""
    tokens_as_ids: bool = False
    """Log-probabilities name tokens `token_id:N` rather than by their text (vLLM's
    `return_tokens_as_token_ids`)."""
    ignored: tuple[str, ...] = ()
    """The parameters given and ignored (`IGNORED`, unknown names, `stream_options.` keys), in body order."""
    echo: bool = False
    """Completions: each choice's text (and, with `logprobs`, its log-probabilities) starts with its prompt's
    (`pdserve.frontend.echo`)."""
    prompt_only: bool = False
    """Completions with echo and `max_tokens: 0`: the choices are the prompts alone (the engine samples one
    token, which is dropped)."""
    prompt_logprobs: int | None = None
    """vLLM's `prompt_logprobs`: each choice's `prompt_logprobs` with this many alternatives per token."""

    @property
    def input(self) -> RequestInput:
        """The first prompt's (the only one's, but for a completions request listing several)."""
        return self.inputs[0]

    @property
    def n(self) -> int:
        """Choices asked for per prompt."""
        return self.input.n

    @property
    def num_choices(self) -> int:
        """Choices in the response: prompt i's choice j is choice i * n + j (prompt-major, as OpenAI's)."""
        return len(self.inputs) * self.input.n


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _optional(body: dict, name: str, check, expected: str):
    value = body.get(name)
    if value is not None and not check(value):
        raise InvalidRequestError(name, f"expected {expected}, got {value!r:.80}")
    return value


def _int_list(value) -> bool:
    return isinstance(value, list) and all(_is_int(x) for x in value)


def _is_inert(value, allowed: tuple) -> bool:
    for a in allowed:
        if a is None:
            if value is None:
                return True
        elif isinstance(value, bool) == isinstance(a, bool) and value == a:
            return True
    return False


def _check_inert(body: dict) -> None:
    for name, allowed in _INERT.items():
        if name in body and not _is_inert(body[name], allowed):
            raise InvalidRequestError(name, f"{body[name]!r:.80} is {_UNSUPPORTED_HINT}")


def _logprobs(body: dict, kind: str) -> tuple[int | None, str]:
    """The alternatives per token the request asks log-probabilities for (None: no log-probabilities), and the
    parameter that set it: the completions API's `logprobs` (an integer), or the chat API's `logprobs` (true
    or false) with `top_logprobs` (an integer, needing `logprobs: true`)."""
    if kind == COMPLETIONS:
        return _optional(body, "logprobs", _is_int, "an integer"), "logprobs"
    wanted = _optional(body, "logprobs", lambda v: isinstance(v, bool), "true or false")
    top = _optional(body, "top_logprobs", _is_int, "an integer")
    if top is not None and not wanted:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    return ((top or 0) if wanted else None), "top_logprobs"


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequestError("stop", f"expected a string or a list of strings, got {stop!r:.80}")


def _message_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"{where}.content[{i}]",
                    "only text parts ({'type': 'text', 'text': ...}) are supported",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"{where}.content", "expected a string or a list of text parts")


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(where, "expected an object with a role and content")
        message = {"role": m["role"], "content": _message_text(m.get("content"), where)}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message | message_tool_fields(m, where))
    return out


def parse(body: Any, kind: str) -> OpenAIRequest:
    """Checks a decoded JSON body of `kind`; every refusal names the parameter."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "expected a JSON object")
    ignored = []
    for name, value in body.items():
        if name in IGNORED:
            check, expected = IGNORED[name]
            _optional(body, name, check, expected)
            if value is not None:
                ignored.append(name)
        elif name not in _KNOWN[kind]:
            ignored.append(name)
    _check_inert(body)
    logprobs, logprobs_field = _logprobs(body, kind)
    echo = _optional(body, "echo", lambda v: isinstance(v, bool), "true or false") or False
    prompt_logprobs = _optional(body, "prompt_logprobs", _is_int, "an integer")
    if kind == CHAT and prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs", f"in chat completions is {_UNSUPPORTED_HINT}")
    model = _optional(body, "model", lambda v: isinstance(v, str), "a string")
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false") or False
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    include_usage = continuous_usage = False
    if options is not None:
        if not stream:
            raise InvalidRequestError("stream_options", "only allowed when stream is true")
        for key, value in options.items():
            flag = key in ("include_usage", "continuous_usage_stats", *IGNORED_STREAM_OPTIONS)
            if flag and value is not None and not isinstance(value, bool):
                raise InvalidRequestError(
                    f"stream_options.{key}", f"expected true or false, got {value!r:.80}"
                )
            if key == "include_usage":
                include_usage = bool(value)
            elif key == "continuous_usage_stats":
                continuous_usage = bool(value)
            elif value is not None:
                ignored.append(f"stream_options.{key}")
        continuous_usage = continuous_usage and include_usage
    structured = structured_outputs.parse(body, ignored)

    max_tokens_field = "max_tokens"
    max_tokens = _optional(body, "max_tokens", _is_int, "an integer")
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        max_tokens_field = "max_completion_tokens"
        max_tokens = _optional(body, "max_completion_tokens", _is_int, "an integer")
    prompt_only = echo and max_tokens == 0
    if prompt_only:
        max_tokens = 1  # sampled, then dropped: the engine's prefill always samples a token
    # the engine scores the prompt for vLLM's prompt_logprobs and for echo's logprobs, with the larger k
    scored = [k for k in (prompt_logprobs, logprobs if echo else None) if k is not None]
    sampling = SamplingRequest(
        max_tokens=max_tokens,
        temperature=_optional(body, "temperature", _is_number, "a number"),
        top_p=_optional(body, "top_p", _is_number, "a number"),
        top_k=_optional(body, "top_k", _is_int, "an integer"),
        min_p=_optional(body, "min_p", _is_number, "a number"),
        seed=_optional(body, "seed", _is_int, "an integer"),
        stop_token_ids=tuple(
            _optional(body, "stop_token_ids", _int_list, "a list of token ids") or ()
        ),
        ignore_eos=_optional(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false")
        or False,
        presence_penalty=_optional(body, "presence_penalty", _is_number, "a number"),
        frequency_penalty=_optional(body, "frequency_penalty", _is_number, "a number"),
        repetition_penalty=_optional(body, "repetition_penalty", _is_number, "a number"),
        min_tokens=_optional(body, "min_tokens", _is_int, "an integer"),
        logprobs=logprobs,
        prompt_logprobs=max(scored, default=None),
        skip_special_tokens=_optional(
            body, "skip_special_tokens", lambda v: isinstance(v, bool), "true or false"
        ),
        relaxed_acceptance=_optional(
            body, "relaxed_acceptance", lambda v: isinstance(v, bool), "true or false"
        ),
        structured=structured,
    )
    n = _optional(body, "n", _is_int, "an integer")
    n = 1 if n is None else n
    prompts: list[tuple[str | None, list[int] | None]] = [(None, None)]
    messages = None
    add_generation_prompt, template_kwargs, tools = True, {}, None
    if kind == COMPLETIONS:
        prompts = completion_prompts(body)
        if len(prompts) > 1 and len(prompts) * n > MAX_CHOICES:
            raise InvalidRequestError(
                "n",
                f"{len(prompts)} prompts x {n} choices; one request takes at most {MAX_CHOICES}",
            )
    else:
        messages = _messages(body)
        tools = parse_tools(body)
        add_generation_prompt = _optional(
            body, "add_generation_prompt", lambda v: isinstance(v, bool), "true or false"
        )
        add_generation_prompt = True if add_generation_prompt is None else add_generation_prompt
        template_kwargs = (
            _optional(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object")
            or {}
        )
    stop = _stop_strings(body)
    inputs = []
    for i, (prompt_text, prompt_ids) in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        names = FieldNames(
            prompt_text=where, prompt_ids=where, max_tokens=max_tokens_field,
            logprobs=logprobs_field,
        )  # fmt: skip
        inputs.append(
            RequestInput(
                names=names,
                prompt_text=prompt_text,
                prompt_ids=prompt_ids,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=template_kwargs,
                tools=tools,
                sampling=sampling,
                n=n,
                stop=stop,
            )
        )
    tokens_as_ids = _optional(
        body, "return_tokens_as_token_ids", lambda v: isinstance(v, bool), "true or false"
    )
    return OpenAIRequest(
        kind, model, tuple(inputs), stream, include_usage, continuous_usage,
        tokens_as_ids or False, tuple(ignored), echo, prompt_only, prompt_logprobs,
    )  # fmt: skip


# Responses.


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"


def usage(
    num_prompt_tokens: int, num_generated_tokens: int, stage_times: dict[str, float] | None = None,
    spec: SpecCounts | None = None, cached_tokens: int = 0,
) -> dict:  # fmt: skip
    """OpenAI's usage object (`prompt_tokens_details.cached_tokens`: the prompt tokens found in a prefix
    cache, the first choice's); with `stage_times` (pdserve's own key: `Timings.stage_dict`, the first choice's)
    where the request finished with timings, and `speculative` (pdserve's own key, as vLLM has none) where
    its decode steps verified drafts: `spec`, its choices' summed (`SpecCounts.total`)."""
    out: dict = {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_generated_tokens,
        "total_tokens": num_prompt_tokens + num_generated_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if stage_times is not None:
        out["stage_times"] = stage_times
    if spec is not None:
        out["speculative"] = {
            "draft_tokens": spec.drafted,
            "accepted_tokens": spec.accepted,
            "mean_accepted_length": spec.mean_accepted_length,
        }
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every response object and chunk of one request repeats."""

    id: str
    model: str
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def wrap(self, kind: str, choices: list[dict], **fields) -> dict:
        """A response object of `kind` (its `object` field) around `choices`."""
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **fields}


def _choice(finish_reason: str | None, index: int, logprobs: dict | None, **fields) -> dict:
    return {"index": index, **fields, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_choice(
    text: str, finish_reason: str | None, index: int = 0, logprobs: dict | None = None
) -> dict:
    return _choice(finish_reason, index, logprobs, text=text)


def completion(
    head: ResponseHead, text: str, finish_reason: str | None, index: int = 0,
    logprobs: dict | None = None, **fields,
) -> dict:  # fmt: skip
    """One chunk of a stream (or a whole completion of one choice: give `usage=`)."""
    return completions(head, [completion_choice(text, finish_reason, index, logprobs)], **fields)


def completions(head: ResponseHead, choices: list[dict], **fields) -> dict:
    """A whole completion of `completion_choice`s (give `usage=`)."""
    return head.wrap("text_completion", choices, **fields)


def chat_message(content: str, reasoning: str | None, tool_calls: list[dict] | None = None) -> dict:
    """The assistant message; `reasoning` None: no reasoning parser (the keys are left out); `tool_calls`
    None: no tools asked for (the key is left out), else the calls made (content null where none came
    before them)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["content"] = content or None
        message["reasoning_content"] = reasoning or None
        message["reasoning"] = reasoning or None
    if tool_calls:
        message["content"] = content or None
        message["tool_calls"] = tool_calls
    return message


def chat_choice(
    message: dict, finish_reason: str, index: int = 0, logprobs: dict | None = None
) -> dict:
    return _choice(finish_reason, index, logprobs, message=message)


def chat_completion(head: ResponseHead, choices: list[dict], usage_: dict) -> dict:
    """A whole chat completion of `chat_choice`s."""
    return head.wrap("chat.completion", choices, usage=usage_)


def chat_chunk(
    head: ResponseHead, delta: dict, finish_reason: str | None, index: int = 0,
    logprobs: dict | None = None, **fields,
) -> dict:  # fmt: skip
    return head.wrap(
        "chat.completion.chunk", [_choice(finish_reason, index, logprobs, delta=delta)], **fields
    )


def usage_chunk(head: ResponseHead, kind: str, usage_: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return head.wrap(
        "chat.completion.chunk" if kind == CHAT else "text_completion", [], usage=usage_
    )


# Log-probabilities. A token's text is what the front end's `token_text` makes of its id.


def token_id_text(token_id: int) -> str:
    """A token named by its id (`return_tokens_as_token_ids`, or a model without a tokenizer)."""
    return f"token_id:{token_id}"


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(
    token_ids: list[int], logprobs: list[TokenLogprobs], token_text: Callable[[int], str]
) -> dict:
    """The chat API's `logprobs` of a choice (or a chunk): per token its text, log-probability, UTF-8 bytes
    and its `top_logprobs` (the alternatives asked for, most likely first)."""
    content = []
    for token, lp in zip(token_ids, logprobs, strict=True):
        entry = _token_entry(token_text(token), lp.logprob)
        entry["top_logprobs"] = [
            _token_entry(token_text(t), v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
        ]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    token_ids: list[int], logprobs: list[TokenLogprobs], token_text: Callable[[int], str],
    text_offset: int,
) -> dict:  # fmt: skip
    """The completions API's `logprobs` of a choice (or a chunk): tokens, token_logprobs, top_logprobs (per
    token a map of the alternatives' texts, the sampled token's included, to their log-probabilities) and
    text_offset (where each token's text starts in the choice's text, from `text_offset` on)."""
    texts = [token_text(t) for t in token_ids]
    offsets, at = [], text_offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    top = []
    for token, text, lp in zip(token_ids, texts, logprobs, strict=True):
        alternatives = {token_text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
        if token not in lp.top_ids:
            alternatives[text] = lp.logprob
        top.append(alternatives)
    return {
        "tokens": texts,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }
