"""The package layers point one way: kernels <- model <- engine <- {prefill, decode} <- cluster <- frontend <-
cli, with kvtransfer beside the engine (it knows torch.distributed and the page layout). A module may import its
own folder and the folders below it, never one above: read from the source, every import, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEVEL = {
    "protos": 0, "v1": 0, "kernels": 0, "model": 1, "kvtransfer": 2, "engine": 2,
    "prefill": 3, "decode": 3, "cluster": 4, "frontend": 5, "cli": 6,
}  # fmt: skip


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, first folder under pdserve) of every `pdserve.*` import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "pdserve" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


@pytest.mark.parametrize("folder", [f for f in LEVEL if (ROOT / f).is_dir() and f != "protos"])
def test_no_import_from_a_higher_folder(folder):
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports pdserve.{target}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, target in _imports(path)
        if LEVEL.get(target, 0) > LEVEL[folder]
    ]
    assert not wrong, "\n".join(wrong)


def test_every_module_is_named_in_its_folders_map():
    """Each product folder's (and engine/ranks') `__init__` docstring names each of its public modules and
    subfolders (a kernel op's own folder is the ref/triton/dispatch trio, and is not listed)."""
    missing = []
    for init in [*sorted(ROOT.glob("*/__init__.py")), ROOT / "engine" / "ranks" / "__init__.py"]:
        if init.parent.name in {"tests", "benchmarks", "tools", "deploy"}:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for module in sorted(init.parent.glob("*.py")) + sorted(init.parent.glob("*/__init__.py")):
            name = module.parent.name + "/" if module.name == "__init__.py" else module.stem
            if name == init.parent.name + "/" or name.startswith("_"):
                continue
            if f"`{name}" not in doc:
                missing.append(f"{init.relative_to(ROOT)} does not name {name}")
    assert not missing, "\n".join(missing)
