"""Random JSON schemas whose every instance is finite, for the structured-output checks: objects of required
properties (no others), bounded strings, enums, integer ranges, booleans, nulls, consts, bounded arrays,
nested objects and anyOf unions. Bounded, because a model that never learned to close a string (the random
tiny model) must still reach the end before max_tokens: what makes its output parse is the mask alone.

Shared by benchmarks/structured_schemas.py (1,000 schemas) and the CI test of a few (tests/frontend)."""

from __future__ import annotations

import random
from typing import Any

_WORDS = (
    "name", "age", "city", "tags", "score", "items", "id", "kind", "note", "ok", "size", "color", "owner",
    "level", "unit", "title", "count", "flag", "code", "mode",
)  # fmt: skip
_ENUMS = (
    "red",
    "green",
    "blue",
    "small",
    "large",
    "yes",
    "no",
    "alpha",
    "beta",
    "ünïcode",
    "with space",
)


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("string", "string", "enum", "integer", "boolean", "null", "const"))
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 12)}
    if kind == "enum":
        return {"enum": rng.sample(_ENUMS, rng.randint(1, 4))}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "const":
        return {"const": rng.choice((1, "fixed", True, None))}
    return {"type": kind}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth > 0 and roll < 0.2:
        return _object(rng, depth - 1)
    if depth > 0 and roll < 0.35:
        return {"type": "array", "items": _value(rng, depth - 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}  # fmt: skip
    if roll < 0.45:
        return {"anyOf": [_leaf(rng), _leaf(rng)]}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    return {
        "type": "object",
        "properties": {n: _value(rng, depth) for n in names},
        "required": names,
        "additionalProperties": False,
    }


def random_schema(seed: int) -> dict[str, Any]:
    """Schema number `seed`: an object (depth up to 2) of required properties, every value bounded."""
    return _object(random.Random(seed), 2)


def validate(instance: Any, schema: dict[str, Any]) -> None:
    """Raises ValueError where `instance` does not satisfy `schema` (the keywords `random_schema` uses)."""
    import jsonschema

    try:
        jsonschema.validate(instance, schema)
    except jsonschema.ValidationError as e:
        raise ValueError(e.message) from None
