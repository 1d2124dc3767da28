"""Tests of the DFlash trainer (src/dflash_pipeline/train/), on CPU, on the tiny store of tests/train_helpers.py."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from snakemake.exceptions import WorkflowError

from dflash_pipeline.config import load_config
from dflash_pipeline.drafter import DFlashDrafter, config_from_export_dict, load_dflash, load_target_embeddings
from dflash_pipeline.store import HiddenStateStore, store_codec
from dflash_pipeline.losses import default_gamma
from dflash_pipeline.train import (
    DataGaps,
    LengthGroupedBatches,
    LoopClock,
    TrainConfig,
    Trainer,
    accumulate_gradients,
    build_drafter,
    make_optimizers,
    packed_forward,
    split_indices,
    train,
)
from dflash_pipeline.train.step import cosine_with_warmup
from dflash_pipeline.train_data import AnchorRule, Pack, Preloaded, StreamedSteps, held_dtype, host_tensor
from train_helpers import BASE, D, LAYER_IDS, LAYERS, V, make_store, make_tiny_target, paths
from workflow_helpers import REPO


def step_packs(store, samples, cfg, drafter, **kwargs):
    """The packs the trainer builds for ``samples`` (epoch 0), from the store preloaded on the CPU."""
    rule = AnchorRule(cfg.block_size, default_gamma(cfg.block_size), cfg.max_anchors, cfg.seed)
    return Preloaded(store, "cpu").step(samples, rule, 0, len(LAYER_IDS), drafter.mask_token_id,
                                        drafter.config.hidden_size, **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    target = make_tiny_target(tmp / "target")
    return {"target": target, "store": make_store(tmp, target)}


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """One uninterrupted run of BASE, in this process."""
    out = tmp_path_factory.mktemp("reference")
    metrics = train(dict(BASE), **paths(tiny, out))
    return {"out": out, "metrics": metrics, "log": pd.read_csv(out / "log.csv")}


def run_rank(tiny, out: Path, config: dict, env: dict | None = None, log_name: str = "run.log") -> subprocess.Popen:
    spec = json.dumps({"config": config, **paths(tiny, out)})
    handle = open(out / log_name, "w")
    return subprocess.Popen([sys.executable, "-m", "dflash_pipeline.train", "--spec", spec], stdout=handle,
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def safetensors_of(directory: Path) -> dict:
    return load_file(str(directory / "model.safetensors"))


# ---- data ----
def test_split_and_length_grouped_batches(tiny):
    store = HiddenStateStore(tiny["store"])
    train_ids, val_ids = split_indices(len(store), 0.15, seed=0)
    assert (train_ids, val_ids) == split_indices(len(store), 0.15, seed=0)
    assert len(val_ids) == 9 and not set(train_ids) & set(val_ids) and len(train_ids) + len(val_ids) == len(store)
    assert len(split_indices(10, 0.001, seed=0)[1]) == 1
    sampler = LengthGroupedBatches(train_ids, store.lengths, 320, seed=0)
    epoch0, epoch1 = sampler.batches(0), sampler.batches(1)
    for batches in (epoch0, epoch1):
        assert sorted(i for b in batches for i in b) == train_ids
        assert all(sum(store.lengths[i] for i in b) <= 320 or len(b) == 1 for b in batches)
    assert epoch0 != epoch1 and len(epoch0) == len(epoch1) and epoch0 == sampler.batches(0)


def test_host_tensor_joins_the_arrays_in_order_and_widens_but_never_truncates():
    joined = host_tensor([np.array([5, 7], dtype=np.int32), np.array([1, 2**40], dtype=np.int64)], torch.int64, False)
    assert joined.dtype == torch.int64 and joined.tolist() == [5, 7, 1, 2**40]
    with pytest.raises(TypeError):  # a float array never becomes integers silently
        host_tensor([np.array([0.5])], torch.int64, False)


@pytest.fixture(scope="module")
def fp8_store(tiny, tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("fp8"), tiny["target"], codec=store_codec("fp8_e4m3", "float32"))


@pytest.mark.parametrize("stored", ["float32", "fp8"])
def test_streamed_steps_equal_preloaded_steps(tiny, fp8_store, stored):
    """The same packs (layout and features) whether read by 0 or 2 spawn workers or gathered from the preloaded
    store, over two passes of a persistent loader. An fp8 store's rows are handed over as stored (a byte per value
    and the scales) and decoded where the step runs, to the values the store decodes them to."""
    store = HiddenStateStore(tiny["store"] if stored == "float32" else fp8_store)
    rule = AnchorRule(block_size=8, gamma=4.0, max_anchors=12)
    batches = LengthGroupedBatches(range(len(store)), store.lengths, 320, seed=0).batches(0)[:4]
    preloaded = Preloaded(store, "cpu")
    reference = [preloaded.step(b, rule, epoch, len(LAYER_IDS), V - 1, D) for epoch in (0, 1) for b in batches]
    for workers in (0, 2):
        streamed = StreamedSteps(store, D, workers, prefetch_factor=2, pin_memory=False)
        seen = []
        for epoch in (0, 1):  # persistent workers see the new keys
            for step in streamed.loader([(rule, epoch, b) for b in batches], "train"):
                if stored == "fp8":
                    assert all(f["features"].dtype == torch.uint8 for _, f in step)
                seen.append([Pack.to_device(layout, streamed.on_device(f, "cpu"), len(LAYER_IDS), V - 1, 8, "cpu")
                             for layout, f in step])
        streamed.close()
        assert len(seen) == len(reference) == 8
        for mine, theirs in zip(seen, reference):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                for key in ("context", "anchors", "blocks", "slots", "labels", "weights"):
                    assert torch.equal(getattr(a, key), getattr(b, key)), key
                assert a.lengths == b.lengths and a.block_counts == b.block_counts


def test_a_store_pickles_as_its_path_and_opens_anew(tiny):
    """A DataLoader's spawn workers get the store as its path and options, whatever it holds in memory (a worker's
    process object over the pipe's 64 KiB makes each worker's start wait for the previous one's imports)."""
    import pickle

    store = HiddenStateStore(tiny["store"])
    expected = [store[i] for i in (0, len(store) - 1)]
    store.sample_offsets = np.arange(100_000)  # as large as a store of 100,000 samples holds
    data = pickle.dumps(store)
    assert len(data) < 1024
    again = pickle.loads(data)
    assert type(again) is HiddenStateStore
    assert np.array_equal(again.sample_offsets, HiddenStateStore(tiny["store"]).sample_offsets)
    for got, want in zip((again[0], again[len(again) - 1]), expected):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("stored", ["float32", "fp8"])
