#!/usr/bin/env bash
# One GPU round for the decode-side kernels, logs under $OUT: the device, the GPU tests, the
# mla_decode config sweep, the benchmark table (benchmarks/kernels.py) and ncu profiles of the two
# mla_decode target shapes. Run from the repository root after `source tools/devenv.sh`.
# Usage: benchmarks/gpu_round_decode.sh [quick|full] [sweep|nosweep] [ncu|noncu]
set -u
OUT=${OUT:-/tmp/decode_round}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  [ -f COMMIT ] && cat COMMIT
  date -u
} 2>&1 | tee "$OUT/env.txt"
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/tests.txt" \
  | tail -8
if [ "${2:-sweep}" = sweep ]; then
  timeout 220 python benchmarks/tune_mla_decode.py --json "$OUT/sweep.json" 2>&1 \
    | tee "$OUT/sweep.txt"
fi
bench_flag=$([ "${1:-quick}" = quick ] && echo --quick)
timeout 150 python benchmarks/kernels.py --ops mla_decode,rmsnorm,rope $bench_flag 2>&1 \
  | tee "$OUT/bench.txt"
if [ "${3:-noncu}" = ncu ]; then
  for shape in "128 16 1 4096 0" "128 128 1 4096 0"; do
    name=ncu_$(echo "$shape" | tr ' ' '_').txt
    timeout 120 ncu --clock-control none --launch-skip 1 --launch-count 1 -k regex:split \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats --section ComputeWorkloadAnalysis \
      python benchmarks/profile_mla_decode.py $shape > "$OUT/$name" 2>&1
    echo "== $name"
    grep -E "split|Duration|Throughput|Registers Per|Shared Memory Config|Dynamic Shared|Achieved Occ|Theoretical Occ|Warp Cycles Per Issued|Executed Ipc A|Pipe" \
      "$OUT/$name" | head -30
  done
fi
