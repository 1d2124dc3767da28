#!/usr/bin/env bash
# One polling call of a quality run left in the background on the lent device machine (quality_run_h200.sh, started
# with setsid nohup, its pid in ~/run.pid): prints the run's progress each minute and returns as soon as it has something new to bring back,
# or after LIMIT_S. A call brings back 64 MiB at most, so one thing a call: each training snapshot and then the final
# drafter as bf16 parts (pack_drafter_bf16.sh, ~40 MB) as soon as it is written, then, when the run has ended, what
# quality_run_h200.sh packed (quality.tgz, report.zip). Issue the next call at once: the machine is given back 30 s
# after a call ends, and the run with it.
#   bash benchmarks/device/poll_device_run.sh RUN_DIR RUN_OUT OUT [LIMIT_S]
# RUN_DIR: quality_run_h200.sh's RUN_DIR; RUN_OUT: its OUT_DIR; OUT: this call's $OUT. ~/.polled remembers what came back.
set -uo pipefail
run=$1 run_out=$2 out=$3 limit=${4:-560}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p ~/.polled "$out"
progress() {
    echo "--- $(date +%T) ${SECONDS}s"
    tail -n 2 "$run/results/quality_run.log" 2>/dev/null
    tail -n 1 "$run/results/logs/train.log" 2>/dev/null
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
}
while ((SECONDS < limit)); do
    # the exports are atomic: training.json is there only once the directory is whole
    for dir in "$run"/results/train/state/snapshots/*pct "$run"/results/train/snapshots/*pct "$run/results/drafter"; do
        name=$(basename "$dir")
        [ -f "$dir/training.json" ] && [ ! -e ~/.polled/"$name" ] || continue
        bash "$here/pack_drafter_bf16.sh" "$dir" "$out/$name" && touch ~/.polled/"$name"
        progress
        exit 0
    done
    if ! kill -0 "$(cat ~/run.pid)" 2>/dev/null; then
        cp "$run_out"/* "$out/" 2>/dev/null
        tail -n 5 "$run/results/quality_run.log"
        ls -l "$out"
        exit 0
    fi
    ((SECONDS % 60 < 10)) && progress
    sleep 10
done
progress
