#!/usr/bin/env bash
# The compact store's τ table (issue #34): the SmolLM2 quality recipe (config/examples/smollm2-quality.yaml) once per
# store setting, all at once, each workflow on its own GPU and its share of the cores, on the same 15,632 answers
# regenerated in 2026-12-01's study (benchmarks/logs/study_2026-12-01/regenerated.jsonl.gz): equal steps, same
# answers, same seed. Then, on the bf16 run's store (else the first arm's), streamed training against preloaded
# (benchmarks/device/stream_h200.sh).
#   bash benchmarks/device/compact_h200.sh GGUF MT_BENCH_QUESTIONS OUT ARM [ARM ...]
# ARM: bf16 | fp8 | compact:RANK (fp8 coefficients) | compact:RANK:bfloat16. One GPU per arm (nvidia-h200-x4 for four
# arms, x2 for two); with fewer GPUs than arms, arms share them round-robin and run at once (a job respects the
# CUDA_VISIBLE_DEVICES it is given and takes no lease; each workflow runs one GPU job at a time): τ at equal steps
# does not depend on speed, their times do and are not compared. EPOCHS=2 halves the training (~4 of the ~8 minutes
# of steps). STREAM=0 skips the streamed run.
# Writes OUT/table.md (benchmarks/quality/compact_table.py), each arm's packed results (OUT/<arm>/quality.tgz), the bf16
# drafter in 15 MB parts (OUT/drafter_bf16.tgz.part_*, for the fc cosine of benchmarks/quality/compact_error.py).
# Start it in the background (setsid nohup) and poll, as benchmarks/device/quality_run_h200.sh says.
set -euo pipefail
gguf=$(readlink -f "$1") questions=$(readlink -f "$2") out=$(readlink -f "$3")
shift 3
mkdir -p "$out"
answers=benchmarks/logs/study_2026-12-01/regenerated.jsonl.gz  # out of the tree: restore it before carrying the tree
[ -f $answers ] || bash benchmarks/logs/restore_artifacts.sh $answers
zcat $answers >"$out/regenerated.jsonl"
arms=("$@")
cores=$(($(nproc) / ${#arms[@]}))
gpus=$(nvidia-smi -L | grep -c '^GPU')
runs=()
for i in "${!arms[@]}"; do
    IFS=: read -r kind rank coefficients <<<"${arms[$i]}"
    name=${arms[$i]//:/_}
    case $kind in
        bf16) store="store_dtype: bfloat16" ;;
        fp8) store="store_dtype: fp8_e4m3" ;;
        compact) store="store_dtype: compact, compact: {rank: $rank, coefficients: ${coefficients:-fp8_e4m3}}" ;;
        *) echo "unknown arm ${arms[$i]}" >&2; exit 2 ;;
    esac
    cat >"$out/$name.yaml" <<EOF
gpu: {count: 1}
regenerate: {enabled: false}
extract: {$store}
train: {snapshots: null, threads: $cores${EPOCHS:+, epochs: $EPOCHS}}
evaluate: {baselines: false}
EOF
    CUDA_VISIBLE_DEVICES=$((i % gpus)) RUN_DIR=~/run_$name taskset -c $((i * cores))-$((i * cores + cores - 1)) \
        bash benchmarks/device/quality_run_h200.sh "$gguf" "$out/regenerated.jsonl" "$questions" "$out/$name" 1 \
        "$out/$name.yaml" >"$out/$name.log" 2>&1 &
    runs+=(~/run_"$name")
done
wait || true
[ -d ~/run_bf16/results/drafter ] && bash benchmarks/device/pack_drafter_bf16.sh ~/run_bf16/results/drafter "$out" || true
python3 benchmarks/quality/compact_table.py "${runs[@]}" | tee "$out/table.md"
stream=${runs[0]}  # the bf16 store when it is an arm (the most bytes per step), else the first arm's
[ -d ~/run_bf16/results/store.zarr ] && stream=~/run_bf16
if [ "${STREAM:-1}" = 1 ] && [ -d "$stream/results/store.zarr" ]; then
    CUDA_VISIBLE_DEVICES=0 bash benchmarks/device/stream_h200.sh "$stream" "$out/stream"
fi
