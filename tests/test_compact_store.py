"""The compact store (src/dflash_pipeline/store/compact_codec.py) on the tiny target of tests/test_train.py: its
round trip within the bound it records, its basis checked, and training on its coefficients against training on the
features it decodes to."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import zarr

from dflash_pipeline.store import compact
from dflash_pipeline.drafter import load_dflash
from dflash_pipeline.extract import LayerCapture
from dflash_pipeline.store import CompactCodec, HiddenStateStore, StoreError, read_basis, write_basis
from dflash_pipeline.train import TrainConfig, Trainer, accumulate_gradients, train
from train_helpers import BASE, D, LAYER_IDS, make_store, make_tiny_target, paths, synthetic_samples

RANK = 96  # of K * D = 128


def captured(target, n: int = 60) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    capture = LayerCapture(model, LAYER_IDS)
    return [capture(torch.from_numpy(ids.astype(np.int64))[None])[0] for ids, _ in synthetic_samples(n, seed=0)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compact")
    target = make_tiny_target(tmp / "target")
    features = captured(target)
    basis = compact.fit_basis(torch.cat(features[0:40:2]), RANK)  # a sample of the first shard's samples
    write_basis(basis, tmp / "basis.zarr")
    codec = CompactCodec.with_basis(read_basis(tmp / "basis.zarr"), "fp8_e4m3", "float32")
    store = make_store(tmp, target, codec=codec, basis=tmp / "basis.zarr", name="compact.zarr")
    # the same samples stored as float32 features: the compact store's decoded values, and the originals
    reconstruction = make_store(tmp, target, name="reconstruction.zarr",
                                transform=lambda x: codec.decode({k: v.numpy() for k, v in codec.encode(x)[0].items()}))
    return {"tmp": tmp, "target": target, "features": features, "basis": basis, "store": store,
            "reconstruction": reconstruction}


def test_the_round_trip_is_within_the_bound_the_store_records(tiny):
    store = HiddenStateStore(tiny["store"])
    attrs = store.attrs
    assert attrs["logical_dtype"] == "compact" and store.feature_shape == (2, D)
    assert attrs["compact"]["rank"] == RANK and attrs["compact"]["basis_sha256"] == tiny["basis"].sha256()
    assert attrs["compact"]["method"].startswith("linear low-rank basis")
    assert zarr.open_group(str(tiny["store"]), mode="r")["compact_basis"].shape == (2 * D, RANK)
    # samples were assigned to shards s::2; the shard records its largest per-token error and per-layer errors
    order = [i for s in range(2) for i in range(60)[s::2]]
    worst, per_layer, norms = 0.0, torch.zeros(2), torch.zeros(2)
    for i, original in zip(range(len(store)), (tiny["features"][j] for j in order)):
        _, _, decoded = store[i]
        error = original - decoded
        worst = max(worst, float((error.flatten(1).norm(dim=1) / original.flatten(1).norm(dim=1)).max()))
        per_layer += error.norm(dim=2).square().sum(0)
        norms += original.norm(dim=2).square().sum(0)
    recorded = [shard["stats"] for shard in attrs["shards"]]
    # sum |x_k|^2 / D per shard and layer
    energy = [np.square(s["rms"]) * shard["num_tokens"] for s, shard in zip(recorded, attrs["shards"])]
    bound = max(s["max_token_relative_error"] for s in recorded)
    print(f"largest per-token relative error {worst:.4f}, recorded bound {bound:.4f}")
    assert 0 < worst <= bound * (1 + 1e-5)
    recorded_layers = np.sqrt(sum(np.square(s["relative_error"]) * e for s, e in zip(recorded, energy)) / sum(energy))
    assert np.allclose(recorded_layers, (per_layer / norms).sqrt().numpy(), rtol=1e-4)
    # the training view: the stored coefficients, without the basis
    coefficients = HiddenStateStore(tiny["store"], coefficients=True)
    assert coefficients.feature_shape == (1, RANK)
    _, _, c = coefficients[0]
    assert torch.allclose(compact.reconstruct(c[:, 0], tiny["basis"]), store[0][2], atol=1e-5)


def test_a_shard_of_another_basis_or_a_changed_basis_is_refused(tiny, tmp_path):
    from dflash_pipeline.store import merge_shards

    other = compact.fit_basis(torch.cat(tiny["features"][1:41:2]), RANK)
    write_basis(other, tmp_path / "other.zarr")
    shards = sorted(tiny["tmp"].glob("compact.zarr.shard_*"))
    with pytest.raises(StoreError, match="check: basis"):
        merge_shards(shards, [None] * len(shards), tmp_path / "store.zarr", {}, tmp_path / "other.zarr")
    copy = tmp_path / "copy.zarr"
    shutil.copytree(tiny["store"], copy)  # a copy: the store's basis is a hard link of the basis file
    array = zarr.open_array(str(copy / "compact_basis"), mode="r+")
    array[0, 0] = array[0, 0] + 1e-3
    store = HiddenStateStore(copy)
    with pytest.raises(StoreError, match="sha256"):
        store[0]


def first_step_gradients(config: dict, store, target, state):
    trainer = Trainer(TrainConfig(**config), str(store), str(target), str(state))
    packs = next(trainer.epoch_steps(0, 0))
    total = sum(p.weights.sum().double() for p in packs)
    loss = float(accumulate_gradients(trainer.drafter, packs, total, amp=False))
    return trainer, loss, {name: p.grad.clone() for name, p in trainer.drafter.named_parameters()}


def test_training_on_the_compact_store_matches_training_on_its_reconstruction(tiny, tmp_path):
    """fc' over the stored coefficients against fc over the decoded features (a float32 store of them): the first
    step's loss and gradients (fc's is fc''s times U^T), then a Muon run's losses and its exported drafter."""
    config = {**BASE, "optimizer": "muon", "epochs": 2}
    coef, loss_c, grads_c = first_step_gradients(config, tiny["store"], tiny["target"], tmp_path / "a")
    full, loss_f, grads_f = first_step_gradients(config, tiny["reconstruction"], tiny["target"], tmp_path / "b")
    U = coef.basis.vectors
    assert coef.drafter.fc.weight.shape == (D, RANK) and full.drafter.fc.weight.shape == (D, 2 * D)
    assert loss_c == pytest.approx(loss_f, rel=1e-5)
    for name, grad in grads_f.items():
        other = grads_c[name] @ U.T if name == "fc.weight" else grads_c[name]
        assert torch.allclose(grad, other, atol=1e-5 * grad.abs().max().item()), name

    runs = {}
    for name, store in (("coefficients", tiny["store"]), ("reconstruction", tiny["reconstruction"])):
        out = tmp_path / name
        train(dict(config), **paths({"store": store, "target": tiny["target"]}, out))
        runs[name] = (pd.read_csv(out / "log.csv"), out / "drafter")
    a, b = runs["coefficients"][0], runs["reconstruction"][0]
    assert np.allclose(a["train_loss"].dropna(), b["train_loss"].dropna(), rtol=0.02)
    assert a["val_loss"].dropna().iloc[-1] == pytest.approx(b["val_loss"].dropna().iloc[-1], rel=0.02)
    assert a["val_loss"].dropna().iloc[-1] < 0.8 * a["val_loss"].dropna().iloc[0]  # it learned
    exported = load_dflash(runs["coefficients"][1])  # an ordinary checkpoint: fc over the K * D features
    assert exported.fc.weight.shape == (D, 2 * D)

    # the compact store decoded in the trainer (train.coefficients: false) is its reconstruction, bit for bit
    out = tmp_path / "decoded"
    train({**config, "coefficients": False}, **paths(tiny, out))
    decoded = pd.read_csv(out / "log.csv")
    pd.testing.assert_frame_equal(decoded, b)


