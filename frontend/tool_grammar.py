"""The grammar that makes a forced tool call parse: for `tool_choice: required` or a named function, the output
after the prompt's forced prefix (`ToolCallFormat.forced_prefix`), or where the model thinks first the output
after its think block, the forced prefix included, is constrained (`engine.grammar`, llguidance)
to what `ToolCallConstraint` describes: the calls, each naming one of the request's functions with arguments
that are compact JSON valid against that function's schema, then the end of the call block, then the end of
the sequence. `tool_choice: auto` leaves the model free to answer in text; but once it opens a call block
(writes TOOL_CALLS_BEGIN), the rest of the block is constrained the same way (`auto_call_grammar`: a grammar
that starts after that token), so a call the model chooses to make parses too."""

from __future__ import annotations

from collections.abc import Callable

from pdserve.engine.grammar import json_rule, lark_literal
from pdserve.engine.sampling_params import StructuredOutput
from pdserve.frontend.tool_request import ToolCallConstraint
from pdserve.model.tokenizer import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

_MARKERS = (TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN, TOOL_SEP, TOOL_CALL_END, TOOL_CALLS_END)


def _literal(text: str, token_id: Callable[[str], int | None]) -> str:
    """`text` as a Lark sequence, each call marker that is one token of the vocabulary as that token
    (`grammar.lark_literal`)."""
    ids = {m: token_id(m) for m in _MARKERS}
    return lark_literal(text, {m: i for m, i in ids.items() if i is not None})


def forced_call_grammar(
    constraint: ToolCallConstraint, token_id: Callable[[str], int | None], whole: bool = False
) -> StructuredOutput:
    """The Lark grammar of a forced call block's rest, as llguidance takes it; `token_id`: the vocabulary's id
    of a marker's text (None where it is no single token). The first call's text starts where the forced
    prefix ends: after the function's name where a function is named, else where the name begins; later
    calls (where `max_calls` is None, not 1) are whole, after the format's separator. whole: the block from
    its start, the forced prefix included (for an output that writes it itself, after its reasoning)."""
    if not constraint.forced:
        raise ValueError("only a forced tool call (required or named) is constrained")

    def lit(text: str) -> str:
        return _literal(text, token_id)

    fmt = constraint.format
    if constraint.max_calls not in (1, None):
        raise ValueError(
            f"max_calls={constraint.max_calls}: a call block holds one call or any number"
        )
    names = [constraint.named] if constraint.named is not None else sorted(constraint.schemas)
    tail, name_start = lit(fmt.call_tail()), len(fmt.call_head(None))
    rules, firsts, wholes = [], [], []
    for i, name in enumerate(names):
        rules.append(f"args_{i}: {json_rule(constraint.arguments_schema(name))}")
        # a named call's forced prefix ends where its arguments begin; a required one's where the name begins
        first = "" if constraint.named is not None else lit(fmt.call_head(name)[name_start:]) + " "
        firsts.append(f"{first}args_{i} {tail}")
        wholes.append(f"{lit(fmt.call_head(name))} args_{i} {tail}")
    lines = [f"first_call: {' | '.join(firsts)}"]
    more = ""
    if constraint.max_calls is None:
        joiner = lit("\n") + " " if fmt.typed else ""
        lines.append(f"next_call: {joiner}({' | '.join(wholes)})")
        more = " next_call*"
    opening = lit(fmt.forced_prefix(constraint.named)) + " " if whole else ""
    start = f"start: {opening}first_call{more} {lit(TOOL_CALLS_END)}"
    return StructuredOutput("grammar", "\n".join([start, *lines, *rules]))


def auto_call_grammar(
    constraint: ToolCallConstraint, token_id: Callable[[str], int | None]
) -> StructuredOutput | None:
    """For `tool_choice: auto`: the grammar of a call block after its opening TOOL_CALLS_BEGIN, which starts
    masking once the output writes that token (`StructuredOutput.start_after`): whole calls of the request's
    functions (one where `max_calls` is 1), then the block's end. None where TOOL_CALLS_BEGIN is no single
    token of the vocabulary (there is then no token to start after)."""
    if constraint.forced:
        raise ValueError("a forced call's grammar is forced_call_grammar's")
    begin = token_id(TOOL_CALLS_BEGIN)
    if begin is None:
        return None

    def lit(text: str) -> str:
        return _literal(text, token_id)

    fmt = constraint.format
    rules, wholes = [], []
    for i, name in enumerate(sorted(constraint.schemas)):
        rules.append(f"args_{i}: {json_rule(constraint.arguments_schema(name))}")
        wholes.append(f"{lit(fmt.call_head(name))} args_{i} {lit(fmt.call_tail())}")
    lines = [f"call: {' | '.join(wholes)}"]
    more = ""
    if constraint.max_calls != 1:
        joiner = lit("\n") + " " if fmt.typed else ""
        lines.append(f"next_call: {joiner}call")
        more = " next_call*"
    start = f"start: call{more} {lit(TOOL_CALLS_END)}"
    return StructuredOutput("grammar", "\n".join([start, *lines, *rules]), start_after=begin)