def test_a_background_preload_loads_the_stores_rows_and_restores_the_switch_interval(tiny, fp8_store, stored):
    """The preload in a thread beside the caller's Python (the trainer builds and compiles meanwhile): the store's
    rows as read sample by sample, and the interpreter's switch interval set back once it has loaded. An fp8 store
    is held as stored (a byte per value, a float32 scale per layer: under half of bfloat16's bytes) and its rows
    decode to what the store decodes them to."""
    store = HiddenStateStore(tiny["store"] if stored == "float32" else fp8_store)
    before = sys.getswitchinterval()
    preloaded = Preloaded(store, "cpu", threads=2, rows_per_read=7, background=True)
    preloaded.wait()
    assert sys.getswitchinterval() == before
    K = len(LAYER_IDS)
    if stored == "fp8":
        assert preloaded.nbytes == store.num_tokens * (K * D + 4 * K) < store.num_tokens * K * D * 2
    else:
        assert preloaded.nbytes == store.num_tokens * K * D * 4
    offsets = store.sample_offsets
    for i in range(len(store)):
        rows = {name: a[offsets[i] : offsets[i + 1]] for name, a in preloaded.arrays.items()}
        held = store.codec.decode_tensors(rows) if stored == "fp8" else rows["features"]
        assert torch.equal(held, store[i][2])


