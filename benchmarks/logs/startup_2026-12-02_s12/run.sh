#!/usr/bin/env bash
set -uo pipefail
OUTD=$HOME/s12out; mkdir -p $OUTD; export HF_HUB_OFFLINE=1; cd $HOME/s12
cat > overlay.yaml <<YAML
data: {source: /root/in/regenerated.jsonl}
target: {path: /root/in/SmolLM2-135M-Instruct.Q4_1.gguf}
regenerate: {enabled: false}
evaluate: {benchmarks: {mt_bench: {prompts: /root/in/question.jsonl}}}
gpu: {count: 1}
YAML
printf 'train: {compile_layers: true}\n' > layers.yaml
printf 'data: {max_conversations: 4000}\n' > small.yaml
p() { echo "$1 $(date +%T)" >> $OUTD/progress.log; }
p "store build start"
PYTHONPATH=/tmp/site:$HOME/s12/src python3 -m snakemake --configfile config/config.yaml config/examples/smollm2-quality.yaml \
  overlay.yaml small.yaml --cores 16 --scheduler greedy results/store.zarr --resources gpu=1 > $OUTD/store_build.log 2>&1
p "store build rc $?"
CFG="config/config.yaml config/examples/smollm2-quality.yaml"
ST="--store results/store.zarr --target results/target"
STA="--store $HOME/s12/results/store.zarr --target $HOME/s12/results/target"
TORCH_LOGS=recompiles,perf_hints PYTHONPATH=/tmp/site:$HOME/s12/src python3 benchmarks/step_syncs.py --configfile $CFG small.yaml layers.yaml $ST --steps 40 --muon-graph --out $OUTD/syncs_layers_graph > $OUTD/step_syncs_layers_graph.log 2>&1
p "step_syncs layers+graph rc $?"
cp small.yaml $HOME/old/
(cd $HOME/old && PYTHONPATH=/tmp/site:$HOME/old/src python3 $HOME/s12/benchmarks/step_syncs.py --configfile $CFG small.yaml $STA --steps 40 \
  --out $OUTD/syncs_old > $OUTD/step_syncs_old.log 2>&1)
p "step_syncs old rc $?"
p DONE
