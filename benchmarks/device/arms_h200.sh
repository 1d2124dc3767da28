#!/usr/bin/env bash
# Several arms of one recipe side by side on the lent H200 (issues #50, #53, #54): each arm is the whole workflow
# (quality_run_h200.sh) in its own RUN_DIR with its own overlays, all from the same data folder, started in the
# background at once and sharing the one GPU (each arm leases it through its own lock folder). Arms that share the
# GPU compare learning at equal steps and tokens, not speed: step times measured this way are not speed figures.
#   bash benchmarks/device/arms_h200.sh start GGUF DATA QUESTIONS NAME=OVERLAY[,OVERLAY...] ...
#   bash benchmarks/device/arms_h200.sh poll OUT [LIMIT_S]
# start: RECIPE and TARGET as quality_run_h200.sh takes them (exported here for every arm); each arm writes
# ~/arms/NAME (its RUN_DIR), ~/arms/NAME.out (what quality_run_h200.sh packs) and ~/arms/NAME.log.
# poll: prints each arm's progress every minute and returns when every arm has ended (or after LIMIT_S, default 560),
# with each ended arm's packed results as OUT/NAME.tgz; call it again at once while arms run (the machine is given
# back 30 s after a call ends, and the arms with it).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
mode=$1
shift
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
    for pidfile in ~/arms/*.pid; do
        name=$(basename "$pidfile" .pid)
        if kill -0 "$(cat "$pidfile")" 2>/dev/null; then
            running=$((running + 1))
            echo "$name: $(tail -n 1 ~/arms/"$name"/results/quality_run.log 2>/dev/null | cut -c1-150)"
            echo "$name: $(tail -n 1 ~/arms/"$name"/results/logs/train.log 2>/dev/null | cut -c1-200)"
        elif [ ! -e "$out/$name.tgz" ]; then
            echo "$name: ended; $(tail -n 3 ~/arms/"$name".log | tr '\n' ' ')"
            tar czf "$out/$name.tgz" -C ~/arms "$name".out "$name".log 2>/dev/null
        fi
    done
    ((running == 0 || SECONDS >= limit)) && break
    sleep 60
done
