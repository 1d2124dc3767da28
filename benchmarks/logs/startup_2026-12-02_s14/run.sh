#!/usr/bin/env bash
set -uo pipefail
OUTD=$HOME/s14out; mkdir -p $OUTD; export HF_HUB_OFFLINE=1; cd $HOME/s14
cat > overlay.yaml <<YAML
data: {source: /root/in/regenerated.jsonl, max_conversations: 6500}
target: {path: /root/in/SmolLM2-135M-Instruct.Q4_1.gguf}
regenerate: {enabled: false}
evaluate: {benchmarks: {mt_bench: {prompts: /root/in/question.jsonl}}}
gpu: {count: 1}
YAML
p() { echo "$1 $(date +%T)" >> $OUTD/progress.log; }
p "store build start"
PYTHONPATH=/tmp/site:$HOME/s14/src python3 -m snakemake --configfile config/config.yaml config/examples/smollm2-quality.yaml \
  overlay.yaml --cores 16 --scheduler greedy results/store.zarr --resources gpu=1 > $OUTD/store_build.log 2>&1
p "store build rc $?"
CFG="config/config.yaml config/examples/smollm2-quality.yaml"
ST="--store $HOME/s14/results/store.zarr --target $HOME/s14/results/target"
PYTHONPATH=/tmp/site:$HOME/old/src timeout 420 python3 benchmarks/step_syncs.py --configfile $CFG $ST --steps 0 --profile 0 \
  --stalls 150 --out $OUTD/stalls_old > $OUTD/stalls_old.log 2>&1
p "stalls old rc $?"
PYTHONPATH=/tmp/site:$HOME/s14/src timeout 900 python3 benchmarks/train_startup.py --configfile $CFG $ST --samples 6000 \
  --tree old=$HOME/old/src --tree new=$HOME/s14/src --out $OUTD/startup > $OUTD/train_startup.log 2>&1
p "train_startup rc $?"
PYTHONPATH=/tmp/site:$HOME/s14/src timeout 420 python3 benchmarks/step_syncs.py --configfile $CFG $ST --steps 0 --profile 0 \
  --stalls 150 --out $OUTD/stalls_new > $OUTD/stalls_new.log 2>&1
p "stalls new rc $?"
p DONE
