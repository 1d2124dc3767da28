#!/usr/bin/env bash
# A trained drafter directory (e.g. ~/quality_run/results/drafter) as bf16 safetensors in 15 MB parts, to bring
# back from the device machine, whose files come back at 16 MiB each at most. Run it from a polling call as soon
# as the drafter exists (a later evaluation may not finish inside the device time). Unpack here with
#   cat OUT/drafter_bf16.tgz.part_* | tar xz        # -> drafter_bf16/ (load_dflash reads it)
#   [DRAFTER_PART_SIZE=15M] bash benchmarks/device/pack_drafter_bf16.sh DRAFTER_DIR OUT
# DRAFTER_PART_SIZE: split's -b (tests/test_arms_turns.py packs a tiny drafter in several parts).
set -euo pipefail
src=$(readlink -f "$1") out=$2 tmp=$(mktemp -d)
mkdir -p "$tmp/drafter_bf16" "$out"
python3 - "$src" "$tmp/drafter_bf16" <<'PY'
import json, shutil, sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

src, dst = map(Path, sys.argv[1:])
tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
           for k, v in load_file(src / "model.safetensors").items()}
save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
config = json.loads((src / "config.json").read_text())
(dst / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16"), indent=2) + "\n")
shutil.copy(src / "training.json", dst / "training.json")
PY
tar czf - -C "$tmp" drafter_bf16 | split -b "${DRAFTER_PART_SIZE:-15M}" - "$out/drafter_bf16.tgz.part_"
rm -rf "$tmp"
ls -l "$out"/drafter_bf16.tgz.part_*
