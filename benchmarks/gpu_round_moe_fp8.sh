#!/usr/bin/env bash
# One GPU round for fused_moe and fp8_gemm: GPU tests, parallel compile of the tuning candidates,
# the sweep, then the benchmark table. Logs go to $OUT. Usage: bash benchmarks/gpu_round_moe_fp8.sh
#   [sweep groups (default: all; "none" skips the sweep)] [bench flags, e.g. --quick]
set -u
cd "$(dirname "$0")/.."
source tools/devenv.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
GROUPS_ARG=${1:-gemm_large,gemm_decode,moe_bf16_big,moe_fp8_big,moe_bf16_decode,moe_fp8_decode}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python -m pytest -q -m gpu tests/kernels -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
if [ "$GROUPS_ARG" != none ]; then
  for i in 0 1 2 3 4 5; do
    timeout 120 python benchmarks/tune_moe_fp8.py --groups "$GROUPS_ARG" --compile-only --part $i/6 \
      > "$OUT/compile_$i.log" 2>&1 &
  done
  wait
  grep -h FAILED "$OUT"/compile_*.log
  timeout 150 python benchmarks/tune_moe_fp8.py --groups "$GROUPS_ARG" 2>&1 | tee "$OUT/tune.log"
fi
timeout 150 python benchmarks/kernels.py --ops fused_moe,fp8_gemm ${2:-} 2>&1 | tee "$OUT/bench.log"