# ---- one step: packed = one pass per sequence ----
def test_packed_step_equals_one_pass_per_sequence(tiny):
    """One packed forward + backward over sequences of different lengths and anchor counts (random anchors)
    gives the loss sum and the gradients of one pass per sequence; so do packs split under a small cap."""
    store = HiddenStateStore(tiny["store"])
    cfg = TrainConfig(**{**BASE, "max_anchors": 40})
    drafter = build_drafter(cfg, store, str(tiny["target"]), torch.device("cpu"), torch.float32).train()
    with torch.no_grad():  # weights far from their init: attention that leaks across sequences would show
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    order = np.argsort(store.lengths)
    picks = [int(order[0]), int(order[len(order) // 3]), int(order[2 * len(order) // 3]), int(order[-1])]
    single = step_packs(store, picks, cfg, drafter, pack_elements=0)  # every sequence a pass alone
    assert len(single) == 4 and len({p.context.shape[1] for p in single}) == 4
    assert len({p.anchors.numel() for p in single}) >= 3
    total_weight = sum(p.weights.sum().double() for p in single)
    params = list(drafter.parameters())

    def gradients(model, packs, amp=False):
        model.zero_grad(set_to_none=True)
        loss = float(accumulate_gradients(model, packs, total_weight, amp))
        return loss, [p.grad.clone() for p in model.parameters()]

    loop_loss, loop_grads = gradients(drafter, single)
    packed = step_packs(store, picks, cfg, drafter)
    assert len(packed) == 1  # all four in one pass
    cap = 2 * max(p.blocks.numel() + p.context.shape[1] for p in single) * drafter.config.hidden_size
    split = step_packs(store, picks, cfg, drafter, pack_elements=cap)
    assert len(split) in (2, 3)
    scale = max(g.abs().max().item() for g in loop_grads)
    for packs in (packed, split):
        loss, grads = gradients(drafter, packs)
        worst = max((a - b).abs().max().item() for a, b in zip(grads, loop_grads))
        print(f"{len(packs)} pack(s): loss sum {loss:.6f} vs {loop_loss:.6f}, max |grad diff| {worst:.2e} of {scale:.2e}")
        assert abs(loss - loop_loss) <= 1e-5 * abs(loop_loss)
        assert worst <= 1e-5 * scale

    compiled = copy.deepcopy(drafter)  # train.compile's path (the default on GPU), here compiled for the CPU
    compiled.compile_pointwise()
    loss, grads = gradients(compiled, packed)
    worst = max((a - b).abs().max().item() for a, b in zip(grads, loop_grads))
    assert abs(loss - loop_loss) <= 1e-5 * abs(loop_loss) and worst <= 1e-5 * scale

    # Under bf16 autocast (as on the GPU) the compiled functions see more input variants (dtypes, ranks, grad
    # modes) than dynamo compiles by default; past its limit the rest would run eager, unnoticed.
    counters = torch._dynamo.utils.counters
    counters.clear()
    gradients(compiled, packed, amp=True)
    with torch.no_grad():
        packed_forward(compiled, packed[0], True, train=False)
    assert not [reason for reason in counters["unimplemented"] if "recompile limit" in reason]

    with torch.no_grad():  # validation: the same losses and per-slot correctness, packed or not
        whole = packed_forward(drafter, packed[0], False, train=False)
        alone = [packed_forward(drafter, pack, False, train=False) for pack in single]
    assert abs(whole[0].item() - sum(r[0].item() for r in alone)) <= 1e-5 * whole[0].item()
    assert torch.equal(whole[2], torch.cat([r[2] for r in alone]))


# ---- learning ----
def test_training_lowers_validation_loss_and_raises_the_proxy(reference):
    log = reference["log"]
    before, after = log.iloc[0], log.iloc[-1]
    print(f"val loss {before.val_loss:.3f} -> {after.val_loss:.3f}, "
          f"proxy {before.val_proxy:.3f} -> {after.val_proxy:.3f}")
    assert before.step == 0 and np.isnan(before.train_loss)
    # measured (CPU, fp32): val loss 17.8 -> 0.25, proxy 1.00 -> 6.47 of at most 8, slot-1 accuracy 0.97
    assert after.val_loss < 1.0 and before.val_loss > 10
    assert before.val_proxy < 1.1 and after.val_proxy > 4.0
    assert after.val_acc_1 > 0.8
    assert log.val_loss.notna().sum() == BASE["epochs"] + 1  # step 0 and every epoch end
    assert log.train_loss.notna().sum() == log.step.max()
    assert (reference["out"] / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_train_job_writes_its_timings(reference):
    """timing.json (what benchmarks read instead of the log): the loop's parts add up, the steps are the log's."""
    timing = json.loads((reference["out"] / "timing.json").read_text())
    assert timing["steps"] == reference["log"].step.max() and timing["tokens_per_s"] > 0
    assert timing["steps_s"] == pytest.approx(timing["loop_s"] - timing["validation_s"] - timing["checkpoint_s"])
    assert 0 < timing["first_step_s"] and timing["process_to_trainer_s"] < timing["job_s"]
    assert timing["data_gaps_s"] == 0 and timing["peak_gpu_gib"] == 0  # on the CPU: no CUDA events, no GPU memory


def test_the_step_time_leaves_out_the_loaders_start():
    """timing.json's ``step_s`` counts from the loop's start, as ``steps_s`` does; a streamed loader's start before
    it (its workers' imports) is in ``first_step_s`` only."""
    clock = LoopClock(torch.device("cpu"), step=0, tokens=0)
    clock.began -= 100  # the loader's workers started in 100 s before the loop did
    clock.start()
    for _ in range(3):
        clock.launched(time.perf_counter())
    timing = clock.finish(3, 300, rank=0)
    assert timing["first_step_s"] >= 100 and 0 <= timing["step_s"] < 1


def test_the_progress_line_gives_the_pace_and_the_time_left():
    clock = LoopClock(torch.device("cpu"), step=10, tokens=0)
    clock.started -= 100  # 5 steps in 100 s
    assert clock.progress(15, 30) == "20.000 s/step, 0:05:00 left"
    assert clock.progress(30, 30).endswith("0:00:00 left")


# ---- length: train.steps ----
def steps_per_epoch(tiny, config: dict) -> int:
    return Trainer(TrainConfig(**config), str(tiny["store"]), str(tiny["target"]), "/nonexistent-state").per_epoch


@pytest.mark.parametrize("steps, preload", [(13, False), (47, True)])  # of 20 steps per epoch: part of the first;
def test_a_run_of_train_steps_stops_at_that_step(tiny, tmp_path, steps, preload):  # two epochs and part of a third
    """train.steps N: exactly N steps whatever train.epochs says, the last epoch stopped at step N and validated
    there; the learning rate's warm-up and decay are over the N steps."""
    config = {**BASE, "epochs": 1, "steps": steps, "preload": preload}
    per_epoch = steps_per_epoch(tiny, config)
    assert steps % per_epoch and (steps < per_epoch) == (steps == 13)  # not vacuous: mid-epoch; across epochs
    train(dict(config), **paths(tiny, tmp_path))
    log = pd.read_csv(tmp_path / "log.csv")
    assert log.step.tolist() == list(range(steps + 1)) and log.epoch.iloc[-1] == pytest.approx(steps / per_epoch)
    assert json.loads((tmp_path / "drafter" / "training.json").read_text())["steps"] == steps
    assert json.loads((tmp_path / "timing.json").read_text())["steps"] == steps
    assert log.step[log.val_loss.notna()].tolist() == [0, *range(per_epoch, steps, per_epoch), steps]
    schedule = cosine_with_warmup(steps, BASE["warmup_ratio"])
    np.testing.assert_allclose(log.lr[1:], [BASE["lr"] * schedule(step - 1) for step in log.step[1:]], rtol=1e-12)
    assert log.lr.iloc[-1] < 0.02 * BASE["lr"] < log.lr[1:].max()


def test_train_steps_of_whole_epochs_is_the_run_of_those_epochs(tiny, tmp_path):
    """Each epoch of a train.steps run is the epoch loop's own (its order and anchors): the same log and weights."""
    per_epoch = steps_per_epoch(tiny, BASE)
    train({**BASE, "epochs": 2}, **paths(tiny, tmp_path / "epochs"))
    train({**BASE, "epochs": 5, "steps": 2 * per_epoch}, **paths(tiny, tmp_path / "steps"))
    assert pd.read_csv(tmp_path / "epochs" / "log.csv").equals(pd.read_csv(tmp_path / "steps" / "log.csv"))
    mine, theirs = safetensors_of(tmp_path / "steps" / "drafter"), safetensors_of(tmp_path / "epochs" / "drafter")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_train_steps_below_one_is_refused_naming_the_key():
    with pytest.raises(WorkflowError, match=r"(?s)0 is less than the minimum of 1.*instance\['train'\]\['steps'\]"):
        load_config([REPO / "config" / "config.yaml"], {"train": {"steps": 0}})
    with pytest.raises(ValueError, match=r"train.steps -3: expected a number of optimizer steps >= 1"):
        TrainConfig(steps=-3)


# ---- resume ----
@pytest.mark.parametrize("steps", [None, 47])  # 47: 20 steps per epoch, checkpoints mid-epoch, the last one cut
def test_kill_9_then_rerun_resumes_and_matches_an_uninterrupted_run(tiny, reference, tmp_path, steps):
    config = dict(BASE) if steps is None else {**BASE, "steps": steps, "checkpoint_every": 7}
    uninterrupted = reference["out"]
    if steps is not None:
        uninterrupted = tmp_path / "uninterrupted"
        train(dict(config), **paths(tiny, uninterrupted))
    proc = run_rank(tiny, tmp_path, config, log_name="first.log")
    deadline = time.monotonic() + 120
    while (tmp_path / "first.log").read_text().count("saved checkpoint") < 2:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "drafter").exists()
    assert run_rank(tiny, tmp_path, config, log_name="second.log").wait() == 0
    second = (tmp_path / "second.log").read_text()
    resumed = int(second.split("resuming from step ")[1].split()[0])
    expected = pd.read_csv(uninterrupted / "log.csv")
    assert 0 < resumed < expected.step.max() and second.count("validation of the untrained drafter") == 1
    assert steps is None or expected.step.max() == steps
    mine, theirs = safetensors_of(tmp_path / "drafter"), safetensors_of(uninterrupted / "drafter")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert pd.read_csv(tmp_path / "log.csv").equals(expected)


def test_a_checkpoint_of_another_config_is_not_resumed(tiny, reference, tmp_path, caplog):
    import shutil

    shutil.copytree(reference["out"] / "state", tmp_path / "state")
    with caplog.at_level("INFO"):
        train({**BASE, "epochs": 1, "lr": 1e-3}, **paths(tiny, tmp_path))
    assert "its train_config differ(s)" in caplog.text and "resuming from step" not in caplog.text


# ---- export ----
def test_exported_checkpoint_format_and_round_trip(tiny, reference, tmp_path):
    directory = reference["out"] / "drafter"
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors", "training.json"]
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == BASE["block_size"] and config["num_target_layers"] == LAYERS
    assert config["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": LAYER_IDS, "use_swa": False,
                                       "swa_window_size": None, "causal": False}
    assert config["layer_types"] == ["full_attention"] * BASE["num_layers"] and config["num_hidden_layers"] == 2
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {k for k in keys if not k.startswith("layers.")} == {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {"0", "1"}
    record = json.loads((directory / "training.json").read_text())
    manifest = HiddenStateStore(tiny["store"]).manifest
    assert record["tokenizer_sha256"] == manifest["tokenizer_sha256"] and record["target"] == str(tiny["target"])
    assert record["target_layer_ids"] == LAYER_IDS and record["final"]["val_proxy"] == reference["metrics"]["val_proxy"]

    init = reference["out"] / "drafter_init"  # the untrained drafter: same format and keys, other weights
    assert json.loads((init / "config.json").read_text()) == config
    assert json.loads((init / "training.json").read_text())["steps"] == 0
    untrained, trained_weights = safetensors_of(init), safetensors_of(directory)
    assert untrained.keys() == trained_weights.keys()
    assert not torch.equal(untrained["fc.weight"], trained_weights["fc.weight"])

    embed, head = load_target_embeddings(tiny["target"])
    loaded = load_dflash(directory, embed, head)
    state = torch.load(reference["out"] / "state" / "checkpoint.pt", weights_only=True)
    trained = DFlashDrafter(config_from_export_dict(config), embed, head)
    trained.load_state_dict(state["model"])
    ids, mask, features = HiddenStateStore(tiny["store"])[0]
    anchors = torch.tensor([12, 20])
    blocks = torch.full((2, BASE["block_size"]), V - 1)
    blocks[:, 0] = ids[anchors]
    with torch.no_grad():
        a = loaded.forward_blocks(features.reshape(1, len(ids), -1), anchors, blocks)
        b = trained.forward_blocks(features.reshape(1, len(ids), -1), anchors, blocks)
    assert torch.equal(a, b)


# ---- data parallel ----
# muon: its Newton-Schulz work shared by the two ranks; steps 27: both ranks stop part-way through the second epoch
@pytest.mark.parametrize("optimizer, steps", [("adamw", None), ("muon", None), ("adamw", 27)])
def test_two_gloo_ranks_give_the_one_process_result(tiny, tmp_path, optimizer, steps):
    short = {**BASE, "epochs": 2, "steps": steps, "optimizer": optimizer}  # short: rounding differences grow
    one = train(dict(short), **paths(tiny, tmp_path / "one"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [run_rank(tiny, tmp_path, dict(short), {**env, "RANK": str(r), "LOCAL_RANK": str(r)}, f"rank{r}.log")
             for r in (0, 1)]
    assert [p.wait(timeout=240) for p in ranks] == [0, 0], (tmp_path / "rank0.log").read_text()
    assert "world 2" in (tmp_path / "rank0.log").read_text()
    mine, theirs = safetensors_of(tmp_path / "drafter"), safetensors_of(tmp_path / "one" / "drafter")
    init = safetensors_of(tmp_path / "one" / "drafter_init")
    if optimizer == "adamw":  # Adam turns summation-order rounding of near-zero gradients into ~1e-5 weight changes
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-4, atol=5e-5)
    else:  # Muon's bf16 Newton-Schulz turns that rounding into ~1 % of each update, and the runs drift apart by a few
        # % of the training's change (the same with every rank orthogonalising everything: the sharding itself is
        # exact, tests/test_muon.py); an update applied to the wrong matrix would differ by ~100 %
        drift = sorted(float((mine[k] - theirs[k]).norm() / (theirs[k] - init[k]).norm()) for k in theirs)
        assert drift[len(drift) // 2] < 0.1 and drift[-1] < 0.5, drift
    log, ref = pd.read_csv(tmp_path / "log.csv"), pd.read_csv(tmp_path / "one" / "log.csv")
    assert log.step.tolist() == ref.step.tolist() == list(range((steps or log.step.max()) + 1))
    np.testing.assert_allclose(log.val_loss.dropna(), ref.val_loss.dropna(), rtol=1e-4 if optimizer == "adamw" else 2e-2)
    assert abs(log.val_proxy.iloc[-1] - one["val_proxy"]) < 0.02


# ---- recipe options ----
def test_untrained_validation_after_training_equals_before(tiny, reference):
    """Step 0 of the log is validated after the last step from the saved initial weights: the numbers it would
    have given before the first step."""
    trainer = Trainer(TrainConfig(**BASE), str(tiny["store"]), str(tiny["target"]), "/nonexistent-state")
    before = trainer.validate()
    logged = reference["log"].iloc[0]
    assert logged.step == 0
    for key, value in before.items():
        assert value == logged[key], key


def test_flex_kernel_options_reach_every_layer_and_keep_a_checkpoint_valid(tiny):
    """train.flex_kernel_options goes to each layer's FlexAttention call; a run resumed with other options (a speed
    setting) keeps its checkpoint: the fingerprint leaves them out."""
    from dflash_pipeline.train.checkpoint import fingerprint

    store = HiddenStateStore(tiny["store"])
    options = {"BLOCK_M": 64, "BLOCK_N": 64}
    cfg = TrainConfig(**{**BASE, "flex_kernel_options": options})
    drafter = build_drafter(cfg, store, str(tiny["target"]), torch.device("cpu"), torch.float32)
    assert [layer.self_attn.flex_kernel_options for layer in drafter.layers] == [options] * len(drafter.layers)
    plain = build_drafter(TrainConfig(**BASE), store, str(tiny["target"]), torch.device("cpu"), torch.float32)
    assert all(layer.self_attn.flex_kernel_options is None for layer in plain.layers)
    shape = drafter.config.to_dict()
    assert fingerprint(cfg, store, shape) == fingerprint(TrainConfig(**BASE), store, shape)


def test_optimizer_parameter_groups(tiny):
    store = HiddenStateStore(tiny["store"])
    cfg = TrainConfig(**{**BASE, "optimizer": "muon", "muon_lr": 0.05})
    drafter = build_drafter(cfg, store, str(tiny["target"]), torch.device("cpu"), torch.float32)
    muon, adamw = make_optimizers(cfg, drafter)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in drafter.named_parameters()}
    matrices = {names[id(p)] for p in muon.param_groups[0]["params"]}
    others = {names[id(p)] for p in adamw.param_groups[0]["params"]}
    assert "fc.weight" in matrices and "layers.0.self_attn.q_proj.weight" in matrices
    assert "layers.1.mlp.down_proj.weight" in matrices and all(drafter.get_parameter(n).ndim == 2 for n in matrices)
    assert {"hidden_norm.weight", "norm.weight", "layers.0.input_layernorm.weight",
            "layers.0.self_attn.q_norm.weight"} <= others
    assert not matrices & others and len(matrices | others) == len(list(drafter.parameters()))
    assert muon.param_groups[0]["lr"] == 0.05 and adamw.param_groups[0]["lr"] == BASE["lr"]
    (only,) = make_optimizers(TrainConfig(**BASE), drafter)
    assert isinstance(only, torch.optim.AdamW) and len(only.param_groups[0]["params"]) == len(matrices | others)


def test_data_gaps_spread_tells_few_long_gaps_from_many_short():
    gaps = DataGaps(torch.device("cpu"))
    assert gaps.spread() == ""
    gaps.gaps = [0.0001] * 30 + [0.02] + [0.0001] * 9 + [0.008]
    summary = gaps.spread()
    assert "median 0.10 ms, max 20.0 ms, 88 % of it in gaps over 5 ms" in summary
    steps = [int(n) for n in summary.split("steps ")[-1].rstrip(")").split(", ")]
    assert len(steps) == 5 and {32, 42} <= set(steps)  # the 31st and 41st gaps come before steps 32 and 42


def test_bf16_held_features_give_the_same_step_under_autocast(tiny, tmp_path):
    """Under bf16 autocast the trainer holds features in bfloat16 (train_data.held_dtype), preloaded or streamed:
    fc takes them in bfloat16 under autocast, so the loss and every gradient are bit-equal to those from float32
    features, at half the memory of a float32 store."""
    store = HiddenStateStore(make_store(tmp_path, tiny["target"]))
    assert store.feature_dtype == torch.float32 and held_dtype(store, amp=True) == torch.bfloat16
    assert held_dtype(store, amp=False) == torch.float32
    cfg = TrainConfig(**BASE)
    drafter = build_drafter(cfg, store, str(tiny["target"]), torch.device("cpu"), torch.bfloat16).train()
    rule = AnchorRule(cfg.block_size, default_gamma(cfg.block_size), cfg.max_anchors, cfg.seed)
    samples = list(range(0, len(store), 3))
    results = []
    for dtype in (None, torch.bfloat16):
        packs = Preloaded(store, "cpu", dtype=dtype).step(samples, rule, 0, len(LAYER_IDS), drafter.mask_token_id, D)
        assert packs[0].context.dtype == (dtype or torch.float32)
        total_weight = sum(p.weights.sum().double() for p in packs)
        drafter.zero_grad(set_to_none=True)
        loss = accumulate_gradients(drafter, packs, total_weight, amp=True)
        results.append((loss, [p.grad.clone() for p in drafter.parameters() if p.grad is not None]))
    (loss32, grads32), (loss16, grads16) = results
    assert torch.isfinite(loss32) and torch.equal(loss32, loss16) and len(grads32) == len(grads16) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads32, grads16))
    streamed = StreamedSteps(store, D, 0, prefetch_factor=2, pin_memory=False, dtype=torch.bfloat16)
    [step] = streamed.loader([(rule, 0, samples)], "train")
    assert all(features.dtype == torch.bfloat16 for _, features in step)


@pytest.mark.parametrize("stored", ["float32", "fp8"])
def test_streamed_and_preloaded_training_are_the_same(tiny, fp8_store, tmp_path, stored):
    """train.preload only moves where the samples are read: the same log, the same weights (an fp8 store preloaded
    as stored, its steps decoded on the device, as streamed steps are)."""
    short = {**BASE, "epochs": 2}
    store = {} if stored == "float32" else {"store": str(fp8_store)}
    train({**short, "preload": True}, **{**paths(tiny, tmp_path / "preloaded"), **store})
    train({**short, "preload": False, "num_workers": 0}, **{**paths(tiny, tmp_path / "streamed"), **store})
    if stored == "fp8":
        K = len(LAYER_IDS)
        timing = json.loads((tmp_path / "preloaded" / "timing.json").read_text())
        assert timing["preload_gib"] * 2**30 == pytest.approx(HiddenStateStore(fp8_store).num_tokens * (K * D + 4 * K))
    assert pd.read_csv(tmp_path / "preloaded" / "log.csv").equals(pd.read_csv(tmp_path / "streamed" / "log.csv"))
    mine, theirs = safetensors_of(tmp_path / "streamed" / "drafter"), safetensors_of(tmp_path / "preloaded" / "drafter")
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_compiling_while_the_store_loads_changes_nothing(tiny, tmp_path):
    """The trainer preloads in the background and, on GPU, compiles on the first step's shapes meanwhile
    (warm_up: a forward and backward over the rows loaded so far, gradients dropped). Forced here on CPU, before
    the features have loaded: the same log and the same weights as a run without it."""
    short = {**BASE, "epochs": 2, "preload": True}
    runs = []
    for warm in (False, True):
        trainer = Trainer(TrainConfig(**short), str(tiny["store"]), str(tiny["target"]), str(tmp_path / str(warm)))
        if warm:
            trainer.preloaded.arrays["features"].fill_(float("nan"))  # worse than the zeros of rows not loaded yet
            trainer.warm_up()
            assert all(p.grad is None for p in trainer.params)
            trainer.preloaded._load(list(trainer.data.feature_pieces(1 << 15)), 2)  # the load finishes later
        rows = trainer.run()
        runs.append((pd.DataFrame(rows), trainer.drafter.state_dict()))
    (log, weights), (warm_log, warm_weights) = runs
    assert log.equals(warm_log)
    assert all(torch.equal(weights[k], warm_weights[k]) for k in weights)


def test_a_dflash2_run_trains_exports_and_loads_its_selector(tiny, tmp_path):
    """train.architecture dflash2 (Muon on the convolutions' projections, AdamW on the codebooks): the loss falls, the
    export is a DFlash2DraftModel with the selector's codebooks stored without ``.weight``, and it loads back into
    the drafter the checkpoint holds; its greedy walk decodes what the target decodes."""
    from transformers import AutoModelForCausalLM

    from dflash_pipeline.speculative import DFlash2Proposer, speculative_generate

    config = {**BASE, "epochs": 4, "optimizer": "muon", "architecture": "dflash2", "conv_group_size": 16,
              "selector_rank": 8, "selector_top_k": 8, "selector_loss_weight": 0.5}
    metrics = train(config, **paths(tiny, tmp_path))
    log = pd.read_csv(tmp_path / "log.csv")
    assert log.val_loss.iloc[-1] < 0.5 * log.val_loss.iloc[0], metrics
    directory = tmp_path / "drafter"
    exported = json.loads((directory / "config.json").read_text())
    assert exported["architectures"] == ["DFlash2DraftModel"]
    assert {k: exported["dflash_config"][k] for k in ("block_size", "conv_kernel_size", "conv_group_size",
                                                     "selector_rank", "selector_top_k")} == {
        "block_size": 8, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 8}
    weights = safetensors_of(directory)
    assert {k for k in weights if k.startswith("candidate_selector.")} == {
        "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight"}
    assert weights["candidate_selector.successor_codebook"].abs().sum() > 0  # trained away from its zero start
    embed, head = load_target_embeddings(tiny["target"])
    loaded = load_dflash(directory, embed, head)
    state = torch.load(tmp_path / "state" / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state["model"].items())
    target = AutoModelForCausalLM.from_pretrained(tiny["target"], dtype=torch.float32).eval()
    ids = [5, 9, 30, *np.random.default_rng(1234).permutation(np.arange(2, 18))[:4].tolist()]
    expected = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=16, eos_token_id=None)[0, len(ids):].tolist()
    run = speculative_generate(target, DFlash2Proposer(loaded), ids, max_new_tokens=16, eos_ids=set())
    assert run.tokens == expected
