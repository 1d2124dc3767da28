"""The DFlash trainer (DESIGN.md section 5, "Training"): data, loop, validation, checkpoints, export.

- Data: a ``Dataset`` of whole samples of the store; a batch is a list of sequences of at most
  ``tokens_per_batch`` tokens, grouped by length, in a seeded order per epoch. Anchors are drawn per
  (seed, epoch, sample), so the result does not depend on the worker or GPU count.
- Step: the rank's sequences packed one after another into one ``forward_blocks`` pass (a block sees only
  its own sequence; a few passes when the pack would exceed ``PACK_ELEMENTS``), decay-weighted CE in
  chunks, gradients accumulated and normalised by the global batch's total loss weight; AdamW, cosine
  with warm-up.
- Data parallel (torchrun, ``gpus > 1``): rank r takes sequences r, r+W, ... of each global batch and
  the summed gradients are all-reduced, so the update is the one-process update.
- Resume: ``state_dir/checkpoint.pt`` (model, optimiser, scheduler, RNG states, data position, log)
  every ``checkpoint_every`` steps and at each epoch end, written atomically, read with
  ``weights_only=True``; it is used only when its fingerprint (train config, store, drafter shape) matches.
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
from torch.utils.data import DataLoader, Dataset

from .atomic import atomic_path
from .drafter import DFlashDrafter, export_config_dict, load_target_embeddings, resolve_mask_token_id, save_dflash
from .gpu_lease import set_device_count
from .losses import (LOSS_CHUNK_ROWS, acceptance_proxy, block_targets, chunked_lm_loss, default_gamma,
                     make_block_token_ids, sample_anchors)
from .store import HiddenStateStore, config_hash

log = logging.getLogger(__name__)

# Keys that change how fast training runs, never what it computes: not part of the resume fingerprint.
RUNTIME_KEYS = ("gpus", "threads", "num_workers", "prefetch_factor", "checkpoint_every", "snapshots", "compile")


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
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    gamma: float | None = None
    mask_token_id: int | None = None
    val_fraction: float = 0.02
    seed: int = 0
    num_workers: int = 4
    prefetch_factor: int = 2
    checkpoint_every: int = 500
    gradient_checkpointing: bool = False
    compile: bool = True
    export_dtype: str = "float32"
    snapshots: list[int] | None = None  # percent of all steps at which the drafter is also exported


def seeded(*key) -> torch.Generator:
    """A generator seeded by a tuple (e.g. (seed, epoch, sample)): the same draw in any process."""
    return torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(),
                                                        "little") >> 1)


# ---- data ----
class SampleDataset(Dataset):
    """Whole samples of a store: ``dataset[i] -> (i, input_ids, loss_mask, features [T, K, D])``."""

    def __init__(self, store: HiddenStateStore):
        self.store = store

    def __len__(self):
        return len(self.store)

    def __getitem__(self, i):
        return (i, *self.store[i])


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


def make_loader(dataset, sampler, num_workers: int, prefetch_factor: int, pin_memory: bool) -> DataLoader:
    extra = {}
    if num_workers > 0:  # zarr's async loop deadlocks in forked workers
        extra = dict(multiprocessing_context="spawn", persistent_workers=True, prefetch_factor=prefetch_factor)
    # collate_fn=list: a batch stays a list of samples (packed later, never padded)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=list, num_workers=num_workers,
                      pin_memory=pin_memory, **extra)


# ---- one sequence ----
def prepare_sequence(sample, cfg: TrainConfig, mask_token_id: int, gamma: float, key, device, max_anchors: int):
    """Anchors (seeded by ``key``), block inputs, labels and weights of one sample, on ``device``."""
    _, input_ids, loss_mask, features = sample
    anchors = sample_anchors(loss_mask, max_anchors, seeded(*key))
    labels, weights = block_targets(input_ids, loss_mask, anchors, cfg.block_size, gamma)
    blocks = make_block_token_ids(input_ids, anchors, cfg.block_size, mask_token_id)
    context = features.reshape(1, features.shape[0], -1)
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return dict(context=move(context), anchors=move(anchors), blocks=move(blocks), labels=move(labels),
                weights=move(weights))


# ---- many sequences, one pass ----
# A packed pass holds at most PACK_ELEMENTS (context tokens + block slots) x hidden size: its activations
# are proportional to that. 2**25 is ~58k packed tokens for SmolLM2 (D 576; ~11 sequences of 410 tokens at
# 300 anchors), ~8k for D 4096: a longer sequence is a pass alone, as before packing. (Attention memory is
# not: FlexAttention's tiles and the dense path's per-sequence masks skip pairs of two sequences.)
PACK_ELEMENTS = 2**25


def micro_batches(seqs: list[dict], hidden_size: int, pack_elements: int = PACK_ELEMENTS) -> list[list[dict]]:
    """Consecutive prepared sequences grouped into packs of at most ``pack_elements`` (context tokens + block
    slots) x ``hidden_size``, greedily in order (deterministic); a sequence over it is a pack alone."""
    groups, size = [], 0
    for seq in seqs:
        tokens = seq["context"].shape[1] + seq["blocks"].numel()
        if not groups or (size + tokens) * hidden_size > pack_elements:
            groups.append([])
            size = 0
        groups[-1].append(seq)
        size += tokens
    return groups


def pack_sequences(seqs: list[dict]) -> dict:
    """Prepared sequences one after another: contexts concatenated along the tokens, blocks along the blocks,
    with each sequence's context length and block count (``forward_blocks``' packed arguments)."""
    packed = {key: torch.cat([s[key] for s in seqs]) for key in ("anchors", "blocks", "labels", "weights")}
    return dict(packed, context=torch.cat([s["context"] for s in seqs], dim=1),
                lengths=[s["context"].shape[1] for s in seqs], block_counts=[s["anchors"].numel() for s in seqs])


def packed_forward(drafter, pack, amp: bool, train: bool, chunk_rows: int = LOSS_CHUNK_ROWS):
    """Weighted loss sum, weight sum and correct [n, B-1] (validation only) of a pack (``pack_sequences``)."""
    # FlexAttention routes fewer than 128 queries to its decoding kernel, which has no kernel for some shapes
    # (e.g. head_dim 16): such small packs take the dense mask, which is small for them anyway.
    impl = "sdpa" if pack["blocks"].numel() < 128 else None
    with torch.autocast(pack["context"].device.type, dtype=torch.bfloat16, enabled=amp):
        hidden = drafter.forward_blocks(pack["context"], pack["anchors"], pack["blocks"], lengths=pack["lengths"],
                                        block_counts=pack["block_counts"], attn_impl=impl)
        if train:  # only slots with a loss reach the LM head
            keep = pack["weights"] > 0
            loss, weight, _ = chunked_lm_loss(hidden[keep], drafter.lm_head.weight, pack["labels"][keep],
                                              pack["weights"][keep], chunk_rows, predict=False,
                                              compiled=drafter.pointwise_compiled)
            return loss, weight, None
        n, B, D = hidden.shape
        loss, weight, correct = chunked_lm_loss(hidden[:, 1:].reshape(-1, D), drafter.lm_head.weight,
                                                pack["labels"][:, 1:].reshape(-1), pack["weights"][:, 1:].reshape(-1),
                                                chunk_rows, compiled=drafter.pointwise_compiled)
        return loss, weight, correct.view(n, B - 1)


def packs(drafter, seqs: list[dict], pack_elements: int = PACK_ELEMENTS):
    """``seqs`` as the packs of ``micro_batches``, one at a time."""
    for group in micro_batches(seqs, drafter.config.hidden_size, pack_elements):
        yield pack_sequences(group)


def accumulate_gradients(drafter, seqs: list[dict], total_weight: torch.Tensor, amp: bool,
                         pack_elements: int = PACK_ELEMENTS, chunk_rows: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
    """Forward + backward of ``seqs`` in packed passes; each pass's loss is divided by ``total_weight`` (the
    global batch's), so the accumulated gradients are those of the global mean. -> loss sum (float64)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=total_weight.device)
    for pack in packs(drafter, seqs, pack_elements):
        loss, _, _ = packed_forward(drafter, pack, amp, train=True, chunk_rows=chunk_rows)
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
    mask_token_id = resolve_mask_token_id(tokenizer, embed.weight.shape[0], cfg.mask_token_id)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter.from_target_config(
        target_config, mask_token_id=mask_token_id, num_layers=cfg.num_layers,
        block_size=cfg.block_size, target_layer_ids=store.attrs["layer_ids"], head_dim=cfg.head_dim,
        layer_types=cfg.layer_types, sliding_window=cfg.sliding_window, embed_tokens=embed, lm_head=lm_head)
    drafter.gradient_checkpointing = cfg.gradient_checkpointing
    drafter.to(device)
    if cfg.compile and drafter.fc.weight.is_cuda:
        drafter.compile_pointwise()
    return drafter


