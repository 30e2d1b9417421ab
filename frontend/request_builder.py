"""The one way a request becomes what the engine runs, whichever front end it came through: a front end translates
its wire shape (a GenerateRequest, an OpenAI JSON body) into a `RequestInput`, and `build_request` checks it and
returns a `CheckedRequest` (prompt token ids, `SamplingParams` with a concrete seed, stop strings, choices,
deadline) for `EngineClient.submit`. Every rejection is an InvalidRequestError naming the field as the request's
protocol spells it (`validation.FieldNames`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pdserve.cluster.config import RouterConfig
from pdserve.engine.checks import check_prompt_len, check_token_ids
from pdserve.engine.grammar import constrain
from pdserve.engine.sampling_params import SamplingParams
from pdserve.frontend.reasoning import prompt_opens_think
from pdserve.frontend.tool_grammar import auto_call_grammar, forced_call_grammar
from pdserve.frontend.tool_request import ToolCallPlan, ToolRequest, plan_tools, render_with_tools
from pdserve.frontend.validation import (
    FieldNames,
    ModelInfo,
    SamplingRequest,
    check_n,
    check_prompt_bytes,
    check_request_id,
    check_stop_strings,
    has_lone_surrogate,
    sampling_params,
)
from pdserve.model.errors import InvalidRequestError
from pdserve.model.tokenizer import THINK_END, TOOL_CALLS_BEGIN, Tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class RequestInput:
    """A generation request as a front end received it, in no protocol's shape and not yet checked: its prompt
    (one of text, token ids or chat messages), its sampling fields (None where unset), and what its protocol
    calls each field."""

    names: FieldNames = FieldNames()
    client_id: str = ""
    """The client's request id, only echoed back."""
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    """Chat messages (`role`, `content` text, optional `name`; an assistant's `tool_calls`, a tool's
    `tool_call_id`), rendered by the model's chat template."""
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    tools: ToolRequest | None = None
    """A chat request's tools (`tool_request.parse_tools`; None: none, or `tool_choice: none`)."""
    sampling: SamplingRequest = SamplingRequest()
    n: int = 1
    """Choices asked for."""
    stop: Sequence[str] = ()
    """Stop strings (matched in the generated text)."""
    deadline: float | None = None
    """The event loop's time() by which the request must finish, or None."""


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A request that passed every check at the router, ready for `EngineClient.submit`."""

    client_id: str
    prompt_ids: list[int]
    params: SamplingParams
    """With a concrete seed (choice i of n is seeded `derive_seed(params.seed, i)`)."""
    stop: tuple[str, ...]
    n: int
    deadline: float | None
    prompt_in_think: bool = False
    """The rendered chat prompt ends inside a think block it opened (DeepSeek-R1's template, V3.1's when asked
    to think): the output starts as reasoning (`reasoning.ReasoningSplitter`). False for other prompts."""
    tool_calls: ToolCallPlan | None = None
    """How the output's tool calls are parsed (None: they are not); its `constraint` is what a grammar mask
    enforces on the output (`tool_request.ToolCallConstraint`), its `forced_prefix` what `prompt_ids` end in."""


def build_request(given: RequestInput, model: ModelInfo, router: RouterConfig) -> CheckedRequest:
    """Checks `given` (its request id, n, prompt, sampling fields, stop strings, in that order) against the model
    and the router's limits, renders and tokenizes its prompt, and fills unset sampling fields with defaults.
    Raises InvalidRequestError naming the field in `given.names`. Tokenizing takes CPU: call it off the event
    loop."""
    names = given.names
    check_request_id(given.client_id)
    check_n(given.n, router, names.n)
    prompt_ids, in_think, tool_calls = _prompt_ids(given, model, router)
    params = sampling_params(given.sampling, len(prompt_ids), model, router, names)
    if tool_calls is not None and tool_calls.constraint.forced:
        # the arguments of a required or named call parse: its output is masked to the call block's grammar
        # (the whole block where the model thinks first, the rest of the forced prefix where it does not)
        grammar = forced_call_grammar(
            tool_calls.constraint, model.tokenizer.token_id, whole=not tool_calls.forced_prefix
        )
        params = constrain(params, grammar, "tool_choice")
    elif tool_calls is not None and params.structured is None and not params.ignore_eos:
        # auto: the answer is free, but a call block it opens is masked from its opening token on (not
        # where the output ignores EOS: a grammar ends it)
        grammar = auto_call_grammar(tool_calls.constraint, model.tokenizer.token_id)
        if grammar is not None:
            params = constrain(params, grammar, "tool_choice")
    unstarted = params.structured is not None and params.structured.start_after is None
    if in_think and unstarted and router.reasoning_parser != "none":
        params = _after_think(params, model.tokenizer)
    stop = check_stop_strings(list(given.stop), model, names.stop)
    return CheckedRequest(
        given.client_id, prompt_ids, params, stop, given.n, given.deadline, in_think, tool_calls
    )


def _after_think(params: SamplingParams, tokenizer: Tokenizer) -> SamplingParams:
    """`params` with its constraint (a structured output, a forced tool call) starting after the think block
    the prompt opened, where the vocabulary has its closing token: the reasoning is free and the answer after
    it parses (vLLM's reasoning parsers constrain the content alone). A server whose reasoning_parser is
    'none' answers with one content, so there the constraint starts at the first token, as vLLM's does
    without a reasoning parser."""
    think_end = tokenizer.token_id(THINK_END)
    if think_end is None:
        return params
    structured = dataclasses.replace(params.structured, start_after=think_end)
    return dataclasses.replace(params, structured=structured)


def _ids_instead(names: FieldNames) -> str:
    """How the protocol takes token ids, as an error's advice says it."""
    if names.prompt_ids == names.prompt_text:
        return f"{names.prompt_ids} as token ids"
    return names.prompt_ids


def _prompt_ids(
    given: RequestInput, model: ModelInfo, router: RouterConfig
) -> tuple[list[int], bool, ToolCallPlan | None]:
    """The prompt's token ids, whether it is a chat prompt that ends inside a think block, and its tools'
    plan."""
    names, in_think, plan, forced = given.names, False, None, ""
    if given.prompt_ids is not None:
        field, ids = names.prompt_ids, list(given.prompt_ids)
        check_token_ids(ids, model.vocab_size, field)
    else:
        chat = given.messages is not None
        field = names.messages if chat else names.prompt_text
        if not chat and given.prompt_text is None:
            raise InvalidRequestError(
                field, f"missing: set {names.prompt_text} (text) or {_ids_instead(names)}"
            )
        if not chat and not given.prompt_text:
            raise InvalidRequestError(field, "is empty")
        if model.tokenizer is None:
            raise InvalidRequestError(
                field, f"{model.name} has no tokenizer.json: send {_ids_instead(names)} instead"
            )
        if chat:
            if model.chat_template is None:
                raise InvalidRequestError(
                    field,
                    f"{model.name} has no chat template (tokenizer_config.json's chat_template)",
                )
            template, kwargs = model.chat_template, given.chat_template_kwargs
            if given.tools is None:
                text = template.render(given.messages, given.add_generation_prompt, kwargs)
            else:
                plan = plan_tools(given.tools, template)
                _check_markers_decode(model.tokenizer, given.sampling.skip_special_tokens)
                text = render_with_tools(
                    template, given.messages, given.tools, given.add_generation_prompt, kwargs
                )
            in_think = prompt_opens_think(text)
            reasons = router.reasoning_parser != "none"  # else the output is all content
            has_end = model.tokenizer.token_id(THINK_END) is not None
            if plan is not None and in_think and reasons and has_end:
                # A forced call comes after the reasoning: the output writes its call block itself once the
                # think block closes, masked from there (`_after_think`).
                plan = dataclasses.replace(plan, forced_prefix="")
            elif plan is not None and plan.forced_prefix:
                # A forced call comes at once: the prompt is extended by its start (a think block it opened
                # closed first, where the vocabulary has no think-end token to start a mask after).
                forced = (THINK_END if in_think else "") + plan.forced_prefix
                in_think = False
        else:
            text = given.prompt_text
        check_prompt_bytes(text, router, field, model)
        if has_lone_surrogate(text):
            raise InvalidRequestError(
                field, "holds a lone surrogate (\\ud800-\\udfff): not Unicode text"
            )
        # A rendered template writes its own BOS, as transformers assumes.
        ids = model.tokenizer.encode(text, add_bos=not chat)
        if forced:  # encoded apart: the prompt's own tokens stay as the template's text makes them
            ids += model.tokenizer.encode(forced, add_bos=False)
    check_prompt_len(len(ids), model.max_model_len, field)
    return ids, in_think, plan


def _check_markers_decode(tokenizer: Tokenizer, skip_special_tokens: bool | None) -> None:
    """Tool calls are read from the decoded text: a tokenizer that marks the call markers special (the tiny
    one does not) drops them there unless the request keeps special tokens."""
    marker = tokenizer.token_id(TOOL_CALLS_BEGIN)
    if skip_special_tokens is False or marker is None:
        return
    if tokenizer.decode([marker], skip_special_tokens=True) != TOOL_CALLS_BEGIN:
        raise InvalidRequestError(
            "tools",
            f"this model's tokenizer drops {TOOL_CALLS_BEGIN} from decoded text (a special token): "
            "send skip_special_tokens: false to have tool calls parsed",
        )
