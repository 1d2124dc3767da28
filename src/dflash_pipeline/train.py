"""The DFlash trainer (DESIGN.md section 5, "Training"): loop, optimisers, validation, checkpoints, export.

- Data (``train_data``): a global batch is a list of samples of at most ``tokens_per_batch`` tokens, grouped by
  length, in a seeded order per epoch; its anchors are drawn per (seed, epoch, sample), so the result does not
  depend on the worker or GPU count. The store is preloaded into the device's memory when it fits
  (``preload``; in a background thread while the drafter is built and, on GPU, compiled on the first step's
  shapes: ``Trainer.warm_up``), else read by DataLoader workers. Every shape of a step is known on the host.
- Step: the rank's samples in packed ``forward_blocks`` passes (a block sees only its own sequence), the
  decay-weighted loss over the slots that have one (hard labels, or mixed with the target's distribution:
  ``soft_labels``), gradients normalised by the global batch's total loss weight; AdamW, or Muon on the 2-D
  weights (``optimizer``); cosine with warm-up. No host sync inside a step: losses and gradient norms reach the
  log every ``log_every`` steps.
- Validation at each epoch end; the untrained drafter's (step 0) from its saved initial weights after the last
  step, so it costs the first step nothing.
- Data parallel (torchrun, ``gpus > 1``): rank r takes sequences r, r+W, ... of each global batch and the summed
  gradients are all-reduced, so the update is the one-process update. One GPU trains in the job's own process.
- Resume: ``state_dir/checkpoint.pt`` (model, optimisers, schedulers, RNG states, data position, log) every
  ``checkpoint_every`` steps and at each epoch end, written atomically, read with ``weights_only=True``; it is used
  only when its fingerprint (train config, store, drafter shape) matches.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from .atomic import atomic_path
from .jobs import seconds_since_process_start
from .drafter import (DFlashDrafter, architecture_kwargs, export_config_dict, load_target_embeddings,
                      load_target_tensor, resolve_mask_token_id, save_dflash)
from .gpu_lease import lease_gpus, set_device_count
from .losses import LOSS_CHUNK_ROWS, acceptance_proxy, chunked_lm_loss, default_gamma
from .muon import BatchedMuon
from .store import HiddenStateStore, config_hash
from .train_data import VALIDATION, AnchorRule, Pack, Preloaded, StreamedSteps, eligible_counts, fits_in_memory

log = logging.getLogger(__name__)

# Keys that change how fast training runs, never what it computes: not part of the resume fingerprint.
RUNTIME_KEYS = ("gpus", "threads", "num_workers", "prefetch_factor", "checkpoint_every", "snapshots", "compile",
                "compile_layers", "preload", "compile_cache", "log_every")


@dataclasses.dataclass
class TrainConfig:
    """The ``train:`` section of the workflow config (defaults = config/schema.yaml's = the paper's recipe)."""

    gpus: int = 1
    threads: int = 4
    epochs: int = 6
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    max_anchors: int = 512
    val_max_anchors: int | None = None
    tokens_per_batch: int = 32768
    block_size: int = 16
    num_layers: int = 5
    head_dim: int | None = None
    num_attention_heads: int | None = None  # architecture keys: None = the rule (drafter_config.py)
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    gamma: float | None = None
    mask_token_id: int | None = None
    val_fraction: float = 0.02
    seed: int = 0
    num_workers: int = 4
    prefetch_factor: int = 2
    checkpoint_every: int = 500
    gradient_checkpointing: bool = False
    compile: bool = True
    compile_layers: bool = False  # with compile: each decoder layer's pass compiled whole, not only its pointwise parts
    export_dtype: str = "float32"
    snapshots: list[int] | None = None  # percent of all steps at which the drafter is also exported
    max_samples: int | None = None  # a seeded subset of the training split (None: all of it)
    anchor_fraction: float = 1.0  # share of a sample's eligible positions anchored per epoch (<= max_anchors)
    optimizer: str = "muon"  # or "adamw"; muon: torch.optim.Muon on the draft layers' and fc's 2-D weights
    muon_lr: float = 0.02
    soft_labels: float = 0.0  # share of the target's next-token distribution in the labels (needs final_hidden)
    norm_from_target: bool = False  # start the final norm from the target's
    preload: bool | str = "auto"  # the store in the device's memory: true, false or auto (when it fits)
    compile_cache: str | None = None  # TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR for torch.compile's caches
    log_every: int | None = None  # steps between log lines (and host reads of the losses); None: 1 % of them


def seeded(*key) -> torch.Generator:
    """A generator seeded by a tuple (e.g. (seed, epoch, sample)): the same draw in any process."""
    return torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(),
                                                        "little") >> 1)


# ---- data ----
def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A hold-out split fixed by the seed: (train, validation), validation at least one sample."""
    if n < 2:
        raise ValueError(f"need at least 2 samples for a train/validation split, the store has {n}")
    order = torch.randperm(n, generator=seeded(seed, "split")).tolist()
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return sorted(order[n_val:]), sorted(order[:n_val])