class Trainer:
    """One training run: one process, or one rank under torchrun (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``)."""

    def __init__(self, cfg: TrainConfig, store: str, target: str, state_dir: str):
        self.cfg, self.world, self.rank = cfg, int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
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
        self.data = HiddenStateStore(store)
        self.drafter = build_drafter(cfg, self.data, target, self.device, torch.bfloat16 if cuda else torch.float32)
        self.mask_id, self.gamma = self.drafter.mask_token_id, cfg.gamma or default_gamma(cfg.block_size)
        train_ids, val_ids = split_indices(len(self.data), cfg.val_fraction, cfg.seed)
        self.sampler = LengthGroupedBatches(train_ids, self.data.lengths, cfg.tokens_per_batch, cfg.seed, self.rank,
                                            self.world)
        val_sampler = LengthGroupedBatches(val_ids, self.data.lengths, cfg.tokens_per_batch, cfg.seed, self.rank,
                                           self.world, shuffle=False)
        self.train_loader, self.val_loader = (
            make_loader(SampleDataset(self.data), s, cfg.num_workers, cfg.prefetch_factor, cuda)
            for s in (self.sampler, val_sampler))
        self.per_epoch = len(self.sampler.batches(0))
        self.total = self.per_epoch * cfg.epochs
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        schedule = cosine_with_warmup(self.total, cfg.warmup_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.fingerprint = fingerprint(cfg, self.data, export_config_dict(self.drafter.config))
        self.state_path = Path(state_dir) / "checkpoint.pt"
        self.step = self.epoch = self.batch_index = self.tokens = 0  # tokens: trained so far, all ranks
        self.snapshot_dir = Path(state_dir) / "snapshots"
        self.snapshot_steps: dict[int, list[int]] = {}  # step -> the percentages exported after it
        for percent in cfg.snapshots or ():
            self.snapshot_steps.setdefault(max(1, round(percent * self.total / 100)), []).append(percent)
        self.rows: list[dict] = []  # the training log: one row per step, validation columns at epoch ends
        log.info("drafter: %.1fM trainable parameters, layers %s, mask token %d, B=%d, gamma %.2f; %d train / %d "
                 "validation samples, %d steps per epoch, %d epochs, world %d, %s",
                 sum(p.numel() for p in self.params) / 1e6, self.drafter.config.target_layer_ids, self.mask_id,
                 cfg.block_size, self.gamma, len(train_ids), len(val_ids), self.per_epoch, cfg.epochs, self.world,
                 self.device)

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
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step, self.epoch, self.batch_index = state["step"], state["epoch"], state["batch"]
        self.tokens = state.get("tokens", 0)
        self.rows = state["rows"]
        log.info("resuming from step %d (epoch %d, batch %d) of %s", self.step, self.epoch, self.batch_index,
                 self.state_path)

    def save(self) -> None:
        if self.rank == 0:
            with atomic_path(self.state_path) as tmp:
                torch.save({"fingerprint": self.fingerprint, "step": self.step, "epoch": self.epoch,
                            "batch": self.batch_index, "tokens": self.tokens, "rows": self.rows, "model": self.drafter.state_dict(),
                            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                            "rng": rng_state()}, tmp)
            log.info("saved checkpoint at step %d (epoch %d, batch %d)", self.step, self.epoch, self.batch_index)
        if self.world > 1:
            dist.barrier()

    def sequences(self, batch, key, max_anchors: int) -> list[dict]:
        seqs = [prepare_sequence(s, self.cfg, self.mask_id, self.gamma, (*key, s[0]), self.device, max_anchors)
                for s in batch]
        return [s for s in seqs if s["anchors"].numel()]  # a sample without two response tokens in a row

    def train_step(self, batch) -> tuple[float, float, float]:
        """One optimiser step over this rank's part of a global batch -> (loss, grad norm, lr)."""
        seqs = self.sequences(batch, (self.cfg.seed, self.epoch), self.cfg.max_anchors)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        total_weight = all_sum(sum((s["weights"].sum().double() for s in seqs), zero.clone()))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = accumulate_gradients(self.drafter, seqs, total_weight, self.amp)
        all_sum_grads(self.params)
        loss_sum = all_sum(loss_sum)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = 0.0
        if total_weight > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
            self.optimizer.step()
        self.scheduler.step()
        return float(loss_sum / total_weight.clamp(min=1e-12)), grad_norm, lr

    @torch.no_grad()
    def validate(self) -> dict:
        """Loss, per-slot accuracy and the acceptance proxy over the validation set, with fixed anchors."""
        self.drafter.eval()
        B = self.cfg.block_size
        sums = torch.zeros(4 + 2 * (B - 1), dtype=torch.float64, device=self.device)  # see the names below
        anchors = self.cfg.val_max_anchors or self.cfg.max_anchors
        began = mark = time.perf_counter()
        data_wait, first_wait = 0.0, None
        for batch in self.val_loader:
            data_wait += time.perf_counter() - mark
            first_wait = data_wait if first_wait is None else first_wait
            for pack in packs(self.drafter, self.sequences(batch, (self.cfg.seed, "validation"), anchors)):
                loss, weight, correct = packed_forward(self.drafter, pack, self.amp, train=False)
                proxy = acceptance_proxy(correct).sum().double()
                n_blocks = torch.tensor(float(correct.shape[0]), device=self.device, dtype=torch.float64)
                sums[:4] += torch.stack([loss.double(), weight.double(), proxy, n_blocks])
                sums[4 : B + 3] += correct.sum(0)
                sums[B + 3 :] += (pack["labels"][:, 1:] >= 0).sum(0)
            mark = time.perf_counter()
        sums = all_sum(sums).cpu()
        # the step-0 pass also compiles the no-grad variants and waits for the loader's workers to start
        log.info("validation pass: %.1f s, %.1f s of it waiting for data (%.1f s for the first batch)",
                 time.perf_counter() - began, data_wait, first_wait or 0.0)
        loss, weight, proxy, blocks = sums[:4].tolist()
        accuracy = (sums[4 : B + 3] / sums[B + 3 :].clamp(min=1)).tolist()
        self.drafter.train()
        return {"val_loss": loss / max(weight, 1e-12), "val_proxy": proxy / max(blocks, 1),
                **{f"val_acc_{k}": accuracy[k - 1] for k in range(1, B)}}

    def evaluate(self) -> None:
        metrics = self.validate()
        if self.rows and self.rows[-1]["step"] == self.step:
            self.rows[-1].update(metrics)
        else:  # step 0: the untrained baseline
            self.rows.append({"step": self.step, "epoch": float(self.epoch), "tokens": self.tokens, "train_loss": None,
                              "lr": None, **metrics})
        log.info("validation at step %d: loss %.4f, acceptance proxy %.3f, slot-1 accuracy %.3f", self.step,
                 metrics["val_loss"], metrics["val_proxy"], metrics["val_acc_1"])

    def run(self) -> list[dict]:
        """Train to the end (from the last checkpoint if there is a matching one); returns the log rows."""
        self.resume()
        # created before the step-0 validation: the loader's workers start reading meanwhile
        began = time.perf_counter()
        batches = self.epoch_batches(self.epoch, self.batch_index) if self.epoch < self.cfg.epochs else iter(())
        log.info("training loader started (%d workers) in %.1f s", self.cfg.num_workers, time.perf_counter() - began)
        if not self.rows:
            self.evaluate()
        self.drafter.train()
        log_every, started, first = max(1, self.total // 100), time.perf_counter(), self.step
        data_wait, first_wait, tokens = 0.0, None, 0
        while self.epoch < self.cfg.epochs:
            global_batches = self.sampler.batches(self.epoch)  # every rank's samples: the trained-token count
            mark = time.perf_counter()
            for batch in batches:
                data_wait += time.perf_counter() - mark
                first_wait = data_wait if first_wait is None else first_wait
                tokens += sum(len(sample[1]) for sample in batch)
                loss, grad_norm, lr = self.train_step(batch)  # returns floats: the step has finished
                self.tokens += int(self.data.lengths[global_batches[self.batch_index]].sum())
                mark = time.perf_counter()
                self.step, self.batch_index = self.step + 1, self.batch_index + 1
                self.rows.append({"step": self.step, "epoch": self.epoch + self.batch_index / self.per_epoch,
                                  "tokens": self.tokens, "train_loss": loss, "lr": lr})
                for percent in self.snapshot_steps.get(self.step, []) if self.rank == 0 else []:
                    export(self, self.snapshot_dir / f"{percent}pct", steps=self.step, trained_tokens=self.tokens)
                if self.step % log_every == 0:
                    log.info("step %d/%d epoch %d: loss %.4f, grad norm %.3f, lr %.2e, %.2f s/step", self.step,
                             self.total, self.epoch, loss, grad_norm, lr,
                             (time.perf_counter() - started) / (self.step - first))
                if self.step % self.cfg.checkpoint_every == 0 and self.batch_index < self.per_epoch:
                    self.save()
            if self.epoch + 1 < self.cfg.epochs:
                batches = self.epoch_batches(self.epoch + 1, 0)  # the next epoch's first batches load meanwhile
            self.evaluate()
            self.epoch, self.batch_index = self.epoch + 1, 0
            self.save()
        if self.step > first:
            seconds = time.perf_counter() - started
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
            log.info("training speed (rank %d): %.0f tokens/s over %d steps (%.0f s, validation included), data wait "
                     "%.1f %% of the time (the first batch %.1f s), peak GPU memory %.1f GiB", self.rank,
                     tokens / seconds, self.step - first, seconds, 100 * data_wait / seconds, first_wait, peak)
        return self.rows

    def stop_workers(self) -> None:
        """Stop the loaders' persistent workers now rather than at interpreter exit, and log how long it took
        (a 1.4-minute gap between the export and the end of a GPU job was seen once)."""
        began = time.perf_counter()
        for loader in (self.train_loader, self.val_loader):
            loader._iterator = None  # the iterator's __del__ joins its workers
        log.info("stopped the data loader workers in %.1f s", time.perf_counter() - began)

    def epoch_batches(self, epoch: int, start: int):
        """An iterator over this rank's batches of ``epoch`` from batch ``start``; creating it starts the loader's
        workers reading ahead."""
        self.sampler.set_epoch(epoch, start)
        return iter(self.train_loader)


def train(config: dict, *, store: str, target: str, drafter_dir: str, log_csv: str, curves_png: str,
          state_dir: str, init_dir: str | None = None, snapshot_dirs: dict | None = None) -> dict:
    """The ``train`` job (one process, or one rank under torchrun); returns the final validation metrics.
    ``init_dir``: where to export the untrained drafter too (the same seed always gives the same one), as a
    baseline for the evaluation. ``snapshot_dirs``: percent -> where the drafter exported after that share of
    the steps (``train.snapshots``) goes; snapshots are kept in the state directory until the end, so a
    resumed run still has those it passed before it was killed."""
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

    columns = ["step", "epoch", "tokens", "train_loss", "lr", "val_loss", "val_proxy"]
    columns += [f"val_acc_{k}" for k in range(1, block_size)]
    with atomic_path(log_csv) as tmp:
        pd.DataFrame(rows, columns=columns).to_csv(tmp, index=False)
    with atomic_path(curves_png) as tmp:
        plot_training_curves(rows, tmp, block_size)


def launch(config: dict, *, gpu_count: int | None = None, **paths) -> None:
    """Run training here on CPU (``gpus: 0``); with GPUs, lease them and exec torchrun over this module."""
    gpus = config["gpus"]
    if gpus == 0:
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