def test_the_workflow_fits_one_basis_before_extraction_and_reruns_exactly_what_depends_on_it(tmp_path, smollm2_dir):
    """snakemake with extract.store_dtype compact on SmolLM2: one compact_basis job, then every extract job encodes
    with its basis; a deleted shard reruns that extract job and merge only, a deleted basis every extract job."""
    from workflow_helpers import default_config, scheduled_jobs, snakemake, write_config

    config = default_config()
    config["data"]["max_conversations"] = 12
    config["target"]["path"] = str(smollm2_dir)
    config["regenerate"]["enabled"] = False
    config["tokenize"].update(num_shards=2, max_length=128)
    config["extract"].update(store_dtype="compact", tokens_per_batch=512, layer_ids=[1, 27],  # a faster fit
                             compact={"rank": 64, "fit_tokens": 400, "coefficients": "fp8_e4m3"})
    config["gpu"] = {"count": 2}
    write_config(tmp_path, config)
    assert scheduled_jobs(tmp_path)["compact_basis"] == 1
    snakemake(tmp_path, "store")
    store = HiddenStateStore(tmp_path / "results/store.zarr")
    basis = read_basis(tmp_path / "results/compact/basis.zarr")
    assert store.attrs["compact"]["basis_sha256"] == basis.sha256() and basis.rank == 64
    assert all(shard["stats"]["max_token_relative_error"] < 1 for shard in store.attrs["shards"])
    assert store[0][2].shape[1:] == (2, 576)
    shutil.rmtree(tmp_path / "results/extract/shard_00001.zarr")
    assert scheduled_jobs(tmp_path) == {"extract": 1, "merge": 1, "store": 1}
    shutil.rmtree(tmp_path / "results/compact/basis.zarr")
    assert scheduled_jobs(tmp_path) == {"compact_basis": 1, "extract": 2, "merge": 1, "store": 1}
