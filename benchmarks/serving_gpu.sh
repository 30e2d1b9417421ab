#!/usr/bin/env bash
# End to end on a GPU host: `pdserve serve` with one prefill and one decode worker (one GPU each), then
# benchmarks/serving.py against it, checking outputs against the offline path on the first GPU.
#
#   bash benchmarks/serving_gpu.sh [MODEL_DIR] [EXTRA SERVE FLAGS...]
#
# MODEL_DIR defaults to /tmp/v2l (made there as the v2-lite-shape random checkpoint when absent). Writes
# serve.log and serving.json under $OUT (default /tmp). Environment: REQUESTS (128), CONCURRENCY (64),
# INPUT_LEN (1024), OUTPUT_LEN (256), CHECK_N (8), INVARIANT (1: serve and check in batch-invariant mode),
# KV_CACHE_DTYPE (auto; fp8: serve and check on fp8 KV rows), BENCH_ARGS (more serving.py flags, e.g.
# "--request-rate 16 --warmup 0 --repeat 2 --goodput ttft:2000 tpot:30": the identical Poisson load twice
# right after SERVING).
set -euo pipefail
MODEL=${1:-/tmp/v2l}
shift || true
OUT=${OUT:-/tmp}
export OUT
INVARIANT=${INVARIANT:-1}
if [ ! -f "$MODEL/config.json" ]; then
    python -m pdserve.cli.main make-checkpoint "$MODEL" --preset v2-lite-shape --gen-device cuda
fi
KV_CACHE_DTYPE=${KV_CACHE_DTYPE:-auto}
flags=(--model.kv-cache-dtype "$KV_CACHE_DTYPE")
check=(--kv-cache-dtype "$KV_CACHE_DTYPE")
if [ "$INVARIANT" = 1 ]; then
    flags+=(--model.batch-invariant true)
    check+=(--batch-invariant)
fi
python -m pdserve.cli.main serve --model "$MODEL" --prefill 1 --decode 1 --gpus-per-worker 1 \
    --port 50051 --prefill.gpu-memory-fraction 0.3 --decode.gpu-memory-fraction 0.5 \
    "${flags[@]}" "$@" >"$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill -INT $SERVE 2>/dev/null; wait $SERVE || true; tail -n 5 "$OUT/serve.log"' EXIT
python -m pdserve.cli.main generate --wait-s 300 --max-tokens 8 "Hello" || {
    tail -n 40 "$OUT/serve.log"
    exit 1
}
python benchmarks/serving.py --num-requests "${REQUESTS:-128}" --concurrency "${CONCURRENCY:-64}" \
    --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}" --check-offline \
    --model "$MODEL" --dtype auto --device cuda:0 --check-n "${CHECK_N:-8}" "${check[@]}" ${BENCH_ARGS:-}
grep -E "stats|KV capacity|startup|pdserve serving" "$OUT/serve.log" | tail -n 4 || true
