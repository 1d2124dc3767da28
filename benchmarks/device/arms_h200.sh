#!/usr/bin/env bash
# Several arms of one recipe side by side on the lent H200 (issues #50, #53, #54): each arm is the whole workflow
# (quality_run_h200.sh) in its own RUN_DIR with its own overlays, all from the same data folder, started in the
# background at once and sharing the one GPU (each arm leases it through its own lock folder). Arms that share the
# GPU compare learning at equal steps and tokens, not speed: step times measured this way are not speed figures.
#   bash benchmarks/device/arms_h200.sh start GGUF DATA QUESTIONS NAME=OVERLAY[,OVERLAY...] ...
#   bash benchmarks/device/arms_h200.sh turns GGUF DATA QUESTIONS NAME=OVERLAY[,OVERLAY...] ...
#   [ARMS_SHIP_MAX_FILES=8] [ARMS_SHIP_MAX_MB=60] bash benchmarks/device/arms_h200.sh poll OUT [LIMIT_S]
# NAME: letters, digits, '.', '_' and '-' (it names the files a call brings back).
# start: RECIPE and TARGET as quality_run_h200.sh takes them (exported here for every arm); each arm writes
# ~/arms/NAME (its RUN_DIR), ~/arms/NAME.out (what quality_run_h200.sh packs) and ~/arms/NAME.log.
# ARMS_GPUS=N (start, default 1): each arm's workflow may run N GPU jobs at once (quality_run_h200.sh's GPUS; a
# machine of N GPUs, one arm, e.g. with benchmarks/overlays/train_two_gpus.yaml).
# AFTER=EARLIER start ...: these arms start once arm EARLIER (started before) has ended its extraction (its merge
# began, or it ended): an 80 GB card holds one extraction (~59 GiB) beside a streamed training (~7 GiB), not two.
# turns: the arms one after another, each alone on the GPU (issue #53: step time and peak memory per arm), on one
# store: the first arm runs in a fresh RUN_DIR ~/arms/shared, each later one in it as the one before left it
# (quality_run_h200.sh's KEEP_RUN=1), so Snakemake reruns only what its config changes (an arm that changes train
# keys: train, the evaluation and, without TARGET, plan; never tokenize, extract or merge, whose params hold no train
# key; an arm that changes a data key, e.g. regenerate.loops, rebuilds the store: put it last). Name each arm's
# overlays in full: a later arm's config is its own overlays, not the earlier arm's. One background sequence (its
# pid in ~/arms/turns.seq, its log ~/arms/turns.seq.log); each arm's pid is in ~/arms/NAME.pid from its start, its
# packed results in ~/arms/NAME.out before the next arm starts. A failed arm stops the sequence when it left no store.
# KEEP_RUN=1 turns ...: the first arm too runs in ~/arms/shared as an earlier sequence left it (more turns on the same
# store, e.g. one whose train.steps comes from the step times the earlier turns measured). tests/test_arms_turns.py
# runs it on the CPU (a fake nvidia-smi, a tiny recipe, 4-5 minutes): the second arm (benchmarks/overlays/dflash2.yaml)
# plans plan, train, evaluate_part and evaluate, nothing before train.
# The drafter (start and turns): when an arm's workflow ends, its background job packs the drafter the arm trained
# (RUN_DIR/results/drafter newer than ~/arms/NAME.started, touched as the arm starts) with pack_drafter_bf16.sh into
# ~/arms/NAME.drafter/ (bf16, parts of 15 MB: drafter_bf16.tgz.part_aa, _ab, ...) before the arm's pid ends. An arm
# that trained none packs none: one that failed before train, or, in turns, one whose overlays change no train key
# (the drafter in ~/arms/shared is then the earlier arm's, shipped as that arm's).
# poll: prints each arm's progress every minute and returns when every arm has ended and no sequence of turns runs
# (or after LIMIT_S, default 560), with each ended arm's packed results as OUT/NAME.tgz; call it again at once while
# arms run (the machine is given back 30 s after a call ends, and the arms with it). Besides the NAME.tgz files it
# ships the drafter parts of the ended arms as OUT/NAME.drafter/PART, in order, the parts no earlier call shipped
# (~/arms/shipped.list; delete a line there to ship that part again), as many as keep the call within
# ARMS_SHIP_MAX_FILES files and ARMS_SHIP_MAX_MB MiB (default 8 and 60, the NAME.tgz files counted; a call brings
# back 8 files of 64 MiB in all). A call that is full returns at once, printing "parts left to ship: N (call poll
# again)": call it again at once, also after every arm has ended, until it prints no such line.
# The drafters on a CPU machine (the slow evaluations: T = 1 sampling, Arena-Hard, trees): with each call's files in
# its own folder, named so that they sort in call order (OUT01, OUT02, ...: the glob orders by folder, then part),
#   cat OUT*/NAME.drafter/drafter_bf16.tgz.part_* | tar xz          # -> drafter_bf16/ (config.json: dtype bfloat16)
#   dflash-pipeline evaluate --drafter drafter_bf16 --target SmolLM2-135M-Instruct.Q4_1.gguf --device cpu \
#       --dtype float32 --temperature 1 --seed 0 --prompts pkg:eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl \
#       --stride 10 --max-new-tokens 256 --tree-budgets 32 128 --no-baselines --threads 2 --out NAME_arena_hard_t1.json
# (the varied recipe's Arena-Hard 75: every tenth prompt; MT-Bench's first turns: leave --prompts and --stride out;
# --limit N: the first N; --no-baselines: no autoregressive or prompt-lookup decoding, as at T = 1 no lossless check
# is made; --temperature 0 with --no-prompt-lookup in its place: greedy, with the lossless check; prompt lookup's
# figures do not depend on the drafter: measured once). The bf16 weights load as float32.
# Train on the device, evaluate here (the device minutes go to training; the CPU evaluates what the GPU does for the
# fp32 target, prompt for prompt: journal 2026-12-03 session 19): TARGET=results/drafter for the arms (train, no
# evaluation), then per arm, with NAME.tgz unpacked into ARM/ (ARM/NAME.out/quality.tgz),
#   dflash-pipeline evaluate --drafter drafter_bf16 --target GGUF --device cpu --no-prompt-lookup --threads 2 \
#       --processes 2 [--backbone-drafts] --out ARM/NAME.out/result.json
# (--backbone-drafts for a DFlash2 drafter: the selector's share) and
# `python benchmarks/quality/compare_arms.py NAME=ARM/NAME.out ...` reads that result.json beside the packed files.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
self=$here/$(basename "$0")
mode=$1
shift
forget_arms() {  # checks each NAME=OVERLAY[,OVERLAY...]; an earlier run's files of the same NAME go
    local arm name
    for arm in "$@"; do
        name=${arm%%=*}
        [[ $arm == ?*=* && $name =~ ^[A-Za-z0-9._-]+$ ]] || {
            echo "$mode: arm '$arm' is not NAME=OVERLAY[,OVERLAY...] with a NAME of letters, digits, '.', '_', '-'" >&2
            exit 2
        }
    done
    mkdir -p ~/arms
    touch ~/arms/shipped.list
    for arm in "$@"; do
        name=${arm%%=*}
        rm -rf ~/arms/"$name".out ~/arms/"$name".pid ~/arms/"$name".drafter ~/arms/"$name".started
        awk -v prefix="$name.drafter/" 'index($0, prefix) != 1' ~/arms/shipped.list >~/arms/shipped.list.tmp
        mv ~/arms/shipped.list.tmp ~/arms/shipped.list
    done
}
if [ "$mode" = turns ]; then
    [ $# -ge 4 ] || { echo "turns: GGUF DATA QUESTIONS NAME=OVERLAY[,OVERLAY...] ..." >&2; exit 2; }
    forget_arms "${@:4}"
    setsid nohup bash "$self" sequence "$@" >~/arms/turns.seq.log 2>&1 &
    echo $! >~/arms/turns.seq
    echo "turns: pid $(cat ~/arms/turns.seq), arms ${*:4}; log ~/arms/turns.seq.log"
    exit 0
fi
if [ "$mode" = arm ]; then  # one arm's background job: RUN_DIR's workflow, then the drafter this arm trained
    name=$1
    shift
    if [ -n "${AFTER:-}" ]; then  # start: wait for that arm's extraction to end (its merge began, or it ended)
        until grep -qE '^(local)?rule merge:' ~/arms/"$AFTER"/results/quality_run.log 2>/dev/null \
            || ! kill -0 "$(cat ~/arms/"$AFTER".pid 2>/dev/null)" 2>/dev/null; do sleep 10; done
        echo "$(date +%T) $AFTER's extraction has ended: starting"
    fi
    touch ~/arms/"$name".started
    bash "$here/quality_run_h200.sh" "$@"
    status=$?
    drafter=$RUN_DIR/results/drafter
    if [ "$drafter/model.safetensors" -nt ~/arms/"$name".started ]; then
        if bash "$here/pack_drafter_bf16.sh" "$drafter" ~/arms/"$name".drafter >/dev/null; then
            echo "drafter: $(ls ~/arms/"$name".drafter | wc -l) bf16 parts in ~/arms/$name.drafter (poll ships them)"
        else
            rm -rf ~/arms/"$name".drafter
            echo "drafter: packing failed"
        fi
    else
        echo "drafter: none trained by this arm"
    fi
    exit $status
fi
if [ "$mode" = sequence ]; then  # turns' background sequence
    gguf=$1 data=$2 questions=$3
    shift 3
    keep=${KEEP_RUN:-0}
    for arm in "$@"; do
        name=${arm%%=*}
        IFS=, read -r -a overlays <<<"${arm#*=}"
        echo ~/arms/shared >~/arms/"$name".run
        echo "$(date +%T) arm $name: overlays ${overlays[*]}"
        KEEP_RUN=$keep DFLASH_GPU_LOCK_DIR=~/arms/shared.locks RUN_DIR=~/arms/shared bash "$self" arm "$name" \
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
    forget_arms "$@"
    for arm in "$@"; do
        name=${arm%%=*}
        IFS=, read -r -a overlays <<<"${arm#*=}"
        mkdir -p ~/arms/"$name".locks
        DFLASH_GPU_LOCK_DIR=~/arms/"$name".locks RUN_DIR=~/arms/"$name" setsid nohup bash "$self" arm "$name" \
            "$gguf" "$data" "$questions" ~/arms/"$name".out "${ARMS_GPUS:-1}" "${overlays[@]}" \
            >~/arms/"$name".log 2>&1 &
        echo $! >~/arms/"$name".pid
        echo "arm $name: pid $(cat ~/arms/"$name".pid), overlays ${overlays[*]}"
    done
    exit 0
fi
out=$1 limit=${2:-560}
max_files=${ARMS_SHIP_MAX_FILES:-8} max_mb=${ARMS_SHIP_MAX_MB:-60}
[[ $max_files =~ ^[1-9][0-9]*$ && $max_mb =~ ^[1-9][0-9]*$ ]] || {
    echo "poll: ARMS_SHIP_MAX_FILES ($max_files) and ARMS_SHIP_MAX_MB ($max_mb) must be positive integers" >&2
    exit 2
}
mkdir -p "$out" ~/arms
touch ~/arms/shipped.list
shipped=()
out_files() { find "$out" -type f | wc -l; }
out_bytes() { find "$out" -type f -printf '%s\n' | awk '{n += $1} END {print n + 0}'; }
fits() { (($(out_files) + 1 <= max_files && $(out_bytes) + $1 <= max_mb * 1048576)); }  # one more file of $1 bytes
while :; do
    running=0 full=0 left=0 ended=()
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
        else
            ended+=("$name")
        fi
    done
    for name in "${ended[@]}"; do  # the results first, then the parts
        [ -e "$out/$name.tgz" ] && continue
        echo "$name: ended; $(tail -n 3 ~/arms/"$name".log | tr '\n' ' ')"
        tar czf ~/arms/"$name".tgz.tmp -C ~/arms "$name".out "$name".log 2>/dev/null
        if ((full == 0)) && fits "$(stat -c %s ~/arms/"$name".tgz.tmp)"; then
            mv ~/arms/"$name".tgz.tmp "$out/$name.tgz"
            shipped+=("$name.tgz")
        else
            rm -f ~/arms/"$name".tgz.tmp
            echo "$name.tgz: does not fit this call"
            full=1 left=$((left + 1))
        fi
    done
    for name in "${ended[@]}"; do  # in order: a call's parts all come before the next call's
        for part in ~/arms/"$name".drafter/drafter_bf16.tgz.part_*; do
            [ -e "$part" ] || continue
            key=$name.drafter/$(basename "$part")
            grep -qxF -- "$key" ~/arms/shipped.list && continue
            if ((full == 0)) && fits "$(stat -c %s "$part")"; then
                mkdir -p "$out/$name.drafter"
                cp "$part" "$out/$key"
                echo "$key" >>~/arms/shipped.list
                shipped+=("$key")
            else
                full=1 left=$((left + 1))
            fi
        done
    done
    ((left)) && echo "parts left to ship: $left (call poll again)"
    ((running == 0 || full || SECONDS >= limit)) && break
    sleep 60
done
echo "shipped this call: ${shipped[*]:-nothing} ($(out_files) files, $(out_bytes | awk '{printf "%.1f", $1 / 1048576}') MiB)"
