#!/usr/bin/env bash
# Source this first in a device script (tools/gpu_tests.sh, gpu_benchmarks.sh, gpu2_benchmarks.sh), with $out set:
# installs the wheels of .whl/ (bash ../shared/offline-wheels.sh; the device host has no package index) into
# /tmp/site, imports this checkout as pdserve (tools/devenv.sh), keeps NVLink multicast off, and defines
# `step NAME SECONDS CMD...`: CMD under a time limit, its log at $out/NAME.log, its exit, time and last lines
# appended to $out/summary.txt.
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >"$out/install.log" 2>&1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
source tools/devenv.sh
export NCCL_NVLS_ENABLE=0
step() {
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" >>"$out/summary.txt"; local start=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "exit $? in $(( $(date +%s) - start )) s" >>"$out/summary.txt"
  tail -n "${STEP_TAIL:-25}" "$out/$name.log" >>"$out/summary.txt"
}