class LengthGroupedBatches:
    """Batch sampler: global batches of similar-length samples with at most ``tokens_per_batch`` tokens
    (a longer sample is a batch alone), in a seeded order per epoch; yields rank r's slice r::world."""

    def __init__(self, indices, lengths, tokens_per_batch: int, seed: int, rank: int = 0, world: int = 1,
                 shuffle: bool = True):
        self.indices, self.lengths = list(indices), np.asarray(lengths)
        self.tokens_per_batch, self.seed, self.shuffle = tokens_per_batch, seed, shuffle
        self.rank, self.world = rank, world
        self.epoch, self.start = 0, 0

    def batches(self, epoch: int) -> list[list[int]]:
        order = self.indices
        if self.shuffle:  # a random order among equal lengths, then a stable sort by length
            order = [self.indices[j] for j in torch.randperm(len(order), generator=seeded(self.seed, epoch, "order"))]
        order = sorted(order, key=lambda i: self.lengths[i])
        batches, current, tokens = [], [], 0
        for i in order:
            if current and tokens + self.lengths[i] > self.tokens_per_batch:
                batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += int(self.lengths[i])
        if current:
            batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=seeded(self.seed, epoch, "batches"))]
        return batches

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self):
        for batch in self.batches(self.epoch)[self.start:]:
            yield batch[self.rank :: self.world]

    def __len__(self):
        return len(self.batches(self.epoch)) - self.start


# ---- one step ----
def packed_forward(drafter, pack: Pack, amp: bool, train: bool, soft_weight: float = 0.0,
                   chunk_rows: int = LOSS_CHUNK_ROWS):
    """Weighted loss sum, weight sum and correct [n, B-1] (validation only) of a pack; only the slots with a
    loss reach the LM head. ``soft_weight``: the share of the target's distribution in the labels."""
    # FlexAttention routes fewer than 128 queries to its decoding kernel, which has no kernel for some shapes
    # (e.g. head_dim 16): such small packs take the dense mask, which is small for them anyway.
    impl = "sdpa" if pack.blocks.numel() < 128 else None
    with torch.autocast(pack.context.device.type, dtype=torch.bfloat16, enabled=amp):
        hidden = drafter.forward_blocks(pack.context, pack.anchors, pack.blocks, lengths=pack.lengths,
                                        block_counts=pack.block_counts, attn_impl=impl)
        n, B, D = hidden.shape
        soft = pack.final.index_select(0, pack.soft_rows) if soft_weight else None
        loss, weight, correct = chunked_lm_loss(hidden.reshape(n * B, D).index_select(0, pack.slots),
                                                drafter.lm_head.weight, pack.labels, pack.weights, chunk_rows,
                                                predict=not train, compiled=drafter.pointwise_compiled,
                                                soft_hidden=soft, soft_weight=soft_weight)
    if train:
        return loss, weight, None
    dense = torch.zeros(n * B, dtype=torch.bool, device=hidden.device)
    dense[pack.slots] = correct
    return loss, weight, dense.view(n, B)[:, 1:]


