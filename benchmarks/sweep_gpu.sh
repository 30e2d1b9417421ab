#!/usr/bin/env bash
# The serving sweep and prefill:decode ratio study: on a host of N GPUs, each layout of LAYOUTS (default
# "1p1d 0p2d": disaggregated 1 prefill + 1 decode worker against aggregated 2 decode workers that prefill
# themselves; on four GPUs e.g. "1p3d 2p2d 0p4d") served by `pdserve serve` in turn, benchmarks/serving.py
# --sweep-rates against it (each request's latencies kept), then one plot of all (output tokens/s per GPU
# against tokens/s per user; goodput against rate) and benchmarks/ratio_study.py's table (the highest rate each
# layout holds within TTFT 2 s and TPOT 30 ms / 20 ms) in ratio.md.
#
#   bash benchmarks/sweep_gpu.sh [MODEL_DIR]
#   LAYOUTS="1p3d 2p2d 0p4d" INPUT_LEN=8192 OUTPUT_LEN=512 OUT=/tmp/ratio-8k bash benchmarks/sweep_gpu.sh
#
# MODEL_DIR defaults to /tmp/v2l (made there as the v2-lite-shape random checkpoint when absent). Writes
# sweep-<layout>.{json,png}, sweep.png, ratio.md, ratio.json and the servers' logs under $OUT (default
# build/sweep; the README's figure is copied to benchmarks/figures by hand). The plot needs matplotlib (`pip install .[benchmarks]`). Environment: RATES
# (4,8,16,24,32,40), DURATION (seconds measured per rate, 60) after WARMUP_S (10), INPUT_LEN (2048),
# OUTPUT_LEN (256), GOODPUT ("ttft:2000 tpot:30", the plot's), PROTOCOL (grpc or http), SERVE_ARGS (more
# `pdserve serve` flags for every layout), LAYOUTS.
set -euo pipefail
MODEL=${1:-/tmp/v2l}
OUT=${OUT:-build/sweep}
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
        --output-len "${OUTPUT_LEN:-256}" --num-gpus "${GPUS:-2}" --goodput ${GOODPUT:-ttft:2000 tpot:30} \
        --keep-latencies --sweep-out "$OUT/sweep-$name"
    kill -INT $SERVE
    wait $SERVE || true
    SERVE=""
}

plots=()
for layout in ${LAYOUTS:-1p1d 0p2d}; do  # XpYd: X prefill and Y decode workers of one GPU each
    [[ $layout =~ ^([0-9]+)p([0-9]+)d$ ]] || { echo "LAYOUTS: $layout is not XpYd" >&2; exit 2; }
    p=${BASH_REMATCH[1]} d=${BASH_REMATCH[2]}
    flags=(--prefill "$p" --decode "$d" --decode.gpu-memory-fraction 0.5)
    [ "$p" -gt 0 ] && flags+=(--prefill.gpu-memory-fraction 0.3)
    GPUS=$((p + d)) sweep "$layout" "${flags[@]}"
    kind=$([ "$p" -gt 0 ] && echo disaggregated || echo aggregated)
    plots+=("$OUT/sweep-$layout.json=$kind ${layout^^}")
done
python benchmarks/serving.py --plot-from "${plots[@]}" --sweep-out "$OUT/sweep"
python benchmarks/ratio_study.py "$OUT" | tee "$OUT/ratio.md"
