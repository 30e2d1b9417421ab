"""DeepSeek-V3/R1 at full size on one 8-GPU node: the Pareto curve of output tokens/s per GPU against tokens/s per
user, beside TensorRT-LLM's published points for DeepSeek-R1 FP8 on 8 H200s.

Steps, each printed as it starts: `pdserve plan` must accept the layout on these GPUs (their memory read from the
first one, or --gpu-memory-gib); `pdserve make-checkpoint --config-only` writes the V3 shape's config (61 layers +
MTP, fp8 experts; --layers cuts it for a dry run); `pdserve serve --model.load-format dummy` starts one aggregated
worker of attention-DP N + EP N, whose ranks make random weights of those shapes on their GPUs (no checkpoint on
disk); then, per scenario (ISL:OSL, greedy with ignore_eos), one closed-loop load per concurrency through
`benchmarks/serving.py` (gRPC), with max(--min-requests, --requests-per-slot x concurrency) requests. Writes
DIR/full_size.json (every point's summary, the plan, the commands) and DIR/full_size.png (the Pareto plot, one
line per scenario, TensorRT-LLM's points marked), and the server's log as DIR/serve.log.

--disaggregated instead asks `pdserve plan` whether N/2 GPUs hold the model for each of a prefill and a decode
worker, and on a fit serves 1P1D (TP prefill, DP + EP decode); FP8 DeepSeek-V3 does not fit 4 H200s, and the JSON
records the plan's refusal.

    python benchmarks/full_size.py --gpus 8                       # the sweep the issue asks for (8 GPUs)
    python benchmarks/full_size.py --gpus 2 --layers 4 --concurrency 1,8,64 --scenarios 1024:128   # dry run
    python benchmarks/full_size.py --gpus 8 --disaggregated       # 4 + 4: the plan's verdict (and run on a fit)
    python benchmarks/full_size.py --preset tiny --gpus 2 --gpu-memory-gib 80 --concurrency 1,4 \
        --scenarios 32:8 --out /tmp/fs -- --model.dtype fp32   # CPU smoke test of the script (gloo ranks)

The plot needs matplotlib (`pip install .[benchmarks]`); without it the JSON is still written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRTLLM_POINTS = [
    # DeepSeek-R1 FP8 on 8x H200, ISL 1K / OSL 2K (TensorRT-LLM's published figures)
    {"label": "TensorRT-LLM max throughput (DEP8)", "tokens_per_s_per_user": 11.3,
     "output_tokens_per_s_per_gpu": 1436.0, "scenario": "1024:2048"},
    {"label": "TensorRT-LLM min latency (batch 1, MTP)", "tokens_per_s_per_user": 158.0,
     "output_tokens_per_s_per_gpu": 158.0 / 8, "scenario": "1024:2048"},
]  # fmt: skip
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,128,256,512,1024"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli.main", *args]


def _step(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", flush=True)


def _gpu_memory_gib(given: float | None) -> float:
    if given is not None:
        return given
    import torch

    if not torch.cuda.is_available():
        sys.exit("no GPU here: give --gpu-memory-gib to plan, and run the sweep on the GPU host")
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def plan(preset: str, gpus: int, layers: int | None, memory_gib: float, extra: list[str]) -> dict:
    """`pdserve plan`'s verdict: {"fits": bool, "text": its output, "command": ...}."""
    cmd = _cli("plan", "--preset", preset, "--gpus", str(gpus),
               "--gpu-memory-gib", f"{memory_gib:.1f}", *extra)  # fmt: skip
    if layers is not None:
        cmd += ["--layers", str(layers)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    text = (out.stdout + out.stderr).strip()
    print(text)
    return {"fits": out.returncode == 0, "text": text, "command": " ".join(cmd[2:])}


def serve_command(args, model_dir: Path, max_context: int, max_running: int) -> list[str]:
    n = args.gpus
    cmd = _cli(
        "serve", "--model", str(model_dir), "--model.load-format", "dummy", "--port", str(args.port),
        "--decode.max-running", str(max_running), "--decode.warm-up-context", str(max_context),
    )  # fmt: skip
    if args.disaggregated:
        half = n // 2
        cmd += ["--prefill", "1", "--decode", "1",
                "--prefill.ranks", str(half), "--prefill.attention", "tensor",
                "--prefill.expert-parallel", str(half),
                "--decode.ranks", str(half), "--decode.attention", "data",
                "--decode.expert-parallel", str(half)]  # fmt: skip
    else:
        cmd += ["--prefill", "0", "--decode", "1", "--decode.ranks", str(n),
                "--decode.attention", "data", "--decode.expert-parallel", str(n)]  # fmt: skip
    return cmd + args.serve_args


def wait_until_serving(
    server: subprocess.Popen, port: int, timeout_s: float, log: Path, poll_s: int = 10
) -> None:
    """Returns once the server answers a 2-token request; exits naming the cause (with the log's last lines)
    as soon as the server process ends, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    ask = _cli("generate", "--addr", f"127.0.0.1:{port}", "--wait-s", str(poll_s),
               "--max-tokens", "2", "--prompt-ids", "0,5,9")  # fmt: skip
    while True:
        if server.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            sys.exit(
                f"pdserve serve exited (rc {server.returncode}) before it served; {log}:\n{tail}"
            )
        if subprocess.run(ask, capture_output=True, timeout=poll_s + 60).returncode == 0:
            return
        if time.monotonic() > deadline:
            sys.exit(f"pdserve serve is not serving after {timeout_s:.0f} s (see {log})")


def run_point(args, isl: int, osl: int, concurrency: int, vocab: int) -> dict:
    """One closed-loop load through benchmarks/serving.py; its summary."""
    requests = max(args.min_requests, args.requests_per_slot * concurrency)
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(HERE / "serving.py"), "--addr", f"127.0.0.1:{args.port}",
               "--concurrency", str(concurrency), "--num-requests", str(requests),
               "--warmup", str(min(concurrency, 8)), "--input-len", str(isl), "--output-len", str(osl),
               "--vocab", str(vocab), "--num-gpus", str(args.gpus),
               "--timeout", str(args.request_timeout_s)]  # fmt: skip
        done = subprocess.run(cmd, env={**os.environ, "OUT": out}, text=True, capture_output=True)
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            raise RuntimeError(
                f"serving.py failed at concurrency {concurrency} (rc {done.returncode})"
            )
        summary = json.loads(Path(out, "serving.json").read_text())
    summary["command"] = " ".join(cmd[1:])
    return summary


def plot(scenarios: dict[str, list[dict]], path: Path, title: str, full_depth: bool) -> bool:
    """The Pareto plot; TensorRT-LLM's points (the full model on 8 H200s) only beside a full-depth run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: the plot is skipped (pip install .[benchmarks])", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for name, points in scenarios.items():
        xs = [p["tokens_per_s_per_user"] or 0.0 for p in points]
        ys = [p["output_tokens_per_s_per_gpu"] for p in points]
        ax.plot(xs, ys, "o-", label=f"pdserve, ISL/OSL {name.replace(':', '/')}")
        for x, y, p in zip(xs, ys, points, strict=True):
            ax.annotate(str(p["concurrency"]), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)  # fmt: skip
    for ref in TRTLLM_POINTS if full_depth else []:
        xy = (ref["tokens_per_s_per_user"], ref["output_tokens_per_s_per_gpu"])
        ax.plot(*xy, "k*", markersize=11)
        ax.annotate(ref["label"], xy, textcoords="offset points", xytext=(-6, 8), fontsize=7,
                    ha="right" if xy[0] > 80 else "left")  # fmt: skip
    ax.set_yscale("log")  # per-GPU throughput spans batch 1 to batch 1024
    ax.set_xlabel("output tokens/s per user (1 / median TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the node (all serve)")
    p.add_argument(
        "--preset", default="v3-shape", choices=["v3-shape", "v2-lite-shape", "tiny"],
        help="the shape (tiny: a CPU smoke test of this script)",
    )  # fmt: skip
    p.add_argument("--layers", type=int, default=None, help="main layers (default: V3's 61)")
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="default: the first GPU's")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated")
    p.add_argument(
        "--scenarios", default="1024:2048,8192:1024", help="comma-separated ISL:OSL pairs"
    )
    p.add_argument("--requests-per-slot", type=int, default=2, help="requests = this x concurrency")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--request-timeout-s", type=float, default=3600.0)
    p.add_argument("--disaggregated", action="store_true", help="1P1D over N/2 + N/2 GPUs")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--startup-timeout-s", type=float, default=3600.0)
    p.add_argument("--out", default=os.environ.get("OUT", "full_size"), help="output directory")
    p.add_argument(
        "serve_args", nargs="*", help="more `pdserve serve` flags, after --",
    )  # fmt: skip
    args = p.parse_args()
    try:
        scenarios = [tuple(int(x) for x in s.split(":")) for s in args.scenarios.split(",")]
        concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error("--scenarios takes ISL:OSL pairs and --concurrency integers, comma-separated")
    if args.disaggregated and args.gpus % 2:
        p.error(f"--disaggregated splits the GPUs in two: --gpus {args.gpus} is odd")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "command": " ".join(["python", *sys.argv]), "gpus": args.gpus,
                    "preset": args.preset, "layers": args.layers or "all", "disaggregated": args.disaggregated,
                    "trtllm_points": TRTLLM_POINTS, "scenarios": {}}  # fmt: skip
    memory = _gpu_memory_gib(args.gpu_memory_gib)
    per_worker = args.gpus // 2 if args.disaggregated else args.gpus
    max_running = max(concurrency)
    _step(f"plan: {per_worker} GPUs of {memory:.0f} GiB a worker")
    record["plan"] = plan(
        args.preset, per_worker, args.layers, memory, ["--max-running", str(max_running)]
    )
    if not record["plan"]["fits"]:
        (out / "full_size.json").write_text(json.dumps(record, indent=2) + "\n")
        sys.exit(
            f"pdserve plan refuses {per_worker} GPUs a worker (see above); wrote {out}/full_size.json"
        )
    try:
        import torch

        record["device"] = torch.cuda.get_device_name(0)
    except Exception:  # the sweep itself needs no torch here
        record["device"] = None
    model_dir = out / f"{args.preset}-{args.layers or 'all'}-config"
    if not (model_dir / "config.json").is_file():
        _step(f"config of the {args.preset} shape to {model_dir}")
        cmd = _cli("make-checkpoint", str(model_dir), "--preset", args.preset, "--dtype", "fp8",
                   "--config-only")  # fmt: skip
        if args.layers is not None:
            cmd += ["--layers", str(args.layers)]
        subprocess.run(cmd, check=True)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    max_context = max(isl + osl for isl, osl in scenarios)
    serve = serve_command(args, model_dir, max_context, max_running)
    record["serve_command"] = " ".join(serve[2:])
    _step("serve: " + record["serve_command"])
    log = open(out / "serve.log", "w")  # noqa: SIM115 (held for the server's life)
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        start = time.monotonic()
        wait_until_serving(server, args.port, args.startup_timeout_s, out / "serve.log")
        record["startup_s"] = time.monotonic() - start
        _step(f"serving after {record['startup_s']:.0f} s")
        for isl, osl in scenarios:
            name = f"{isl}:{osl}"
            points = record["scenarios"][name] = []
            for c in concurrency:
                _step(f"ISL {isl} / OSL {osl}, concurrency {c}")
                summary = run_point(args, isl, osl, c, vocab)
                points.append(summary)
                print(f"  {summary['output_tokens_per_s_per_gpu']:.1f} output tok/s/GPU, "
                      f"{summary['tokens_per_s_per_user'] or 0:.1f} tok/s/user, TTFT p50 "
                      f"{summary['ttft_ms_p50'] or 0:.0f} ms, errors {summary['errors']}", flush=True)  # fmt: skip
                (out / "full_size.json").write_text(json.dumps(record, indent=2) + "\n")
    finally:
        server.terminate()
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    (out / "full_size.json").write_text(json.dumps(record, indent=2) + "\n")
    title = (f"{args.preset} ({record['layers']} layers, fp8 experts, dummy weights), "
             f"{args.gpus}x {record['device']}, "
             + ("1P1D" if args.disaggregated else f"DP{args.gpus} + EP{args.gpus} aggregated"))  # fmt: skip
    if args.layers is not None:
        title += "\na cut model: TensorRT-LLM's points (the full model on 8 H200s) left off"
    if plot(record["scenarios"], out / "full_size.png", title, args.layers is None):
        _step(f"wrote {out}/full_size.json and {out}/full_size.png")


if __name__ == "__main__":
    main()
