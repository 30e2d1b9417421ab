"""`pdserve demo` (the README's first command) works on a fresh machine: it makes the tiny checkpoint in an empty
cache, starts its own local Ray and the server, streams generations and shuts down cleanly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# `pdserve demo` starts a Ray of its own
pytestmark = pytest.mark.ray


def test_demo_runs_from_an_empty_cache(tmp_path):
    # as from a fresh shell: no Ray address, nor the auth mode a ray.init in this process exported
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "demo", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("TTFT") == 3, out.stdout
    assert out.stdout.count("8 generated, finish_reason=length") == 3, out.stdout
    assert "0 KV pages in use after the demo" in out.stdout
    assert (tmp_path / "cache" / "pdserve" / "models").is_dir()
