#!/usr/bin/env bash
set -uo pipefail
OUTD=$HOME/s13out; mkdir -p $OUTD; export HF_HUB_OFFLINE=1; cd $HOME/s13
cat > overlay.yaml <<YAML
data: {source: /root/in/regenerated.jsonl, max_conversations: 2000}
target: {path: /root/in/SmolLM2-135M-Instruct.Q4_1.gguf}
regenerate: {enabled: false}
evaluate: {benchmarks: {mt_bench: {prompts: /root/in/question.jsonl}}}
gpu: {count: 1}
YAML
p() { echo "$1 $(date +%T)" >> $OUTD/progress.log; }
p "store build start"
PYTHONPATH=/tmp/site:$HOME/s13/src python3 -m snakemake --configfile config/config.yaml config/examples/smollm2-quality.yaml \
  overlay.yaml --cores 16 --scheduler greedy results/store.zarr --resources gpu=1 > $OUTD/store_build.log 2>&1
p "store build rc $?"
CFG="config/config.yaml config/examples/smollm2-quality.yaml"
ST="--store $HOME/s13/results/store.zarr --target $HOME/s13/results/target"
PYTHONPATH=/tmp/site:$HOME/s13/src timeout 1000 python3 benchmarks/train_startup.py --configfile $CFG $ST --samples 1900 \
  --tree new=$HOME/s13/src --tree layers=$HOME/s13/src,compile_layers=true --out $OUTD/startup > $OUTD/train_startup.log 2>&1
p "train_startup rc $?"
p DONE
