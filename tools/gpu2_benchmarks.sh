#!/usr/bin/env bash
# The two-GPU figures and tests still owed by the open issues, in one device call on a 2-GPU kind (each part under
# its own time limit, each log under $OUT, a summary at the end), on a host with no package index (.whl/: see
# tools/gpu_tests.sh for the wheels):
#   issue 43/46: the multi_gpu tests (the NCCL transfer faults among them);
#   issue 46:    the NCCL transfer faults' recovery times;
#   issue 48:    the step profile by part against the CUDA-graph step, two-batch overlap against one batch, and
#                expert balancing under Zipf routing, and the exchanges side by side (the symmetric-memory one
#                among them) at 64-512 tokens a rank; with 4 GPUs: `--gpus 4` on the same command.
#   issue 47:    the prefill:decode ratio study, one sweep a device call (parts ratio-1p1d, ratio-0p2d and
#                ratio-1p1d-8k, ratio-0p2d-8k for ISL/OSL 8192/512; on 4 GPUs ratio-1p3d, ratio-2p2d, ratio-0p4d),
#                four rates each.
# Usage: bash tools/gpu2_benchmarks.sh [PART ...]   (parts: multi_gpu transfer_faults profile balance exchange
#        ratio-XpYd; the default: all but the ratio parts). A device call runs 600 s at most, so run them in
#        groups, one call each: `multi_gpu transfer_faults exchange`, then `profile`, then `balance`, then each
#        ratio part; build/ outputs stay on a warm machine between calls.
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
    profile) step profile 560 python3 benchmarks/decode_step_ranks.py --ranks 2 --layers 8 --batch 64,128 \
      --dispatch fp8 --steps 20 --profile 10 --two-batches --check ;;
    balance) step balance 560 python3 benchmarks/expert_balance.py --ranks 2 --layers 8 --batch 64,128 \
      --zipf 1.0 --spares 2 --steps 40 ;;
    exchange) step exchange 120 python3 benchmarks/expert_exchange.py --gpus 2 --tokens 64,128,256,512 --fp8 ;;
    ratio-*)  # one sweep of issue 47's ratio study a call (~6 min): ratio-LAYOUT (ISL/OSL 2048/256) or
      # ratio-LAYOUT-8k (8192/512); build/ratio-* persists between calls on a warm machine, and each call's
      # ratio.md reads every layout swept there so far
      spec=${part#ratio-}; layout=${spec%-8k}; isl=2048; osl=256
      [ "$spec" != "$layout" ] && isl=8192 && osl=512
      step "ratio-$layout-$isl" 560 env LAYOUTS="$layout" INPUT_LEN=$isl OUTPUT_LEN=$osl \
        RATES="${RATES:-8,16,24,32}" OUT="build/ratio-$isl" bash benchmarks/sweep_gpu.sh /tmp/v2l
      cp -r "build/ratio-$isl" "$out/" 2>/dev/null ;;
    *) echo "unknown part $part" >>"$out/summary.txt" ;;
  esac
done
cat "$out/summary.txt"
