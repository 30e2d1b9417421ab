#!/usr/bin/env bash
# Source this to import this checkout as `pdserve` without installing it (worktrees, the GPU host):
#   source tools/devenv.sh && python -m pytest tests/kernels
# It links each top-level package folder into a per-checkout shim directory and puts that on PYTHONPATH.
_pdserve_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_pdserve_shim=/tmp/pdserve-shim-$(printf %s "$_pdserve_root" | md5sum | cut -c1-10)
mkdir -p "$_pdserve_shim/pdserve"
for _d in "$_pdserve_root"/*/; do
  _n=$(basename "$_d")
  [ -f "$_d/__init__.py" ] && ln -sfn "$_pdserve_root/$_n" "$_pdserve_shim/pdserve/$_n"
done
# The generated gRPC stubs import as pdserve.v1 (pyproject maps pdserve.v1 to protos/pdserve/v1).
ln -sfn "$_pdserve_root/protos/pdserve/v1" "$_pdserve_shim/pdserve/v1"
export PYTHONPATH="$_pdserve_shim${PYTHONPATH:+:$PYTHONPATH}"
unset _d _n
