"""A normal (non-editable) install ships the whole product: the wheel built from the tree, installed into a
fresh virtual environment, holds every module and data file of every product folder, each module imports
from there (not from the checkout), and the installed `pdserve` command makes the tiny checkpoint and
generates from it.

The fresh environment takes its dependencies (torch, ray, ...) from this interpreter's site-packages through
a `.pth` path line: installing them again would take minutes, and a path line adds the folder to `sys.path`
without running the `.pth` files in it, so this environment's editable install of pdserve stays out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

# its tests start processes of their own
pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
# Top-level folders that are not the product; every other folder holding Python code is.
NON_PRODUCT = frozenset({"tests", "benchmarks", "tools", "deploy", "build", "dist"})
# The generated gRPC stubs install as pdserve.v1, where their own imports look for them.
STUBS_DIR, STUBS_INSTALLED = "protos/pdserve/v1", "pdserve/v1"


def _tree_files() -> list[str]:
    """The files a fresh clone of this checkout would have (tracked, and new files not ignored)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(f for f in set(listed.split("\0")) if f and (ROOT / f).is_file())


def _installed_path(rel: str) -> str:
    """Where a product file of the tree lands under site-packages."""
    if rel.startswith(STUBS_DIR + "/"):
        return STUBS_INSTALLED + rel[len(STUBS_DIR) :]
    return "pdserve/" + rel


def _product_files(files: list[str]) -> list[str]:
    folders = {f.split("/")[0] for f in files if "/" in f and f.endswith(".py")}
    product = {d for d in folders if d not in NON_PRODUCT and not d.startswith(".")}
    return [f for f in files if f.split("/")[0] in product]


def _module_name(installed: str) -> str:
    parts = installed.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the fresh venv, its site-packages, an environment that sees neither the checkout nor PYTHONPATH)."""
    tmp = tmp_path_factory.mktemp("packaging")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"

    src = tmp / "src"
    for rel in _tree_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes((ROOT / rel).read_bytes())
    # No build isolation: the build backend comes from this environment (the test extras pin it),
    # so the build needs no index.
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(tmp / "wheel"), str(src)],
        cwd=tmp, env=env,
    )  # fmt: skip
    (wheel,) = (tmp / "wheel").glob("pdserve-*.whl")

    fresh = tmp / "venv"
    venv.EnvBuilder(with_pip=False).create(fresh)
    python = fresh / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp, env=env).strip())  # fmt: skip
    parent_sites = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "_parent_site.pth").write_text("".join(f"{p}\n" for p in parent_sites))
    _run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
         "--no-warn-script-location", str(wheel)],
        cwd=tmp, env=env,
    )  # fmt: skip
    return fresh, site, env


def test_the_wheel_holds_every_product_file(installed):
    _, site, _ = installed
    files = _product_files(_tree_files())
    assert any(f.startswith("kernels/") for f in files), "found no product files in the tree"
    missing = [f for f in files if not (site / _installed_path(f)).is_file()]
    assert not missing, f"the installed wheel lacks these files of the tree: {missing}"


def test_every_module_imports_from_the_installed_package(installed, tmp_path):
    fresh, site, env = installed
    modules = [_module_name(_installed_path(f)) for f in _product_files(_tree_files())
               if f.endswith(".py")]  # fmt: skip
    # Prints {module: its file, or the error its import raised}.
    script = (
        "import importlib, json, sys\n"
        "def load(m):\n"
        "    try:\n"
        "        return importlib.import_module(m).__file__\n"
        "    except Exception as e:\n"
        "        return {'error': f'{type(e).__name__}: {e}'}\n"
        "print(json.dumps({m: load(m) for m in sys.argv[1:]}))\n"
    )
    imported = json.loads(_run([str(fresh / "bin" / "python"), "-c", script, *modules],
                               cwd=tmp_path, env=env))  # fmt: skip
    failed = {m: f["error"] for m, f in imported.items() if isinstance(f, dict)}
    assert not failed, f"modules that fail to import from the installed wheel: {failed}"
    outside = {m: f for m, f in imported.items() if not Path(f).resolve().is_relative_to(site)}
    assert not outside, f"modules imported from outside the fresh venv: {outside}"


def test_the_installed_cli_makes_a_checkpoint_and_generates(installed, tmp_path):
    fresh, _, env = installed
    pdserve = str(fresh / "bin" / "pdserve")
    _run([pdserve, "make-checkpoint", str(tmp_path / "tiny"), "--preset", "tiny"], tmp_path, env)
    out = _run(
        [pdserve, "offline", "--model", str(tmp_path / "tiny"), "--prompt", "The quick brown fox",
         "--max-new-tokens", "4", "--ignore-eos", "--json"],
        tmp_path, env,
    )  # fmt: skip
    generated = json.loads(out.strip().splitlines()[-1])
    assert len(generated["token_ids"]) == 4, out
