"""Test-wide settings: GPU markers skip where no CUDA device is present; on CPU-only machines Triton kernels run in
the interpreter (TRITON_INTERPRET=1 must be set before any kernel module is imported, hence here).

How the suite is split by need: every test that starts Ray or a server is marked `ray` here (those that use the
session's Ray through the `ray_cluster` fixture, and those whose module says it starts a Ray of its own with
`pytestmark = pytest.mark.ray`). Under pytest-xdist (`--dist loadgroup`) the tests on the session's Ray form one
group that one worker runs one after another, first, and those with a Ray of their own another, while the other
workers take every other test. Tests
that start subprocesses (rank processes, two-process workers) are marked `subprocess` by their modules: they run
beside the others. `--durations-file PATH` writes each test's seconds (setup + call + teardown) to PATH."""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _CUDA_DEVICES = torch.cuda.device_count()
except ImportError:  # pragma: no cover
    _CUDA_DEVICES = 0

if _CUDA_DEVICES == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


RAY_FIXTURES = frozenset({"ray_cluster", "shared_server"})
"""Fixtures that start (or are) the session's Ray: a test using any of them is a `ray` test."""
RAY_GROUP = "ray"
"""The tests on the session's Ray: one worker runs them one after another."""
OWN_RAY_GROUP = "own-ray"
"""The tests that start a Ray of their own (a `pdserve serve` process, a simulated cluster): one after another
too, on another worker, beside the session's Ray."""


def pytest_addoption(parser):
    parser.addoption(
        "--durations-file", default=None, metavar="PATH",
        help="write each test's seconds (setup + call + teardown) and outcome to PATH, tab-separated",
    )  # fmt: skip


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "multi_gpu" in item.keywords and _CUDA_DEVICES < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))
        elif "gpu" in item.keywords and _CUDA_DEVICES < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
        elif item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.xdist_group(OWN_RAY_GROUP))
    # The ray groups first, so that their workers start on the longest chains at once; a module's tests stay
    # together.
    items[:] = [i for i in items if "ray" in i.keywords] + [
        i for i in items if "ray" not in i.keywords
    ]


class _Durations:
    """Collects each test's phases on the controlling process (xdist workers report there) and writes them out."""

    def __init__(self, path: str):
        self.path = path
        self.seconds: dict[str, float] = {}
        self.outcome: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.when == "call" or report.outcome != "passed":
            self.outcome[report.nodeid] = report.outcome

    def pytest_sessionfinish(self, session):
        from pathlib import Path

        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        path.write_text(
            "".join(f"{s:.2f}\t{self.outcome.get(n, 'passed')}\t{n}\n" for n, s in rows)
        )


def pytest_configure(config):
    path = config.getoption("--durations-file")
    if path and not hasattr(config, "workerinput"):  # the controller only (or a run without xdist)
        config.pluginmanager.register(_Durations(path), "pdserve-durations")


@pytest.fixture(scope="session")
def v2lite_dir(tmp_path_factory):
    """A v2-lite-shape bf16 checkpoint for GPU tests: $PDSERVE_V2LITE_DIR, or made on the GPU once a session."""
    from pathlib import Path

    from pdserve.model.random_checkpoint import make_checkpoint

    path = os.environ.get("PDSERVE_V2LITE_DIR")
    if path:
        return Path(path)
    out = tmp_path_factory.mktemp("ck") / "v2l"
    return make_checkpoint(out, "v2-lite-shape", dtype="bf16", device="cuda", progress=False)


# The serving fixtures (a session's local Ray, the tiny checkpoint, offline references), for every folder's tests.
from serving import (  # noqa: E402, F401
    model_dir,
    ray_cluster,
    reference,
    reference_logits,
    reference_model,
    shared_server,
)
