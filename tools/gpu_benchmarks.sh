#!/usr/bin/env bash
# The one-GPU figures still owed by the open issues, in one device call (each part under its own time limit, each
# log under $OUT, a summary at the end), on a host with no package index (.whl/: bash ../shared/offline-wheels.sh
# llguidance==1.9.1):
#   issue 45: the 32K shared prefix's TTFT and TPOT with the cache on and off; the host tier's restore bandwidth and
#             its TTFT at 32K; a 64K prompt chunked against one pass;
#   issue 44: the K = 3 verify step against a plain step at batch 1, and batch 32 at K = 3 (its graph capture);
#   issue 47: the structured-output mask's cost at batch 64 (v2-lite shape).
# Usage: bash tools/gpu_benchmarks.sh [PART ...]   (parts: prefix_cache host_tier long_prompt spec grammar_mask)
set -uo pipefail
out=${OUT:-build/gpu-benchmarks}
source tools/device_env.sh
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(prefix_cache host_tier long_prompt spec grammar_mask)
nvidia-smi --query-gpu=name --format=csv,noheader >"$out/summary.txt"
git rev-parse --short HEAD >>"$out/summary.txt" 2>/dev/null
cli() { python3 -m pdserve.cli.main "$@"; }
[ -d /tmp/v8 ] || cli make-checkpoint /tmp/v8 --preset v3-shape --layers 8 --dtype fp8 --config-only >"$out/ckpt.log" 2>&1
for part in "${parts[@]}"; do
  case $part in
    prefix_cache) step prefix_cache 170 python3 benchmarks/prefix_cache.py /tmp/v8 --prefix 32768 \
      --kv-cache-dtype fp8 --load-format dummy ;;
    host_tier) step host_tier 130 python3 benchmarks/host_tier.py /tmp/v8 --prefix 32768 --kv-cache-dtype fp8 \
      --load-format dummy ;;
    long_prompt) step long_prompt 120 python3 benchmarks/long_prompt.py /tmp/v8 --tokens 65536 --load-format dummy ;;
    spec) step spec 150 python3 benchmarks/speculative.py /tmp/v8 --load-format dummy --draft forced \
      --tokens 64 --batch 1,32 --drafts 0,3 --verify-steps ;;
    grammar_mask)
      [ -d /tmp/v2l ] || cli make-checkpoint /tmp/v2l --preset v2-lite-shape --config-only >"$out/ckpt_v2l.log" 2>&1
      step grammar_mask 170 python3 benchmarks/grammar_mask.py /tmp/v2l --batch 64 --load-format dummy \
        --train-vocab ;;
    *) echo "unknown part $part" >>"$out/summary.txt" ;;
  esac
done
cat "$out/summary.txt"
