#!/usr/bin/env bash
# Training speed on one GPU, through the workflow (issue #3's benchmark):
#   bash benchmarks/speed/gpu_train_speed.sh TARGET_CONFIG_DIR [WORKDIR]
# TARGET_CONFIG_DIR holds SmolLM2-135M-Instruct's config.json and tokenizer files (no weights): the target
# gets random weights of that shape, which costs the same to run as the real ones. Conversations are
# synthetic with ShareGPT-like lengths. Runs extract (bf16) -> merge -> train (B=16, 5 layers, 512 anchors)
# and prints the train job's timings (results/train/timing.json): tokens/s, data wait, peak GPU memory.
set -euo pipefail
config_dir=$1
work=${2:-/tmp/gpu-train-speed}
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$work"
python3 - "$config_dir" "$work" <<'PY'
import json, random, sys
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

config_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
model.save_pretrained(work / "target")
AutoTokenizer.from_pretrained(config_dir).save_pretrained(work / "target")
rng = random.Random(0)
words = [w.strip("Ġ") for w in list(AutoTokenizer.from_pretrained(config_dir).get_vocab())[:8000] if w.isalpha()]
with open(work / "conversations.jsonl", "w") as out:
    for i in range(1500):
        turns = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            turns.append({"from": "human", "value": " ".join(rng.choices(words, k=int(rng.lognormvariate(3.5, 0.8))))})
            turns.append({"from": "gpt", "value": " ".join(rng.choices(words, k=int(rng.lognormvariate(5.3, 0.6))))})
        out.write(json.dumps({"id": f"synthetic-{i}", "conversations": turns}) + "\n")
config = {
    "data": {"source": str(work / "conversations.jsonl"), "max_conversations": None},
    "target": {"path": str(work / "target"), "dtype": "bfloat16"},
    "tokenize": {"num_shards": 4, "max_length": 2048},
    "extract": {"store_dtype": "bfloat16", "tokens_per_batch": 65536, "threads": 4},
    "gpu": {"count": 1},
    "train": {"gpus": 1, "threads": 8, "epochs": 1, "lr": 6e-4, "max_anchors": 512, "val_max_anchors": 512,
              "tokens_per_batch": 32768, "val_fraction": 0.02, "num_workers": 4, "checkpoint_every": 100000},
}
(work / "config.yaml").write_text(yaml.safe_dump(config))
PY
cd "$work"
python3 -m snakemake store results/drafter --snakefile "$repo/Snakefile" --directory "$work" \
    --configfile "$work/config.yaml" --cores 16 --resources gpu=1
grep -h "tok/s\|real" results/logs/extract/*.log | tail -4
grep -h "exported" results/logs/train.log
cat results/train/timing.json  # tokens_per_s, data_wait_s / loop_s, peak_gpu_gib (dflash_pipeline.train.timing)
cat results/benchmarks/train.tsv
