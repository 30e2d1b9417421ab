#!/usr/bin/env bash
# One GPU round for the decode-side kernels, logs under $OUT: the device, the GPU tests, the benchmark
# table (benchmarks/kernels.py) and the mla_decode config sweep. Run from the repository root after
# `source tools/devenv.sh`. Usage: benchmarks/gpu_round_decode.sh [quick|full] [sweep|nosweep]
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
timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/tests.txt" | tail -25
bench_flag=$([ "${1:-quick}" = quick ] && echo --quick)
timeout 150 python benchmarks/kernels.py --ops mla_decode,rmsnorm,rope $bench_flag 2>&1 \
  | tee "$OUT/bench.txt"
if [ "${2:-sweep}" = sweep ]; then
  timeout 200 python benchmarks/tune_mla_decode.py --json "$OUT/sweep.json" 2>&1 | tee "$OUT/sweep.txt"
fi
