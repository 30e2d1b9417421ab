#!/usr/bin/env bash
# One GPU round for fused_moe and fp8_gemm: GPU tests, parallel compile of the tuning candidates,
# the sweep, a per-kernel profile of fused_moe, an ncu pass over the fp8 GEMM at 8192^3 (NCU=1),
# then the benchmark table. Logs go to $OUT (at most 7 files).
#   bash benchmarks/gpu_round_moe_fp8.sh [sweep groups | none] [bench flags, e.g. --quick]
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
      >> "$OUT/compile.log" 2>&1 &
  done
  wait
  grep -h FAILED "$OUT/compile.log"
  timeout 150 python benchmarks/tune_moe_fp8.py --groups "$GROUPS_ARG" 2>&1 | tee "$OUT/tune.log"
fi
timeout 60 python benchmarks/tune_moe_fp8.py --profile > "$OUT/profile.log" 2>&1
grep -E "fused_moe|_kernel|Self CUDA time" "$OUT/profile.log" | head -30
if [ "${NCU:-0}" = 1 ]; then
  timeout 90 ncu --clock-control none -k regex:fp8_gemm -c 1 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis \
    python -c "
import torch
from pdserve.kernels.fp8_gemm import ref, triton as tri
x = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)
w, s = ref.quantize_weight(torch.randn(8192, 8192, device='cuda'))
xq, xs = tri._quantize(x, 128, scale_column_major=True)
tri.scaled_gemm(xq, xs, w, s); torch.cuda.synchronize()
" > "$OUT/ncu.log" 2>&1
  grep -E "Throughput|Warp Cycles|Achieved Occupancy|Registers|Stall|Issue Slot|Duration" "$OUT/ncu.log" | head -40
fi
timeout 200 python benchmarks/kernels.py --ops fused_moe,fp8_gemm ${2:-} 2>&1 | tee "$OUT/bench.log"
