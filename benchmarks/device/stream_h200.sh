#!/usr/bin/env bash
# Streamed training against preloaded, in one run (issue #34): two trainings of the quality recipe on a finished
# workflow's store, one after the other on the same GPU, equal steps: first with train.preload false (DataLoader
# workers read every step from the store; its files dropped from the page cache first, so the first epoch reads the
# disk), then preloaded. Each log's "training speed" line gives s/step and the GPU's gaps between steps.
#   CUDA_VISIBLE_DEVICES=0 bash benchmarks/device/stream_h200.sh RUN_DIR OUT [KEY=VALUE ...]
# RUN_DIR: a benchmarks/device/quality_run_h200.sh run (its results/store.zarr and configs), whole or stopped at its store
# (TARGET=results/store.zarr). KEY=VALUE: train keys for both (default epochs=1: ~1,190 steps, ~1.5 minutes each plus
# start-up). Each training's timing.json (first step, validation, data wait, GPU gaps, s/step) goes to
# RUN_DIR/results/stream_preload_{false,true}/.
set -euo pipefail
run=$(readlink -f "$1") out=$(readlink -f "$2")
shift 2
mkdir -p "$out"
configs=(config/config.yaml config/examples/smollm2-quality.yaml results/device_overlay.yaml)
configs+=($(cd "$run" && ls results/*.yaml | grep -v device_overlay || true))
for preload in false true; do
    [ $preload = false ] && python3 benchmarks/speed/evict_page_cache.py "$run/results/store.zarr"
    PYTHONPATH="$run/src:${PYTHONPATH:-}" python3 benchmarks/speed/train_variant.py --run "$run" --configfile "${configs[@]}" \
        --set preload=$preload epochs=1 log_every=100 "$@" --out "results/stream_preload_$preload" \
        >"$out/preload_$preload.log" 2>&1
    grep -h "training speed\|the preload took\|data loader\|first step" "$out/preload_$preload.log" || true
done
