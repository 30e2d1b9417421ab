#!/usr/bin/env bash
# The GPU tests on a device host (no package index): installs the wheels of .whl/ (bash ../shared/offline-wheels.sh
# with the extras the README's GPU section names), imports this checkout as pdserve, and runs
#   1. tests/kernels in full (every shape sweep), one pytest-xdist run;
#   2. every test marked gpu, gpu_sweep or multi_gpu outside tests/kernels (multi_gpu ones skip on one GPU),
# both at once, each with its own log and JUnit file under $OUT (or build/gpu-tests), so that a run cut by a time
# limit still leaves what it did. Usage: bash tools/gpu_tests.sh [SECONDS_PER_PART]
set -uo pipefail
limit=${1:-500}
out=${OUT:-build/gpu-tests}
source tools/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$out/device.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >>"$out/device.txt"
common=(-p no:cacheprovider -q -rfEs --timeout 300)
timeout "$limit" python3 -m pytest "${common[@]}" -n 10 tests/kernels --junitxml="$out/kernels.xml" \
  >"$out/kernels.log" 2>&1 &
kernels=$!
timeout "$limit" python3 -m pytest "${common[@]}" -n 3 -m "gpu or gpu_sweep or multi_gpu" --ignore=tests/kernels \
  tests --junitxml="$out/model.xml" >"$out/model.log" 2>&1 &
model=$!
wait $kernels; echo "kernels exit $?" >>"$out/device.txt"
wait $model; echo "model exit $?" >>"$out/device.txt"
cat "$out/device.txt"
tail -n 15 "$out/kernels.log" "$out/model.log"
