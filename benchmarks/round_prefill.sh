#!/usr/bin/env bash
# One GPU round for the prefill-side kernels (run from the repo root on the device machine, after
# `source tools/devenv.sh`): benchmark table, GPU tests, launch-config sweep, an ncu profile of the
# mla_prefill kernel. Logs go to $OUT; each step has its own time limit so the round fits one call.
set -u
OUT=${OUT:-/tmp/prefill_round}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git_rev=$(cat .carry_commit 2>/dev/null || echo unknown)
echo "commit $git_rev"
timeout "${BENCH_S:-150}" python benchmarks/kernels.py --ops mla_prefill,sampling,moe_route \
  >"$OUT/bench.txt" 2>&1
echo "bench rc=$?"; tail -n 40 "$OUT/bench.txt"
timeout "${TEST_S:-120}" python -m pytest -q -m "${TEST_MARK:-gpu}" tests/kernels/test_mla_prefill.py \
  tests/kernels/test_sampling.py tests/kernels/test_moe_route.py >"$OUT/tests.txt" 2>&1
echo "tests rc=$?"; tail -n 8 "$OUT/tests.txt"
if [ -n "${TUNE_OPS:-}" ]; then
  timeout "${TUNE_S:-150}" python benchmarks/tune_prefill.py --ops "$TUNE_OPS" >"$OUT/tune.txt" 2>&1
  echo "tune rc=$?"; cat "$OUT/tune.txt"
fi
if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
  timeout "${NCU_S:-90}" ncu --clock-control none -k regex:_mla_prefill_kernel -c 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis python benchmarks/profile_mla_prefill.py >"$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occ|Stall|Issued|Block Limit|Shared Memory Config|Executed Ipc" "$OUT/ncu.txt" | head -40
fi
