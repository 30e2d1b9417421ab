"""The keys of a config section, read from its dataclass: each field's type and docstring (a YAML key and a
`--section.key` flag with its help), a nested field's keys flattened into its section, and a flag's text or a YAML
value checked against the field's type. `cluster.config` composes the sections and re-exports these."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

from pdserve.model.errors import ConfigError
from pdserve.model.parallel import WorkerLayout


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source), as one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


NESTED_FIELDS: dict[str, type] = {"layout": WorkerLayout}
"""Fields of a section whose own fields are that section's keys: `decode.ranks` (YAML key and flag) sets
`DecodeConfig.layout.ranks`. The nesting is the code's; users see one flat section."""


@dataclasses.dataclass(frozen=True, slots=True)
class SectionKey:
    """One key of a config section (a YAML key, a `--section.key` flag)."""

    annotation: str
    """The field's type as written (`int`, `float | None`, ...)."""
    doc: str
    """The field's docstring, as one line."""
    parent: str | None = None
    """The section's field that holds it (one of NESTED_FIELDS); None: a field of the section itself."""


@functools.cache
def section_keys(cls: type) -> dict[str, SectionKey]:
    """The keys of the section whose dataclass is `cls`, in field order, NESTED_FIELDS flattened in place."""
    keys: dict[str, SectionKey] = {}
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        nested = NESTED_FIELDS.get(f.name)
        if nested is None:
            keys[f.name] = SectionKey(str(f.type), docs.get(f.name, ""))
            continue
        nested_docs = field_docs(nested)
        for g in dataclasses.fields(nested):
            keys[g.name] = SectionKey(str(g.type), nested_docs.get(g.name, ""), f.name)
    return keys


def key_value(section: Any, name: str) -> Any:
    """The value of key `name` in a section's config object (looked up through NESTED_FIELDS)."""
    key = section_keys(type(section))[name]
    holder = section if key.parent is None else getattr(section, key.parent)
    return getattr(holder, name)


def replace_section(section: Any, values: dict[str, Any]) -> Any:
    """`section` with its keys set to `values`; a nested field's keys replace within that field."""
    keys = section_keys(type(section))
    own = {k: v for k, v in values.items() if keys[k].parent is None}
    for parent in {keys[k].parent for k in values} - {None}:
        nested = {k: v for k, v in values.items() if keys[k].parent == parent}
        own[parent] = dataclasses.replace(getattr(section, parent), **nested)
    return dataclasses.replace(section, **own)


def parse_value(text: str, annotation: str, where: str) -> Any:
    """A flag's text as the field's type (`int`, `float | None`, ...); `none` gives None where allowed."""
    kinds = [k.strip() for k in annotation.split("|")]
    if "None" in kinds and text.strip().lower() in ("none", "null", ""):
        return None
    kind = next(k for k in kinds if k != "None")
    try:
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return {"int": int, "float": float, "str": str}[kind](text)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{where}: expected {annotation}, got {text!r}") from e


def check_type(value: Any, annotation: str, where: str) -> Any:
    kinds = {k.strip() for k in annotation.split("|")}
    if value is None and "None" in kinds:
        return None
    if isinstance(value, bool):
        ok = "bool" in kinds
    elif isinstance(value, int):
        ok = "int" in kinds or "float" in kinds
        value = float(value) if "int" not in kinds and ok else value
    else:
        ok = type(value).__name__ in kinds
    if not ok:
        raise ConfigError(f"{where}: expected {annotation}, got {value!r}")
    return value
