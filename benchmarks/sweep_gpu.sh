#!/usr/bin/env bash
# The serving sweep on a two-GPU host, disaggregated (1 prefill + 1 decode worker) against aggregated (2 decode
# workers that prefill themselves): `pdserve serve` in each layout, then benchmarks/serving.py --sweep-rates
# against it, then one plot of both (output tokens/s per GPU against tokens/s per user; goodput against rate).
#
#   bash benchmarks/sweep_gpu.sh [MODEL_DIR]
#
# MODEL_DIR defaults to /tmp/v2l (made there as the v2-lite-shape random checkpoint when absent). Writes
# sweep-1p1d.{json,png}, sweep-0p2d.{json,png}, sweep.png and the servers' logs under $OUT (default
# benchmarks/figures). The plot needs matplotlib (`pip install .[benchmarks]`). Environment: RATES
# (4,8,16,24,32,40), DURATION (seconds measured per rate, 60) after WARMUP_S (10), INPUT_LEN (2048), OUTPUT_LEN (256), GOODPUT ("ttft:2000 tpot:30"),
# PROTOCOL (grpc or http), SERVE_ARGS (more `pdserve serve` flags for both layouts).
set -euo pipefail
MODEL=${1:-/tmp/v2l}
OUT=${OUT:-benchmarks/figures}
mkdir -p "$OUT"
if [ ! -f "$MODEL/config.json" ]; then
    python -m pdserve.cli.main make-checkpoint "$MODEL" --preset v2-lite-shape --gen-device cuda
fi
SERVE=""
trap '[ -n "$SERVE" ] && kill -INT $SERVE 2>/dev/null; wait || true' EXIT

sweep() {  # name, then the layout's `pdserve serve` flags
    local name=$1
    shift
    python -m pdserve.cli.main serve --model "$MODEL" --gpus-per-worker 1 --port 50051 --http-port 8000 \
        "$@" ${SERVE_ARGS:-} >"$OUT/serve-$name.log" 2>&1 &
    SERVE=$!
    python -m pdserve.cli.main generate --wait-s 600 --max-tokens 8 "Hello" >/dev/null || {
        tail -n 40 "$OUT/serve-$name.log"
        exit 1
    }
    # shellcheck disable=SC2086
    python benchmarks/serving.py --protocol "${PROTOCOL:-grpc}" --sweep-rates "${RATES:-4,8,16,24,32,40}" \
        --duration "${DURATION:-60}" --warmup-s "${WARMUP_S:-10}" --input-len "${INPUT_LEN:-2048}" \
        --output-len "${OUTPUT_LEN:-256}" --num-gpus 2 --goodput ${GOODPUT:-ttft:2000 tpot:30} \
        --sweep-out "$OUT/sweep-$name"
    kill -INT $SERVE
    wait $SERVE || true
    SERVE=""
}

sweep 1p1d --prefill 1 --decode 1 --prefill.gpu-memory-fraction 0.3 --decode.gpu-memory-fraction 0.5
sweep 0p2d --prefill 0 --decode 2 --decode.gpu-memory-fraction 0.5
python benchmarks/serving.py --plot-from "$OUT/sweep-1p1d.json=disaggregated 1P1D" \
    "$OUT/sweep-0p2d.json=aggregated 0P2D" --sweep-out "$OUT/sweep"
