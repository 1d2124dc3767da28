#!/usr/bin/env bash
# Several arms of one recipe side by side on the lent H200 (issues #50, #53, #54): each arm is the whole workflow
# (quality_run_h200.sh) in its own RUN_DIR with its own overlays, all from the same data folder, started in the
# background at once and sharing the one GPU (each arm leases it through its own lock folder). Arms that share the
# GPU compare learning at equal steps and tokens, not speed: step times measured this way are not speed figures.
#   bash benchmarks/device/arms_h200.sh start GGUF DATA QUESTIONS NAME=OVERLAY[,OVERLAY...] ...
#   bash benchmarks/device/arms_h200.sh turns GGUF DATA QUESTIONS NAME=OVERLAY[,OVERLAY...] ...
#   bash benchmarks/device/arms_h200.sh poll OUT [LIMIT_S]
# start: RECIPE and TARGET as quality_run_h200.sh takes them (exported here for every arm); each arm writes
# ~/arms/NAME (its RUN_DIR), ~/arms/NAME.out (what quality_run_h200.sh packs) and ~/arms/NAME.log.
# turns: the arms one after another, each alone on the GPU (issue #53: step time and peak memory per arm), on one
# store: the first arm runs in a fresh RUN_DIR ~/arms/shared, each later one in it as the one before left it
# (quality_run_h200.sh's KEEP_RUN=1), so Snakemake reruns only what its config changes (an arm that changes train
# keys: train, the evaluation and, without TARGET, plan; never tokenize, extract or merge, whose params hold no train
# key). Name each arm's overlays in full: a later arm's config is its own overlays, not the earlier arm's. One
# background sequence (its pid in ~/arms/turns.seq, its log ~/arms/turns.seq.log); each arm's pid is in
# ~/arms/NAME.pid from its start, its packed results in ~/arms/NAME.out before the next arm starts. A failed arm stops the sequence when it
# left no store. tests/test_arms_turns.py runs it on the CPU (a fake nvidia-smi, a tiny recipe, 2-3 minutes): the
# second arm (benchmarks/overlays/dflash2.yaml) plans plan, train, evaluate_part and evaluate, nothing before train.
# poll: prints each arm's progress every minute and returns when every arm has ended and no sequence of turns runs
# (or after LIMIT_S, default 560), with each ended arm's packed results as OUT/NAME.tgz; call it again at once while
# arms run (the machine is given back 30 s after a call ends, and the arms with it).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=$1
shift
if [ "$mode" = turns ]; then
    [ $# -ge 4 ] || { echo "turns: GGUF DATA QUESTIONS NAME=OVERLAY[,OVERLAY...] ..." >&2; exit 2; }
    mkdir -p ~/arms
    for arm in "${@:4}"; do
        [[ $arm == ?*=* ]] || { echo "turns: arm '$arm' is not NAME=OVERLAY[,OVERLAY...]" >&2; exit 2; }
        rm -rf ~/arms/"${arm%%=*}".out ~/arms/"${arm%%=*}".pid  # no earlier run's files packed as this arm's
    done
    setsid nohup bash "$here/$(basename "$0")" sequence "$@" >~/arms/turns.seq.log 2>&1 &
    echo $! >~/arms/turns.seq
    echo "turns: pid $(cat ~/arms/turns.seq), arms ${*:4}; log ~/arms/turns.seq.log"
    exit 0
fi
if [ "$mode" = sequence ]; then  # turns' background sequence
    gguf=$1 data=$2 questions=$3
    shift 3
    keep=0
    for arm in "$@"; do
        name=${arm%%=*}
        IFS=, read -r -a overlays <<<"${arm#*=}"
        echo ~/arms/shared >~/arms/"$name".run
        echo "$(date +%T) arm $name: overlays ${overlays[*]}"
        KEEP_RUN=$keep DFLASH_GPU_LOCK_DIR=~/arms/shared.locks RUN_DIR=~/arms/shared bash "$here/quality_run_h200.sh" \
            "$gguf" "$data" "$questions" ~/arms/"$name".out 1 "${overlays[@]}" >~/arms/"$name".log 2>&1 &
        echo $! >~/arms/"$name".pid
        wait $!
        status=$?
        echo "$(date +%T) arm $name: exit $status"
        if [ $status -ne 0 ] && [ ! -d ~/arms/shared/results/store.zarr ]; then
            echo "arm $name failed and left no store: the later arms are not run"
            exit $status
        fi
        keep=1
    done
    exit 0
fi
if [ "$mode" = start ]; then
    gguf=$1 data=$2 questions=$3
    shift 3
    mkdir -p ~/arms
    for arm in "$@"; do
        name=${arm%%=*}
        IFS=, read -r -a overlays <<<"${arm#*=}"
        mkdir -p ~/arms/"$name".locks
        DFLASH_GPU_LOCK_DIR=~/arms/"$name".locks RUN_DIR=~/arms/"$name" setsid nohup bash "$here/quality_run_h200.sh" \
            "$gguf" "$data" "$questions" ~/arms/"$name".out 1 "${overlays[@]}" >~/arms/"$name".log 2>&1 &
        echo $! >~/arms/"$name".pid
        echo "arm $name: pid $(cat ~/arms/"$name".pid), overlays ${overlays[*]}"
    done
    exit 0
fi
out=$1 limit=${2:-560}
mkdir -p "$out"
while :; do
    running=0
    echo "--- $(date +%T) ${SECONDS}s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader)"
    if [ -e ~/arms/turns.seq ] && kill -0 "$(cat ~/arms/turns.seq)" 2>/dev/null; then
        running=$((running + 1))  # the next arm may not have started yet
        echo "turns: $(tail -n 1 ~/arms/turns.seq.log)"
    fi
    for pidfile in ~/arms/*.pid; do
        [ -e "$pidfile" ] || continue
        name=$(basename "$pidfile" .pid)
        run=$(cat ~/arms/"$name".run 2>/dev/null || echo ~/arms/"$name")
        if kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            running=$((running + 1))
            echo "$name: $(tail -n 1 "$run"/results/quality_run.log 2>/dev/null | cut -c1-150)"
            echo "$name: $(tail -n 1 "$run"/results/logs/train.log 2>/dev/null | cut -c1-200)"
        elif [ ! -e "$out/$name.tgz" ]; then
            echo "$name: ended; $(tail -n 3 ~/arms/"$name".log | tr '\n' ' ')"
            tar czf "$out/$name.tgz" -C ~/arms "$name".out "$name".log 2>/dev/null
        fi
    done
    ((running == 0 || SECONDS >= limit)) && break
    sleep 60
done
