"""The structured-output fields of an OpenAI request body as one `StructuredOutput`: OpenAI's
`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `json_object`, `regex`,
`choice`, `grammar`) and its older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`. A
request gives at most one constraint; each is checked here (`pdserve.engine.grammar.check`), so a schema,
regex or grammar the engine cannot use is refused with the field that carried it, before anything runs.
Pure Python and llguidance's checker: no I/O."""

from __future__ import annotations

import json
from typing import Any

from pdserve.engine.grammar import check
from pdserve.engine.sampling_params import StructuredOutput
from pdserve.model.errors import InvalidRequestError

__all__ = ["FIELDS", "IGNORED_OPTIONS", "parse"]

_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
IGNORED_OPTIONS = frozenset(
    {
        "disable_any_whitespace",
        "disable_fallback",
        "disable_additional_properties",
        "whitespace_pattern",
    }
)
"""vLLM's `structured_outputs` options for its grammar backends, accepted and ignored (JSON is always
generated compact here, by llguidance); listed as ignored when given. (Its top-level `guided_decoding_backend`
and `guided_whitespace_pattern` are ignored as any unknown name is.)"""
FIELDS = frozenset({"response_format", "structured_outputs", *_GUIDED})
"""The body fields that may carry a constraint."""


def _text(value: Any, kind: str, field: str) -> str:
    """A constraint's value as `StructuredOutput.text`."""
    if kind == "json_schema":
        if isinstance(value, str):
            return value
        if isinstance(value, dict | bool):
            return json.dumps(value)
        raise InvalidRequestError(field, "expected a JSON schema (an object, or a string of one)")
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise InvalidRequestError(field, "expected a non-empty list of strings")
        return json.dumps(value)
    if not isinstance(value, str):
        raise InvalidRequestError(field, "expected a string")
    return value


def _response_format(value: Any) -> tuple[StructuredOutput, str] | None:
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format", "expected an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object"), "response_format"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                "response_format.json_schema", "expected an object with a `schema`"
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            raise InvalidRequestError("response_format.json_schema.schema", "missing")
        field = "response_format.json_schema.schema"
        return StructuredOutput("json_schema", _text(schema, "json_schema", field)), field
    raise InvalidRequestError(
        "response_format.type", f"expected text, json_object or json_schema, got {kind!r:.80}"
    )


def _structured_outputs(value: Any, ignored: list[str]) -> list[tuple[StructuredOutput, str]]:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs", "expected an object")
    found = []
    for key, given in value.items():
        field = f"structured_outputs.{key}"
        if given is None or given is False:
            continue
        if key in _STRUCTURED:
            kind = _STRUCTURED[key]
            found.append((StructuredOutput(kind, _text(given, kind, field)), field))
        elif key == "json_object":
            if given is not True:
                raise InvalidRequestError(field, "expected true or false")
            found.append((StructuredOutput("json_object"), field))
        elif key in IGNORED_OPTIONS:
            ignored.append(field)
        else:
            raise InvalidRequestError(
                field, "unknown (expected json, json_object, regex, choice or grammar)"
            )
    return found


def parse(body: dict[str, Any], ignored: list[str]) -> StructuredOutput | None:
    """The request's constraint, checked, or None. Raises InvalidRequestError naming the field where one is
    malformed or not usable, or where two are given; adds the backend options it ignores to `ignored`."""
    found: list[tuple[StructuredOutput, str]] = []
    if body.get("response_format") is not None:
        given = _response_format(body["response_format"])
        if given is not None:
            found.append(given)
    if body.get("structured_outputs") is not None:
        found += _structured_outputs(body["structured_outputs"], ignored)
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((StructuredOutput(kind, _text(body[name], kind, name)), name))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(
            found[1][1], f"a request takes one structured output; {found[0][1]} gives one already"
        )
    structured, field = found[0]
    return check(structured, field)