def accumulate_gradients(drafter, packs: list[Pack], total_weight: torch.Tensor, amp: bool, soft_weight: float = 0.0,
                         chunk_rows: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
    """Forward + backward of a step's packs; each pack's loss is divided by ``total_weight`` (the global batch's),
    so the accumulated gradients are those of the global mean. -> loss sum (float64, on the device)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=total_weight.device)
    for pack in packs:
        loss, _, _ = packed_forward(drafter, pack, amp, train=True, soft_weight=soft_weight, chunk_rows=chunk_rows)
        (loss / total_weight.float()).backward()
        loss_sum += loss.detach().double()
    return loss_sum


# ---- distributed helpers (no-ops in one process) ----
def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def all_sum_grads(params) -> None:
    """Sum the gradients over ranks (a rank with no sequence in this batch contributes zeros)."""
    if dist.is_initialized():
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        for handle in [dist.all_reduce(p.grad, async_op=True) for p in params]:
            handle.wait()


def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


# ---- checkpoints ----
def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                                                   *np_state[2:]],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---- the job ----
def fingerprint(cfg: TrainConfig, store: HiddenStateStore, drafter_config: dict) -> dict:
    """What a checkpoint must match to be resumed: hashes of the train config, the store and the drafter shape."""
    train = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUNTIME_KEYS}
    return {"train_config": config_hash(train), "store": config_hash(store.attrs),
            "drafter": config_hash(drafter_config)}


def build_drafter(cfg: TrainConfig, store: HiddenStateStore, target: str, device, dtype) -> DFlashDrafter:
    """A fresh drafter for the target, layer ids from the store, the target's frozen embedding and LM head."""
    from transformers import AutoConfig

    from .mask_token import target_stop_configs
    from .target import load_tokenizer, target_config_hashes, text_config, tokenizer_hashes

    if store.attrs.get("random_weights_seed") is not None:
        raise ValueError(f"{store.path} holds features of a random-weight target (target.random_weights_seed "
                         f"{store.attrs['random_weights_seed']}): a speed measurement, not training data")
    tokenizer = load_tokenizer(target)
    target_config = AutoConfig.from_pretrained(target)
    manifest, actual = store.manifest, {**tokenizer_hashes(tokenizer), **target_config_hashes(target_config)}
    differ = [f"{key}: store {manifest[key]} != target {value}" for key, value in actual.items()
              if key.endswith("_sha256") and manifest.get(key) not in (None, value)]
    recorded = manifest.get("target_config") or {}
    differ += [f"{key}: store {recorded[key]} != target {value}" for key, value in actual["target_config"].items()
               if key in recorded and recorded[key] != value]
    hidden = text_config(target_config).hidden_size
    if store.attrs.get("hidden_size") not in (None, hidden) and "hidden_size" not in recorded:  # older manifests
        differ.append(f"hidden_size: store {store.attrs['hidden_size']} != target {hidden}")
    if differ:
        raise ValueError(f"{target} is not the target the store {store.path} was built for: " + "; ".join(differ))
    embed, lm_head = load_target_embeddings(target, dtype=dtype)
    mask_token_id = resolve_mask_token_id(tokenizer, embed.weight.shape[0], cfg.mask_token_id,
                                          target_configs=target_stop_configs(target, target_config))
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter.from_target_config(
        target_config, mask_token_id=mask_token_id, target_layer_ids=store.attrs["layer_ids"],
        **architecture_kwargs(cfg), embed_tokens=embed, lm_head=lm_head)
    if cfg.norm_from_target:
        with torch.no_grad():
            drafter.norm.weight.copy_(target_final_norm(target, text_config(target_config).model_type))
    drafter.gradient_checkpointing = cfg.gradient_checkpointing
    drafter.to(device)
    if cfg.compile and drafter.fc.weight.is_cuda:
        drafter.compile_layers() if cfg.compile_layers else drafter.compile_pointwise()
    return drafter


ZERO_CENTRED_NORMS = ("qwen3_5", "qwen3_5_text", "qwen3_next")  # RMSNorm x * (1 + w): the weight is w + 1


def target_final_norm(target: str, model_type: str) -> torch.Tensor:
    """The target's final RMSNorm weight as the drafter's (x * w) norm takes it."""
    weight = load_target_tensor(target, ("model.norm.weight", "model.language_model.norm.weight")).float()
    return weight + 1 if model_type in ZERO_CENTRED_NORMS else weight


def make_optimizers(cfg: TrainConfig, drafter: DFlashDrafter) -> list[torch.optim.Optimizer]:
    """AdamW over every trainable weight; or Muon over the 2-D weights of the draft layers and ``fc`` (at
    ``muon_lr``; its Newton-Schulz work shared by the ranks under DDP) and AdamW over the rest (norms, biases)."""
    named = [(name, p) for name, p in drafter.named_parameters() if p.requires_grad]
    adamw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named], **adamw)]
    if cfg.optimizer != "muon":
        raise ValueError(f"train.optimizer {cfg.optimizer!r}: expected adamw or muon")
    matrices = [p for name, p in named if p.ndim == 2 and name.startswith(("layers.", "fc."))]
    others = [p for name, p in named if not (p.ndim == 2 and name.startswith(("layers.", "fc.")))]
    # under DDP the ranks share the Newton-Schulz work (muon.py): the same update as one process's
    group = dist.group.WORLD if dist.is_initialized() else None
    return [BatchedMuon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, process_group=group),
            torch.optim.AdamW(others, **adamw)]


