"""Test-wide settings: GPU markers skip where no CUDA device is present; on CPU-only machines Triton kernels run in
the interpreter (TRITON_INTERPRET=1 must be set before any kernel module is imported, hence here).

How the suite is split by need: every test that starts Ray or a server is marked `ray` here (those that use the
session's Ray through the `ray_cluster` fixture, and those whose module says it starts a Ray of its own with
`pytestmark = pytest.mark.ray`). Under pytest-xdist (`--dist loadgroup`) the tests on the session's Ray form one
group that one worker runs one after another, first, and those with a Ray of their own another, while the other
workers take every other test. Tests that start subprocesses (rank processes, two-process workers) are marked
`subprocess` by their modules: they run beside the others. `--durations-file PATH` writes each test's seconds
(setup + call + teardown) to PATH.

`gpu_sweep` marks a case of a shape sweep that runs only where a CUDA device is present: under the interpreter
one smallest case per code path (dtype x kernel variant) runs, and the case marked names, in a comment, the one
that takes its code path on CPU."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest

try:
    import torch

    _CUDA_DEVICES = torch.cuda.device_count()
except ImportError:  # pragma: no cover
    _CUDA_DEVICES = 0

if _CUDA_DEVICES == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The project root holds the `pdserve` package's subpackages (kernels, model, engine, ...), installed under
# `pdserve.`; on sys.path (`python -m pytest` puts the working directory there) they would shadow installed
# distributions of the same top-level names, e.g. HF `kernels`, which transformers imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
# HF `kernels` imported now, while no folder with a `kernels.py` (benchmarks/) can come first on sys.path: a test
# module that adds such a folder later then cannot change what transformers gets.
with contextlib.suppress(ImportError):
    import kernels as _hf_kernels  # noqa: F401


GPU_SWEEP_REASON = (
    "shape sweep: runs where CUDA is present; on CPU a smaller case takes its code path"
)

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


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """Marks and orders the items before every other plugin's hook runs (pytest-xdist's reads the xdist_group
    marks to name each item's group)."""
    for item in items:
        if "multi_gpu" in item.keywords and _CUDA_DEVICES < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2 CUDA GPUs"))
        elif "gpu" in item.keywords and _CUDA_DEVICES < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif "gpu_sweep" in item.keywords and _CUDA_DEVICES < 1:
            item.add_marker(pytest.mark.skip(reason=GPU_SWEEP_REASON))
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
    return (yield)


LOW_PRIORITY_NICE = 19
"""The niceness of a pytest-xdist worker while it runs a test that is not `ray`."""

if "PYTEST_XDIST_WORKER" in os.environ:
    # Ray starts its worker processes (our prefill and decode actors) at niceness 15 unless told otherwise: at 0
    # they keep the priority of the tests that start them over the CPU-bound tests beside them.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Four workers share the CI machine's two cores: a worker's torch computes on one thread (more only
    # contend, and OpenMP's spinning waits burn the cores the other workers need); what it starts inherits it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


def _renice(value: int) -> None:
    """Sets every thread of this process to niceness `value` (Linux keeps one per thread; new threads and
    processes inherit their creator's). Lowering it needs root; where it cannot, it stays as it was."""
    try:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile, or no right to lower it
            os.setpriority(os.PRIO_PROCESS, tid, value)


def pytest_runtest_setup(item):
    """Under pytest-xdist, the `ray` and `timed` tests (latency-bound: their servers, workers and timeouts wait on
    each other; the `timed` ones take little CPU) run at normal priority and the rest (CPU-bound) at a low one,
    so that the CPU-bound tests take only the cores the Ray chains leave idle instead of slowing them. Set before
    the test's fixtures: what they and the test start (rank processes, Ray, servers) inherits it."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        latency_bound = any(item.get_closest_marker(m) is not None for m in ("ray", "timed"))
        _renice(0 if latency_bound else LOW_PRIORITY_NICE)


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


# The serving fixtures, for every folder's tests; what they start is imported when they run, so that a test
# that needs none of it (a kernel's) never imports Ray.


@pytest.fixture(scope="session")
def ray_cluster():
    import logging

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from pdserve.model.random_checkpoint import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("ck") / "tiny", "tiny", dtype="fp32", progress=False
    )


@pytest.fixture(scope="session")
def reference_model(model_dir):
    """The tiny model loaded in the test process, for offline references."""
    from pdserve.model.loader import load_model

    return load_model(model_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def reference(reference_model):
    """Greedy tokens of `pdserve offline` (the single-process path) for (prompt, max_tokens), cached."""
    from pdserve.engine.offline import generate_greedy

    model = reference_model
    cache: dict = {}

    def expected(prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            cache[key] = generate_greedy(model, prompt, max_tokens)
        return cache[key]

    return expected


@pytest.fixture(scope="session")
def reference_logits(reference_model):
    """For (prompt, generated tokens): the model's raw logits [len(tokens) + 1, V] at each generated token's
    position and the next, from one forward of the model over prompt + tokens on a fresh cache."""
    from pdserve.engine.pages import pages_needed
    from pdserve.engine.runner import ModelRunner
    from pdserve.model.batch import SeqChunk, build_forward_batch

    model = reference_model

    def logits(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        ids = [*prompt, *tokens]
        page_size = 64
        num_pages = pages_needed(len(ids), page_size)
        cache = ModelRunner(model, page_size, num_pages, cuda_graphs=False).cache
        chunk = SeqChunk(ids, 0, list(range(num_pages)))
        with torch.inference_mode():
            hidden = model(build_forward_batch([chunk], page_size, "cpu", decode=False), cache)
            return model.compute_logits(hidden[len(prompt) - 1 :]).float()  # [T + 1, V]

    return logits


@pytest.fixture(scope="session")
def shared_server(ray_cluster, model_dir):
    """One tiny server for the tests that only send requests (and read status and metrics): one prefill and one
    decode worker, gRPC, HTTP and metrics on free ports. A test that kills, grows or stops its server, or needs
    another configuration, starts its own."""
    from serving import SHARED_PROMPT_BYTES, start_server

    router = {"http_port": 0, "metrics_port": 0, "max_prompt_bytes": SHARED_PROMPT_BYTES}
    with start_server(model_dir, router=router) as server:
        yield server
