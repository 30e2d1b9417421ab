#!/usr/bin/env bash
# The two-GPU figures and tests still owed by the open issues, in one device call on a 2-GPU kind (each part under
# its own time limit, each log under $OUT, a summary at the end), on a host with no package index (.whl/: see
# tools/gpu_tests.sh for the wheels):
#   issue 43/46: the multi_gpu tests (the NCCL transfer faults among them);
#   issue 46:    the NCCL transfer faults' recovery times;
#   issue 48:    the step profile by part against the CUDA-graph step, two-batch overlap against one batch, and
#                expert balancing under Zipf routing, and the exchanges side by side (the symmetric-memory one
#                among them) at 64-512 tokens a rank; with 4 GPUs: `--gpus 4` on the same command.
# Usage: bash tools/gpu2_benchmarks.sh [PART ...]   (parts: multi_gpu transfer_faults profile balance exchange)
set -uo pipefail
out=${OUT:-build/gpu2-benchmarks}
STEP_TAIL=30
source tools/device_env.sh
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(multi_gpu transfer_faults profile balance exchange)
nvidia-smi --query-gpu=name --format=csv,noheader >"$out/summary.txt"
git rev-parse --short HEAD >>"$out/summary.txt" 2>/dev/null
for part in "${parts[@]}"; do
  case $part in
    multi_gpu) step multi_gpu 200 python3 -m pytest -q -p no:cacheprovider -m multi_gpu tests ;;
    transfer_faults) step transfer_faults 120 python3 benchmarks/transfer_faults.py --backend nccl ;;
    profile) step profile 200 python3 benchmarks/decode_step_ranks.py --ranks 2 --layers 8 --batch 64,128 \
      --dispatch fp8 --steps 20 --profile 10 --two-batches ;;
    balance) step balance 170 python3 benchmarks/expert_balance.py --ranks 2 --layers 8 --batch 64,128 \
      --zipf 1.0 --spares 2 --steps 40 ;;
    exchange) step exchange 120 python3 benchmarks/expert_exchange.py --gpus 2 --tokens 64,128,256,512 --fp8 ;;
    *) echo "unknown part $part" >>"$out/summary.txt" ;;
  esac
done
cat "$out/summary.txt"
