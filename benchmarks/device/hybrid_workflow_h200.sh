#!/usr/bin/env bash
# Extraction from a Qwen3.5-27B-shaped random-weight hybrid through the workflow (issues #5 and #11):
# prepare -> tokenize -> extract (one job per GPU, FLA fast path) -> merge, with nvidia-smi samples, then a
# SIGKILL of one extract job while it writes and a rerun of the same command, which must recompute that
# shard alone.
#   bash benchmarks/device/hybrid_workflow_h200.sh CONVERSATIONS TOKENIZER_DIR GPUS REPORT_DIR [CONVERSATION_COUNT] [SHARDS]
# CONVERSATIONS: a conversations file prepare reads (e.g. ShareGPT); TOKENIZER_DIR: any checkpoint directory
# with tokenizer files (its ids must fit the 248,320-token vocabulary; SmolLM2's do).
# SHAPE: other model-shape options of make_random_target.py (a tiny shape for a CPU smoke test).
set -euo pipefail
data=$1 tokenizer=$2 gpus=$3 report=$4 count=${5:-2400} shards=${6:-6}
mkdir -p "$report" results
python3 benchmarks/speed/make_random_target.py --tokenizer "$tokenizer" --out results/targets/qwen3_5_27b ${SHAPE:-}
cat >results/hybrid_27b.yaml <<EOF
data: {source: "$data", max_conversations: $count}
target: {path: results/targets/qwen3_5_27b, dtype: bfloat16, random_weights_seed: 0}
$(grep -q "^  regenerate:" config/schema.yaml && echo "regenerate: {enabled: false}")
tokenize: {num_shards: $shards, max_length: 2048}
extract: {tokens_per_batch: 16384, store_dtype: fp8_e4m3, threads: 4}
gpu: {count: $gpus}
EOF
nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv,noheader -l 2 >"$report/nvidia_smi.csv" &
smi=$!
run() { python3 -m snakemake store --configfile results/hybrid_27b.yaml --cores 32 --resources gpu="$gpus" "$@"; }

victim=$(printf %05d $((shards - 1)))
kill_victim() { # SIGKILL the extract job of the last shard 20 s into its extraction (its stdout is its log)
    local log=results/logs/extract/shard_$victim.log
    until grep -q "^.*shard $((10#$victim)) on" "$log" 2>/dev/null; do sleep 1; done
    sleep 20
    log=$(readlink -f "$log")
    for fd in /proc/[0-9]*/fd/1; do
        if [ "$(readlink "$fd" 2>/dev/null)" = "$log" ]; then
            pid=${fd#/proc/}
            pid=${pid%%/*}
            echo "SIGKILL extract shard $victim (pid $pid) at $(date +%T)"
            kill -9 "$pid"
        fi
    done
}
kill_victim &
started=$(date +%s)
run 2>&1 | tee "$report/snakemake_first.log" || true
echo "first run: $(($(date +%s) - started)) s"
ls results/extract
run -n 2>&1 | tee "$report/snakemake_dry_run_after_kill.log" | grep -A12 "Job stats" || true
started=$(date +%s)
run 2>&1 | tee "$report/snakemake_rerun.log"
echo "rerun: $(($(date +%s) - started)) s"
kill $smi || true
grep -h "tok/s" results/logs/extract/*.log | tee "$report/extract_rates.txt"
grep -h "random weights\|fast path\|slow path" results/logs/extract/*.log | sort | uniq -c | head -5
tail -n +1 results/benchmarks/extract/*.tsv >"$report/extract_benchmarks.txt"
cp results/logs/extract/*.log results/logs/merge.log "$report/" 2>/dev/null || true
python3 -m dflash_pipeline.cli verify results/store.zarr --jobs 8 | tail -3
python3 - "$report" <<'PY'
import sys, zarr
attrs = dict(zarr.open_group("results/store.zarr", mode="r").attrs)
print({k: attrs.get(k) for k in ("num_shards", "num_samples", "num_tokens", "layer_ids", "logical_dtype",
                                  "random_weights_seed")})
PY
