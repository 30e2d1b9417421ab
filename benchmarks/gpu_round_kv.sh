#!/usr/bin/env bash
# One GPU round for the page-major KV cache and the in-place KV transfer, on two GPUs (nvidia-h200-x2); logs
# under $OUT. Run from the repository root after `source tools/devenv.sh`. Steps: the kvtransfer tests and the
# mla_decode GPU tests (a layer of a page-major cache included), the KV transfer benchmark (runs of pages and
# scattered pages), then on the v2-lite-shape random checkpoint (made at $V2L if missing) the two-GPU equality
# test, the CUDA-graph test and the decode step benchmark.
set -u
OUT=${OUT:-/tmp/kv_round}
V2L=${V2L:-/tmp/v2l}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  date -u
} 2>&1 | tee "$OUT/env.txt"
timeout 240 python -m pytest -q -p no:cacheprovider tests/kvtransfer tests/model/test_pages.py \
  tests/kernels/test_mla_decode.py 2>&1 | tee "$OUT/tests.txt" | tail -6
timeout 150 python benchmarks/kv_transfer.py --pages runs,scattered --chunk-mib 256,0 --gap-ms 0,10 \
  2>&1 | grep -v Warning | tee "$OUT/kv_transfer.txt" | tail -14
[ -d "$V2L" ] || python -m pdserve.cluster.cli make-checkpoint "$V2L" --preset v2-lite-shape \
  --gen-device cuda > "$OUT/make_checkpoint.txt" 2>&1
PDSERVE_V2LITE_DIR=$V2L timeout 240 python -m pytest -q -s -p no:cacheprovider \
  tests/workers/test_gpu_two_process.py tests/model/test_cuda_graphs.py 2>&1 | tee "$OUT/two_gpu.txt" \
  | tail -6
timeout 150 python benchmarks/decode_step.py "$V2L" --page-size 16 2>&1 | tee "$OUT/decode_step.txt" | tail -6
