#!/usr/bin/env bash
# Issue #53's equal-GPU-minutes arms on the lent GPU (H200 or H100), one background job: the step ratio measured alone
# on this card first (train_step_speed.py --architectures dflash dflash2; before it, with .base/ carried, the same on
# the code before a change: old against new on one warm card), then equal_minutes_overlays.py turns it into the two
# arms' train.steps, then arms_h200.sh trains them in turns on one store (eqmin_dflash2: DFlash's minutes,
# eqmin_dflash: DFlash2's), trained only, and, once the first arm's training starts (its store merged: no extraction
# beside it, for memory on an H100), the GPU smoke run of DFlash2 beside them in its own folder. The arms are defined
# by their steps, so the smoke run beside them changes nothing they measure.
#   PYTHONPATH=/tmp/site bash benchmarks/device/equal_minutes_h200.sh start GGUF S2 QUESTIONS C1
#   PYTHONPATH=/tmp/site bash benchmarks/device/equal_minutes_h200.sh poll OUT [LIMIT_S]
# start: ~/eqmin/ gets step_before.txt (with .base/: PYTHONPATH=.base/src, --configfile .base/config/...),
# step_after.txt, overlays/, sequence.log, smoke.log and smoke/ (gpu_smoke.sh's OUT_DIR).
# poll: arms_h200.sh poll (the arms' results and drafter parts, 7 files at most) again and again while the sequence
# goes on and LIMIT_S (default 540) allows, then ~/eqmin's logs as OUT/eqmin.tgz (with smoke/ once the sequence has
# ended). Call it back to back until it prints "sequence ended" and no parts are left to ship.
set -uo pipefail
self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."
mode=$1
shift
steps() {  # the trainer's whole step of each architecture, alone on the GPU
    python3 benchmarks/speed/train_step_speed.py --device cuda --architectures dflash dflash2 --repeats 2 \
        --warmup 1 "$@"
}
has_ratio() { grep -q '^dflash2 / dflash: s/step' ~/eqmin/step_after.txt 2>/dev/null; }  # ran to its end
if [ "$mode" = start ]; then
    [ $# -eq 4 ] || { echo "start: GGUF S2 QUESTIONS C1" >&2; exit 2; }
    mkdir -p ~/eqmin && find ~/eqmin -mindepth 1 -maxdepth 1 ! -name 'step_*.txt' -exec rm -rf {} +  # a ratio stays
    setsid nohup bash "$self" sequence "$@" >~/eqmin/sequence.log 2>&1 &
    echo $! >~/eqmin/sequence.pid
    echo "equal minutes: pid $(cat ~/eqmin/sequence.pid); log ~/eqmin/sequence.log"
    exit 0
fi
if [ "$mode" = sequence ]; then
    gguf=$1 s2=$2 questions=$3 c1=$4
    for packed in "$s2"/*.jsonl.gz; do [ -e "$packed" ] && [ ! -e "${packed%.gz}" ] && gunzip -k "$packed"; done
    if has_ratio; then
        echo "$(date +%T) step ratio of an earlier start kept: $(grep '^dflash2 / dflash' ~/eqmin/step_after.txt)"
    elif [ -d .base/src ]; then
        echo "$(date +%T) step benchmark, code before (.base/)"
        PYTHONPATH=.base/src:${PYTHONPATH:-} steps --configfile .base/config/config.yaml \
            .base/config/examples/smollm2-varied.yaml >~/eqmin/step_before.txt 2>&1
    fi
    if ! has_ratio; then
        echo "$(date +%T) step benchmark, this code"
        PYTHONPATH=src:${PYTHONPATH:-} steps >~/eqmin/step_after.txt 2>&1 || { echo "step benchmark failed"; exit 1; }
    fi
    python3 benchmarks/quality/equal_minutes_overlays.py ~/eqmin/step_after.txt --out ~/eqmin/overlays || exit 1
    o=benchmarks/overlays e=~/eqmin/overlays
    echo "$(date +%T) arms"
    RECIPE=config/examples/smollm2-varied.yaml TARGET=results/drafter bash benchmarks/device/arms_h200.sh turns \
        "$gguf" "$s2" "$questions" \
        eqmin_dflash2=$o/cut_equal_steps.yaml,$o/seed_1.yaml,$o/dflash2.yaml,$e/equal_minutes_dflash2.yaml \
        eqmin_dflash=$o/cut_equal_steps.yaml,$o/seed_1.yaml,$e/equal_minutes_dflash.yaml
    until [ -e ~/arms/shared/results/logs/train.log ]; do
        kill -0 "$(cat ~/arms/turns.seq)" 2>/dev/null || { echo "the arms ended before training"; exit 1; }
        sleep 10
    done
    echo "$(date +%T) smoke run"
    RUN_DIR=~/gpu_smoke bash benchmarks/smoke/gpu_smoke.sh "$gguf" "$c1" "$questions" ~/eqmin/smoke \
        benchmarks/smoke/gpu_smoke_dflash2.yaml benchmarks/smoke/gpu_smoke_trees.yaml \
        benchmarks/smoke/loops_sampled.yaml >~/eqmin/smoke.log 2>&1
    echo "$(date +%T) smoke run: exit $?"
    exit 0
fi
out=$1 limit=${2:-540}
export ARMS_SHIP_MAX_FILES=${ARMS_SHIP_MAX_FILES:-7} ARMS_SHIP_MAX_MB=${ARMS_SHIP_MAX_MB:-56}  # one file for eqmin.tgz
began=$SECONDS
while :; do
    left=$((limit - (SECONDS - began)))
    ((left > 20)) || break
    bash benchmarks/device/arms_h200.sh poll "$out" "$left" | tee ~/eqmin/poll.last
    grep -q "parts left to ship" ~/eqmin/poll.last && break  # this call's files are full
    kill -0 "$(cat ~/eqmin/sequence.pid)" 2>/dev/null || break
    echo "--- $(date +%T) sequence: $(tail -n 1 ~/eqmin/sequence.log);" \
        "smoke: $(tail -n 1 ~/eqmin/smoke.log 2>/dev/null)"
    sleep 30
done
ended=1
kill -0 "$(cat ~/eqmin/sequence.pid)" 2>/dev/null && ended=0
(cd ~ && tar czf "$out/eqmin.tgz" eqmin/*.txt eqmin/*.log eqmin/overlays \
    $( ((ended)) && [ -d eqmin/smoke ] && echo eqmin/smoke) 2>/dev/null)
echo "sequence $( ((ended)) && echo ended || echo running): $(tail -n 2 ~/eqmin/sequence.log | tr '\n' ' ')"
