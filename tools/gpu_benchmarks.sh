#!/usr/bin/env bash
# One device call's benchmarks (issue 45's one-GPU targets, issue 44's verify step and the K=3 capture).
set -uo pipefail
out=${OUT:-build/bench}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >"$out/install.log" 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
source tools/devenv.sh
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/summary.txt"
python3 -m pdserve.cli.main make-checkpoint /tmp/v8 --preset v3-shape --layers 8 --dtype fp8 --config-only >"$out/ckpt.log" 2>&1
step() { name=$1; lim=$2; shift 2; echo "== $name: $*" >>"$out/summary.txt"; s=$(date +%s)
  timeout "$lim" "$@" >"$out/$name.log" 2>&1; echo "exit $? in $(( $(date +%s) - s )) s" >>"$out/summary.txt"
  tail -n 25 "$out/$name.log" >>"$out/summary.txt"; }
step prefix_cache 170 python3 benchmarks/prefix_cache.py /tmp/v8 --prefix 32768 --kv-cache-dtype fp8 --load-format dummy
step host_tier 130 python3 benchmarks/host_tier.py /tmp/v8 --prefix 32768 --kv-cache-dtype fp8 --load-format dummy
step long_prompt 120 python3 benchmarks/long_prompt.py /tmp/v8 --tokens 65536 --load-format dummy
step spec_capture 120 python3 benchmarks/speculative.py /tmp/v8 --load-format dummy --draft forced --tokens 64 --batch 32 --drafts 0,3 --verify-steps
cat "$out/summary.txt"
