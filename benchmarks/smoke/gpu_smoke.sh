#!/usr/bin/env bash
# The GPU smoke run (issue #32): the whole DAG from raw conversations on one GPU, as a user runs it — prepare,
# regenerate (decode steps as CUDA graphs), tokenize, extract, merge, train, evaluate (the drafter and a snapshot)
# and the report — from 400 ShareGPT first turns in a few minutes, with benchmarks/smoke/gpu_smoke.yaml over the quality
# example. Every change to a GPU code path (greedy, regenerate, extract, train, evaluate, speculative, drafter,
# store) passes it on a GPU before it is called done. Exits non-zero on any failure.
#   bash benchmarks/smoke/gpu_smoke.sh GGUF CONVERSATIONS MT_BENCH_QUESTIONS OUT_DIR [OVERLAY.yaml ...]
# OVERLAY files go over benchmarks/smoke/gpu_smoke.yaml, e.g. benchmarks/smoke/gpu_smoke_streamed.yaml: the fp8 store streamed to
# the training by loader workers instead of preloaded.
# GGUF, CONVERSATIONS (c1.parquet) and MT_BENCH_QUESTIONS: what benchmarks/device/device_carry.sh puts in .gpu/ (the GGUF in
# parts, joined with cat); on a machine without a package registry the wheels in .whl/ are installed first.
# OUT_DIR gets the report, the packed results and smoke.txt (stage times and the checks).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python3 -c "import snakemake, zarr, gguf" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
out=$(mkdir -p "$4" && cd "$4" && pwd)
export RUN_DIR=${RUN_DIR:-~/gpu_smoke}
began=$(date +%s)
status=0
bash benchmarks/device/quality_run_h200.sh "$1" "$2" "$3" "$out" 1 benchmarks/smoke/gpu_smoke.yaml "${@:5}" || status=$?
wall=$(($(date +%s) - began))
python3 benchmarks/smoke/gpu_smoke_check.py "$RUN_DIR/results" "$out" --wall-s "$wall" --workflow-status "$status" \
    | tee "$out/smoke.txt"
