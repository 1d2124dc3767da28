#!/usr/bin/env bash
set -uo pipefail
OUTD=$HOME/s13out; mkdir -p $OUTD; export HF_HUB_OFFLINE=1; cd $HOME/s13
cat > overlay.yaml <<YAML
data: {source: /root/in/regenerated.jsonl, max_conversations: 6500}
target: {path: /root/in/SmolLM2-135M-Instruct.Q4_1.gguf}
regenerate: {enabled: false}
evaluate: {benchmarks: {mt_bench: {prompts: /root/in/question.jsonl}}}
gpu: {count: 1}
YAML
printf 'train: {compile_layers: true}\n' > layers.yaml
p() { echo "$1 $(date +%T)" >> $OUTD/progress.log; }
p "store build start"
PYTHONPATH=/tmp/site:$HOME/s13/src python3 -m snakemake --configfile config/config.yaml config/examples/smollm2-quality.yaml \
  overlay.yaml --cores 16 --scheduler greedy results/store.zarr --resources gpu=1 > $OUTD/store_build.log 2>&1
p "store build rc $?"
CFG="config/config.yaml config/examples/smollm2-quality.yaml"
ST="--store $HOME/s13/results/store.zarr --target $HOME/s13/results/target"
PYTHONPATH=/tmp/site:$HOME/s13/src timeout 300 python3 benchmarks/step_syncs.py --configfile $CFG $ST --steps 30 --profile 3 \
  --out $OUTD/syncs_new > $OUTD/step_syncs_new.log 2>&1
p "step_syncs new rc $?"
PYTHONPATH=/tmp/site:$HOME/s13/src timeout 1000 python3 benchmarks/train_startup.py --configfile $CFG $ST --samples 6000 \
  --tree old=$HOME/old/src --tree new=$HOME/s13/src --tree layers=$HOME/s13/src,compile_layers=true \
  --out $OUTD/startup > $OUTD/train_startup.log 2>&1
p "train_startup rc $?"
TORCH_LOGS=recompiles PYTHONPATH=/tmp/site:$HOME/s13/src timeout 400 python3 benchmarks/step_syncs.py --configfile $CFG layers.yaml $ST \
  --steps 30 --profile 3 --out $OUTD/syncs_layers > $OUTD/step_syncs_layers.log 2>&1
p "step_syncs layers rc $?"
p DONE
