"""What the wheel ships, found from the tree so that a new folder ships without a list to keep up.

Every top-level folder with an `__init__.py` (other than the non-product ones below) installs as
`pdserve.<folder>` with all its subpackages and every non-Python file inside it (the tokenizer corpus,
`.proto` files, the stubs' `.pyi`): `pdserve` itself is a namespace package, so nothing installs under
a bare top-level name. The generated gRPC stubs in `protos/pdserve/v1` install as `pdserve.v1`, where
their own imports look for them. The rest of the metadata is in pyproject.toml;
tests/test_packaging.py installs the built wheel and checks it against the tree.
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
NAMESPACE = "pdserve"
# Folders that may hold Python packages but are not part of the product.
NON_PRODUCT = frozenset({"tests", "benchmarks", "tools", "deploy", "build", "dist"})
# The generated stubs import each other as pdserve.v1.*.
STUBS = ("v1", "protos/pdserve/v1")


def _product_folders() -> list[str]:
    return sorted(
        p.name
        for p in ROOT.iterdir()
        if p.is_dir()
        and not p.name.startswith(".")
        and p.name not in NON_PRODUCT
        and (p / "__init__.py").is_file()
    )


def _package_tree(package: str, folder: str, skip: set[str]) -> dict[str, list[str]]:
    """{package name: its non-Python files} for `folder` and every folder below it but those in `skip`.
    Every folder is a package, data folders too (`pdserve.model.data`): setuptools treats any folder
    Python can import as a package, and a file list per folder keeps to what the tree holds."""
    tree = {}
    for path, dirs, files in os.walk(ROOT / folder):
        rel = Path(path).relative_to(ROOT)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d != "__pycache__" and (rel / d).as_posix() not in skip
        )
        name = ".".join((package, *Path(path).relative_to(ROOT / folder).parts))
        tree[name] = sorted(
            f for f in files if not f.startswith(".") and not f.endswith((".py", ".pyc"))
        )
    return tree


def _layout() -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """(packages, package_dir, package_data) for setuptools."""
    package_dir = {f"{NAMESPACE}.{name}": name for name in _product_folders()}
    package_dir[f"{NAMESPACE}.{STUBS[0]}"] = STUBS[1]
    tree = {}
    for package, folder in package_dir.items():
        tree |= _package_tree(package, folder, skip=set(package_dir.values()) - {folder})
    return sorted(tree), package_dir, {name: files for name, files in tree.items() if files}


packages, package_dir, package_data = _layout()
setup(packages=packages, package_dir=package_dir, package_data=package_data)