class DataGaps:
    """On CUDA, the GPU's time from the end of one step's kernels to the start of the next step's (CUDA events):
    the data's gathers and copies plus any wait for the host to launch them, i.e. what the data costs the GPU. The
    host's own wait for the next step over-counts it when the host runs ahead of the GPU and blocks in a launch.
    Read when the host syncs anyway."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.last_end, self.pending, self.gaps = None, [], []

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_ends(self) -> None:
        self.last_end = self._event() if self.cuda else None

    def data_ready(self) -> None:
        if self.last_end is not None:
            self.pending.append((self.last_end, self._event()))

    def pause(self) -> None:
        """Between epochs: the validation is not the data's."""
        self.last_end = None

    def read(self) -> float:
        self.gaps += [end.elapsed_time(start) / 1000 for end, start in self.pending]
        self.pending = []
        return self.seconds

    @property
    def seconds(self) -> float:
        return sum(self.gaps)

    def spread(self, long_s: float = 0.005) -> str:
        """How the gaps are spread: uniform small ones (the data's own kernels) or a few long ones (host stalls)."""
        if not self.gaps:
            return ""
        long = sum(g for g in self.gaps if g > long_s)
        longest = sorted(int(i) + 2 for i in np.argsort(self.gaps)[-5:])  # gap i (from 0) comes before step i + 2
        return (f" (median {1e3 * float(np.median(self.gaps)):.2f} ms, max {1e3 * max(self.gaps):.1f} ms, "
                f"{100 * long / max(self.seconds, 1e-12):.0f} % of it in gaps over {1e3 * long_s:.0f} ms; the longest "
                f"five before the loop's steps {', '.join(map(str, longest))})")


