"""Structured outputs' grammars: a request's constraint (`StructuredOutput`) as the grammar llguidance compiles
(`to_grammar`), checked before the request is admitted (`check`), and the calls other parts of the server make
to constrain a request (`constrain`, `constrain_json`, and `json_rule` for JSON inside a grammar: a tool call's
arguments). No torch: the router checks here; the runner's matchers and masks are
`pdserve.engine.grammar_masks`.

The grammar engine is llguidance rather than xgrammar. On a DeepSeek-sized (129K-token) byte-level vocabulary
on CPU, llguidance computes the token mask faster where most tokens are allowed (inside a JSON string, the
states a random model or free text spends its time in) and has no mask outliers of tens of milliseconds on
regular expressions with bounded repetitions; it builds a grammar lazily, so a new schema costs no compile
before its first token (xgrammar compiles each JSON schema, and each regex, up front, which stalls the
request); and it depends on nothing else (xgrammar brings transformers, triton and a TVM runtime). xgrammar
masks faster in the JSON states where few tokens are allowed; both stay within the forward pass's time.

JSON is generated compact (no whitespace between tokens): a free whitespace rule lets a model that has not
learned to stop (a random one) emit whitespace until max_tokens, and compact JSON is what a parser reads
anyway."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import llguidance

from pdserve.engine.sampling_params import SamplingParams, StructuredOutput
from pdserve.model.errors import InvalidRequestError

__all__ = [
    "MAX_SPEC_BYTES",
    "check",
    "constrain",
    "constrain_json",
    "json_rule",
    "lark_literal",
    "to_grammar",
]

MAX_SPEC_BYTES = 256 * 1024
"""The largest constraint text (schema, regex, choices, grammar) a request may carry: it travels with the
request to every worker and rank that samples it."""
_JSON_OPTIONS = {"whitespace_flexible": False}


def lark_literal(text: str, added_tokens: Mapping[str, int]) -> str:
    """`text` as a Lark sequence: each occurrence of an added token's text (`added_tokens`: text to id, e.g.
    `</think>`, a tool-call marker) as that token (`<[id]>`: llguidance holds an added token apart from the
    bytes of its text), the rest as string literals (JSON's escapes are Lark's)."""
    parts, rest = [], text
    while rest:
        at = {t: rest.find(t) for t in added_tokens if t and t in rest}
        token = (
            min(at, key=lambda t: (at[t], -len(t))) if at else None
        )  # the first, the longest there
        plain = rest if token is None else rest[: at[token]]
        if plain:
            parts.append(json.dumps(plain, ensure_ascii=False))
        if token is None:
            break
        parts.append(f"<[{added_tokens[token]}]>")
        rest = rest[at[token] + len(token) :]
    return " ".join(parts)


def to_grammar(structured: StructuredOutput, added_tokens: Mapping[str, int] | None = None) -> str:
    """The llguidance grammar of `structured` (not checked: see `check`). Raises ValueError where the text is
    not what its kind takes (a schema that is not JSON). added_tokens: the vocabulary's added tokens (text to
    id; not its special ones): a choice holding one's text takes that token there (`lark_literal`); other
    kinds spell such text in ordinary tokens (`grammar_masks`)."""
    kind, text = structured.kind, structured.text
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=_JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # each choice matches exactly its text
        choices = json.loads(text)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(lark_literal(c, added_tokens or {}) for c in choices)
        )
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF (llama.cpp, xgrammar) or Lark

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    raise ValueError(f"unknown structured output kind {kind!r}")


def check(structured: StructuredOutput, field: str) -> StructuredOutput:
    """Returns `structured` where llguidance compiles it; otherwise raises InvalidRequestError naming `field`
    with llguidance's reason (an unknown JSON-schema keyword, a bad regex, a grammar rule never defined)."""
    text = structured.text
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise InvalidRequestError(field, f"{len(text.encode())} bytes; at most {MAX_SPEC_BYTES}")
    if structured.kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise InvalidRequestError(field, f"not JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(field, "a JSON schema must be an object")
    if structured.kind == "choice":
        try:
            choices = json.loads(text)
        except ValueError:
            choices = None
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
    if structured.kind in ("regex", "grammar") and not text:
        raise InvalidRequestError(field, "must not be empty")
    try:
        error = llguidance.LLMatcher.validate_grammar(to_grammar(structured))
    except Exception as e:  # the converters raise on malformed input (a GBNF grammar's syntax)
        error = str(e) or type(e).__name__
    if error:
        raise InvalidRequestError(field, f"not usable as a {structured.kind}: {error.strip()}")
    return structured


def constrain(params: SamplingParams, structured: StructuredOutput, field: str) -> SamplingParams:
    """`params` with its output constrained to `structured`, checked (`check`): for callers that generate
    structured text themselves, e.g. tool calls. Raises InvalidRequestError naming `field` where the
    constraint is not usable, or where `params` is constrained already or ignores EOS."""
    if params.structured is not None:
        raise InvalidRequestError(field, "the request's output is constrained already")
    return dataclasses.replace(params, structured=check(structured, field))


def constrain_json(
    params: SamplingParams, schema: dict[str, Any] | bool, field: str
) -> SamplingParams:
    """`params` with its output constrained to compact JSON that `schema` validates, ending where the value
    ends (`constrain`)."""
    return constrain(params, StructuredOutput("json_schema", json.dumps(schema)), field)


def json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body matching compact JSON that `schema` validates (llguidance's `%json`), for a grammar
    that embeds JSON in other text, e.g. a tool call's arguments between the model's tool-call tokens:
    `StructuredOutput("grammar", 'start: "<call>" args "</call>"\\nargs: ' + json_rule(schema))`."""
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})