class Trainer:
    """One training run: one process, or one rank under torchrun (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``)."""

    def __init__(self, cfg: TrainConfig, store: str, target: str, state_dir: str, preloaded: Preloaded | None = None):
        self.cfg, self.world, self.rank = cfg, int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        began = time.perf_counter()
        cuda = cfg.gpus > 0 and torch.cuda.is_available()
        if cfg.gpus > 0 and not cuda:
            log.warning("train.gpus=%d but no CUDA device is visible: training on CPU", cfg.gpus)
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        self.amp = cuda  # bf16 autocast on GPU, fp32 on CPU
        if cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1:
            dist.init_process_group("nccl" if cuda else "gloo")
            torch.set_num_threads(max(1, cfg.threads // self.world))
        if cfg.compile_cache:  # torch.compile's on-disk caches: a later run of the same shapes compiles less
            for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
                os.environ.setdefault(name, str(Path(cfg.compile_cache).resolve() / sub))
        self.data = preloaded.store if preloaded is not None else HiddenStateStore(store)
        self.num_layers = len(self.data.attrs["layer_ids"])
        if cfg.soft_labels and not self.data.attrs.get("final_hidden"):
            raise ValueError(f"train.soft_labels {cfg.soft_labels} needs the target's final hidden states in the store: "
                             f"{self.data.path} has none (extract.final_hidden: true)")
        if preloaded is None and (cfg.preload is True or (cfg.preload == "auto" and fits_in_memory(self.data,
                                                                                                 self.device))):
            # the features load while the drafter is built and compiled (warm_up); the first step waits for them
            preloaded = Preloaded(self.data, self.device, threads=cfg.threads, background=True)
        self.drafter = build_drafter(cfg, self.data, target, self.device, torch.bfloat16 if cuda else torch.float32)
        self.initial_weights = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
        self.built_s = time.perf_counter() - began
        self.mask_id, self.gamma = self.drafter.mask_token_id, cfg.gamma or default_gamma(cfg.block_size)
        self.rule = AnchorRule(cfg.block_size, self.gamma, cfg.max_anchors, cfg.anchor_fraction, cfg.seed)
        self.val_rule = AnchorRule(cfg.block_size, self.gamma, cfg.val_max_anchors or cfg.max_anchors, 1.0, cfg.seed)
        self.data_s = 0.0  # the loop's wait for the preloaded features
        loss_mask = preloaded.loss_mask if preloaded is not None else self.data.token_array("loss_mask")
        trainable = eligible_counts(loss_mask, self.data.lengths) > 0
        train_ids, val_ids = split_indices(len(self.data), cfg.val_fraction, cfg.seed)
        train_ids, val_ids = [i for i in train_ids if trainable[i]], [i for i in val_ids if trainable[i]]
        if cfg.max_samples is not None and cfg.max_samples < len(train_ids):
            keep = torch.randperm(len(train_ids), generator=seeded(cfg.seed, "subset"))[: cfg.max_samples]
            train_ids = sorted(train_ids[i] for i in keep.tolist())
        if not trainable.all():
            log.info("%d of %d samples have no two response tokens in a row (no block to train): left out",
                     int((~trainable).sum()), len(trainable))
        self.sampler = LengthGroupedBatches(train_ids, self.data.lengths, cfg.tokens_per_batch, cfg.seed, self.rank,
                                            self.world)
        self.val_batches = LengthGroupedBatches(val_ids, self.data.lengths, cfg.tokens_per_batch, cfg.seed, self.rank,
                                                self.world, shuffle=False).batches(0)
        self.preloaded = preloaded
        self.streamed = None if preloaded else StreamedSteps(self.data, self.drafter.config.hidden_size,
                                                             cfg.num_workers, cfg.prefetch_factor, cuda)
        if not train_ids:
            raise ValueError(f"{self.data.path}: no training sample has two response tokens in a row")
        self.per_epoch = len(self.sampler.batches(0))
        self.total = self.per_epoch * cfg.epochs
        self.log_every = cfg.log_every or max(1, self.total // 100)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizers = make_optimizers(cfg, self.drafter)
        schedule = cosine_with_warmup(self.total, cfg.warmup_ratio)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.optimizers]
        self.fingerprint = fingerprint(cfg, self.data, export_config_dict(self.drafter.config))
        self.state_path = Path(state_dir) / "checkpoint.pt"
        self.step = self.epoch = self.batch_index = self.tokens = 0  # tokens: trained so far, all ranks
        self.snapshot_dir = Path(state_dir) / "snapshots"
        self.snapshot_steps: dict[int, list[int]] = {}  # step -> the percentages exported after it
        for percent in cfg.snapshots or ():
            self.snapshot_steps.setdefault(max(1, round(percent * self.total / 100)), []).append(percent)
        self.rows: list[dict] = []  # the training log: one row per step, validation columns at epoch ends
        self.pending: list[tuple[dict, torch.Tensor, torch.Tensor]] = []  # rows whose loss is still on the device
        self.timing: dict[str, float] = {}
        self.saving_s = 0.0  # in checkpoints
        log.info("drafter: %.1fM trainable parameters, layers %s, mask token %d, B=%d, gamma %.2f, optimizer %s; "
                 "%d train / %d validation samples, %d steps per epoch, %d epochs, world %d, %s, data %s; "
                 "built in %.1f s", sum(p.numel() for p in self.params) / 1e6,
                 self.drafter.config.target_layer_ids, self.mask_id, cfg.block_size, self.gamma, cfg.optimizer,
                 len(train_ids), len(val_ids), self.per_epoch, cfg.epochs, self.world, self.device,
                 "preloaded" if preloaded else f"streamed by {cfg.num_workers} workers", self.built_s)

    def resume(self) -> None:
        """Continue from the checkpoint in the state directory, unless there is none or it is stale."""
        if not self.state_path.exists():
            return
        state = torch.load(self.state_path, map_location="cpu", weights_only=True)
        stale = [k for k in self.fingerprint if state["fingerprint"].get(k) != self.fingerprint[k]]
        if stale:
            log.info("not resuming from %s: its %s differ(s) from this run's; starting fresh", self.state_path,
                     ", ".join(stale))
            return
        self.drafter.load_state_dict(state["model"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(saved)
        set_rng_state(state["rng"])
        self.step, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch"]
        self.tokens = state.get("tokens", 0)
        self.rows = state["rows"]
        log.info("resuming from step %d (epoch %d, batch %d) of %s", self.step, self.epoch, self.batch_index,
                 self.state_path)

    def save(self) -> None:
        began = time.perf_counter()
        self.read_losses()
        if self.rank == 0:
            with atomic_path(self.state_path) as tmp:
                torch.save({"fingerprint": self.fingerprint, "step": self.step, "epoch": self.epoch,
                            "batch": self.batch_index, "tokens": self.tokens, "rows": self.rows,
                            "model": self.drafter.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers],
                            "schedulers": [s.state_dict() for s in self.schedulers], "rng": rng_state()}, tmp)
            log.info("saved checkpoint at step %d (epoch %d, batch %d)", self.step, self.epoch, self.batch_index)
        if self.world > 1:
            dist.barrier()
        self.saving_s += time.perf_counter() - began

    # ---- data ----
    def steps(self, epoch: int, batches: list[list[int]], rule: AnchorRule, name: str = "train",
              loaded: bool = True):
        """An iterator over this rank's packs of each batch, in order (``epoch`` keys the anchors); with streamed
        data, creating it starts the ``name`` loader's workers reading ahead. ``loaded``: ``Preloaded.step``'s."""
        mine = [batch[self.rank :: self.world] for batch in batches]
        hidden = self.drafter.config.hidden_size
        if self.preloaded is not None:
            return (self.preloaded.step(samples, rule, epoch, self.num_layers, self.mask_id, hidden, loaded=loaded)
                    for samples in mine)
        layouts = iter(self.streamed.loader([(rule, epoch, samples) for samples in mine], name))
        return ([Pack.to_device(layout, features, self.num_layers, self.mask_id, rule.block_size, self.device)
                 for layout, features in step] for step in layouts)

    def epoch_steps(self, epoch: int, start: int):
        return self.steps(epoch, self.sampler.batches(epoch)[start:], self.rule)

    # ---- steps ----
    def train_step(self, packs: list[Pack]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimiser step over this rank's part of a global batch -> (mean loss, grad norm) on the device, lr.
        Every global batch has a loss weight (samples without an anchor are left out of training)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        total_weight = all_sum(sum((p.weights.sum().double() for p in packs), zero))
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss_sum = all_sum(accumulate_gradients(self.drafter, packs, total_weight, self.amp, self.cfg.soft_labels))
        all_sum_grads(self.params)
        lr = self.schedulers[0].get_last_lr()[0]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
        return loss_sum / total_weight, grad_norm, lr

    def read_losses(self) -> None:
        """Copy the losses of the steps since the last read into their log rows (one host sync)."""
        if self.pending:
            values = torch.stack([torch.stack([loss.double(), norm.double()]) for _, loss, norm in self.pending]).tolist()
            for (row, _, _), (loss, norm) in zip(self.pending, values):
                row["train_loss"], row["grad_norm"] = loss, norm
            self.pending = []

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss, per-slot accuracy and the acceptance proxy over the validation set, with fixed anchors."""
        self.drafter.eval()
        B = self.cfg.block_size
        sums = torch.zeros(4 + 2 * (B - 1), dtype=torch.float64, device=self.device)  # see the names below
        began = mark = time.perf_counter()
        data_wait, first_wait = 0.0, None
        for packs in self.steps(VALIDATION, self.val_batches, self.val_rule, "validation"):
            data_wait += time.perf_counter() - mark
            first_wait = data_wait if first_wait is None else first_wait
            for pack in packs:
                loss, weight, correct = packed_forward(self.drafter, pack, self.amp, train=False)
                valid = torch.zeros(correct.shape[0] * B, dtype=torch.bool, device=self.device)
                valid[pack.slots] = True
                n_blocks = torch.tensor(float(correct.shape[0]), device=self.device, dtype=torch.float64)
                sums[:4] += torch.stack([loss.double(), weight.double(), acceptance_proxy(correct).sum().double(),
                                         n_blocks])
                sums[4 : B + 3] += correct.sum(0)
                sums[B + 3 :] += valid.view(-1, B)[:, 1:].sum(0)
            mark = time.perf_counter()
        sums = all_sum(sums).cpu()
        log.info("validation pass: %.1f s, %.1f s of it waiting for data (%.1f s for the first batch)",
                 time.perf_counter() - began, data_wait, first_wait or 0.0)
        loss, weight, proxy, blocks = sums[:4].tolist()
        accuracy = (sums[4 : B + 3] / sums[B + 3 :].clamp(min=1)).tolist()
        self.drafter.train()
        return {"val_loss": loss / max(weight, 1e-12), "val_proxy": proxy / max(blocks, 1),
                **{f"val_acc_{k}": accuracy[k - 1] for k in range(1, B)}}

    def evaluate(self) -> None:
        self.read_losses()
        metrics = self.validate()
        self.rows[-1].update(metrics)
        log.info("validation at step %d: loss %.4f, acceptance proxy %.3f, slot-1 accuracy %.3f", self.step,
                 metrics["val_loss"], metrics["val_proxy"], metrics["val_acc_1"])

    def evaluate_untrained(self) -> None:
        """Step 0 of the log: the validation of the initial weights (the seed's), run after training from their
        copy, so that it costs the first step nothing; it computes what it would have before the first step."""
        if self.rows and self.rows[0]["step"] == 0:
            return
        trained = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
        self.drafter.load_state_dict(self.initial_weights)
        metrics = self.validate()
        self.drafter.load_state_dict(trained)
        self.rows.insert(0, {"step": 0, "epoch": 0.0, "tokens": 0, "train_loss": None, "lr": None, **metrics})
        log.info("validation of the untrained drafter: loss %.4f, acceptance proxy %.3f", metrics["val_loss"],
                 metrics["val_proxy"])

    def warm_up(self) -> None:
        """Compile on the next step's shapes while the store still loads: one forward and backward of its packs
        over the features loaded so far (zeros elsewhere), the gradients dropped (weights, optimiser states and
        the data order untouched)."""
        began = time.perf_counter()
        batch = self.sampler.batches(self.epoch)[self.batch_index]
        packs = next(self.steps(self.epoch, [batch], self.rule, loaded=False))
        if packs:
            accumulate_gradients(self.drafter, packs, torch.ones((), dtype=torch.float64, device=self.device),
                                 self.amp, self.cfg.soft_labels)
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("compiled on the first step's shapes in %.1f s (the store %s meanwhile)", time.perf_counter() - began,
                 "loading" if self.preloaded.seconds is None else "loaded")

    def run(self) -> list[dict]:
        """Train to the end (from the last checkpoint if there is a matching one); returns the log rows."""
        self.resume()
        if self.preloaded is not None and self.epoch < self.cfg.epochs:
            if self.cfg.compile and self.device.type == "cuda":
                self.warm_up()
            self.data_s = self.preloaded.wait()
            log.info("the preload took %.1f s; the trainer waited %.1f s for it", self.preloaded.seconds, self.data_s)
        began = time.perf_counter()
        batches = self.epoch_steps(self.epoch, self.batch_index) if self.epoch < self.cfg.epochs else iter(())
        self.drafter.train()
        started, first, tokens_before, saved_before = time.perf_counter(), self.step, self.tokens, self.saving_s
        data_wait, first_step, validation, gaps = 0.0, None, 0.0, DataGaps(self.device)
        launching = 0.0  # the host's time in train_step after the first: ~ the step time when the host sets the pace
        while self.epoch < self.cfg.epochs:
            global_batches = self.sampler.batches(self.epoch)  # every rank's samples: the trained-token count
            mark = time.perf_counter()
            for packs in batches:
                data_wait += time.perf_counter() - mark
                gaps.data_ready()
                launch = time.perf_counter()
                loss, grad_norm, lr = self.train_step(packs)
                launching += time.perf_counter() - launch if first_step is not None else 0.0
                if first_step is None:
                    first_step = time.perf_counter() - began
                    log.info("first step done: %.1f s after the loop started (compilation included), %.1f s from the "
                             "process start", first_step, seconds_since_process_start())
                self.tokens += int(self.data.lengths[global_batches[self.batch_index]].sum())
                self.step, self.batch_index = self.step + 1, self.batch_index + 1
                row = {"step": self.step, "epoch": self.epoch + self.batch_index / self.per_epoch,
                       "tokens": self.tokens, "train_loss": None, "lr": lr}
                self.rows.append(row)
                self.pending.append((row, loss.detach(), grad_norm.detach()))
                for percent in self.snapshot_steps.get(self.step, []) if self.rank == 0 else []:
                    export(self, self.snapshot_dir / f"{percent}pct", steps=self.step, trained_tokens=self.tokens)
                if self.step % self.log_every == 0:
                    self.read_losses()
                    log.info("step %d/%d epoch %d: loss %.4f, grad norm %.3f, lr %.2e, %.3f s/step", self.step,
                             self.total, self.epoch, row["train_loss"], row["grad_norm"], lr,
                             (time.perf_counter() - started) / (self.step - first))
                if self.step % self.cfg.checkpoint_every == 0 and self.batch_index < self.per_epoch:
                    self.save()
                gaps.step_ends()
                mark = time.perf_counter()
            if self.epoch + 1 < self.cfg.epochs:
                batches = self.epoch_steps(self.epoch + 1, 0)  # the next epoch's first batches load meanwhile
            validating = time.perf_counter()
            gaps.pause()
            self.evaluate()
            validation += time.perf_counter() - validating
            self.epoch, self.batch_index = self.epoch + 1, 0
            self.save()
        validating = time.perf_counter()
        self.evaluate_untrained()
        validation += time.perf_counter() - validating
        if self.step > first:
            seconds = time.perf_counter() - started
            saving = self.saving_s - saved_before
            steps = seconds - validation - saving
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
            self.timing = {"build_s": self.built_s, "data_s": self.data_s, "first_step_s": first_step,
                           "loop_s": seconds, "validation_s": validation, "checkpoint_s": saving,
                           "steps_s": steps, "data_wait_s": data_wait, "data_gaps_s": gaps.read(),
                           "launch_s": launching,
                           "steps": self.step - first, "step_s": (steps - (first_step or 0)) / max(1, self.step - first - 1)}
            log.info("training speed (rank %d): %.0f tokens/s over %d steps (%.0f s: %.0f s validating, %.0f s in "
                     "checkpoints), data wait %.1f %% of the time (the host's)%s, %.3f s per step after the first "
                     "(%.3f s of it the host's in train_step), peak GPU memory %.1f GiB", self.rank,
                     (self.tokens - tokens_before) / seconds, self.step - first, seconds, validation, saving,
                     100 * data_wait / seconds,
                     f", the GPU's gaps between steps {100 * gaps.seconds / seconds:.1f} %{gaps.spread()}"
                     if gaps.cuda else "",
                     self.timing["step_s"], launching / max(1, self.step - first - 1), peak)
        return self.rows

    def stop_workers(self) -> None:
        """Stop streamed loaders' persistent workers now rather than at interpreter exit, and log how long it took."""
        if self.streamed is not None:
            began = time.perf_counter()
            self.streamed.close()
            log.info("stopped the data loader workers in %.1f s", time.perf_counter() - began)


def train(config: dict, *, store: str, target: str, drafter_dir: str, log_csv: str, curves_png: str,
          state_dir: str, init_dir: str | None = None, snapshot_dirs: dict | None = None) -> dict:
    """The ``train`` job (one process, or one rank under torchrun); returns the final validation metrics.
    ``init_dir``: where to export the untrained drafter too (the same seed always gives the same one), as a
    baseline for the evaluation. ``snapshot_dirs``: percent -> where the drafter exported after that share of
    the steps (``train.snapshots``) goes; snapshots are kept in the state directory until the end, so a
    resumed run still has those it passed before it was killed."""
    log.info("train job: %.1f s from the process start to the trainer (interpreter, imports, launch)",
             seconds_since_process_start())
    trainer = Trainer(TrainConfig(**config), store, target, state_dir)
    if init_dir and trainer.rank == 0:
        export(trainer, init_dir, steps=0)
    rows = trainer.run()
    trainer.stop_workers()
    if trainer.rank == 0:
        export(trainer, drafter_dir, steps=rows[-1]["step"], trained_tokens=trainer.tokens,
               baseline=val_metrics(rows[0]), final=val_metrics(rows[-1]))
        for percent, directory in (snapshot_dirs or {}).items():
            if not (trainer.snapshot_dir / f"{int(percent)}pct").is_dir():
                raise FileNotFoundError(f"the {percent} % snapshot is missing from {trainer.snapshot_dir} (a run "
                                        f"resumed from a checkpoint written without it): delete {state_dir} to retrain")
            with atomic_path(directory) as tmp:
                shutil.copytree(trainer.snapshot_dir / f"{int(percent)}pct", tmp, dirs_exist_ok=True)
        write_log(rows, log_csv, curves_png, trainer.cfg.block_size)
        log.info("exported the drafter to %s: validation loss %.4f -> %.4f, acceptance proxy %.3f -> %.3f",
                 drafter_dir, rows[0]["val_loss"], rows[-1]["val_loss"], rows[0]["val_proxy"], rows[-1]["val_proxy"])
    if trainer.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if trainer.timing:
        job = seconds_since_process_start()
        log.info("train job: %.1f s from the process start, %.1f s (%.1f %%) of it in the training steps (the loop "
                 "less validations and checkpoints)", job, trainer.timing["steps_s"],
                 100 * trainer.timing["steps_s"] / job)
    return val_metrics(rows[-1])


def val_metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("val_")}


def export(trainer: Trainer, directory: str, **extra) -> None:
    """The drafter in the DFlash format, plus ``training.json``: what it was trained on (the store manifest's
    target and tokenizer/chat-template hashes, so that it is only evaluated with that target), atomically."""
    manifest, drafter = trainer.data.manifest, trainer.drafter
    record = {
        "target": manifest.get("target"), "target_revision": manifest.get("target_revision"),
        "tokenizer_sha256": manifest.get("tokenizer_sha256"),
        "chat_template_sha256": manifest.get("chat_template_sha256"),
        "target_config_sha256": manifest.get("target_config_sha256"),
        "store_config_sha256": manifest.get("config_sha256"),
        "index_convention": trainer.data.attrs.get("index_convention"),
        "target_layer_ids": list(drafter.config.target_layer_ids), "fingerprint": trainer.fingerprint,
        "train_config": dataclasses.asdict(trainer.cfg), **extra,
    }
    with atomic_path(directory) as tmp:
        save_dflash(drafter, tmp, dtype=getattr(torch, trainer.cfg.export_dtype))
        (tmp / "training.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def write_log(rows: list[dict], log_csv: str, curves_png: str, block_size: int) -> None:
    """The training log as CSV and its curves as PNG, each atomically."""
    from .plots import plot_training_curves

    columns = ["step", "epoch", "tokens", "train_loss", "grad_norm", "lr", "val_loss", "val_proxy"]
    columns += [f"val_acc_{k}" for k in range(1, block_size)]
    with atomic_path(log_csv) as tmp:
        pd.DataFrame(rows, columns=columns).to_csv(tmp, index=False)
    with atomic_path(curves_png) as tmp:
        plot_training_curves(rows, tmp, block_size)


def launch(config: dict, *, gpu_count: int | None = None, **paths) -> None:
    """Run training here on CPU (``gpus: 0``) or on one leased GPU; with more, lease them and exec torchrun over
    this module (one rank per GPU)."""
    log.info("train job: its modules imported %.1f s after the process start", seconds_since_process_start())
    gpus = config["gpus"]
    if gpus <= 1:
        if gpus == 1:
            lease_gpus(1, count=gpu_count)  # before CUDA starts
        train(config, **paths)
        return
    set_device_count(gpu_count)  # for the gpu_lease process below
    spec = json.dumps({"config": config, **paths})
    cmd = [sys.executable, "-m", "dflash_pipeline.gpu_lease", "--n", str(gpus), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "dflash_pipeline.train", "--spec", spec]
    log.info("launching: %s", " ".join(cmd[:-1] + ["'<spec>'"]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.train", description="One rank of DFlash training.")
    parser.add_argument("--spec", required=True, help="JSON: {config, store, target, drafter_dir, log_csv, ...}")
    spec = json.loads(parser.parse_args(argv).spec)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {os.environ.get('RANK', 0)} %(levelname)s %(name)s: %(message)s")
    train(spec.pop("config"), **spec)


if __name__ == "__main__":
    main()
