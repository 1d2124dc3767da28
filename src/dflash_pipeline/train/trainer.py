"""The DFlash trainer (docs/design.md, "DFlash, precisely"): one training run's loop and validation.

- Data (``train_data``): a global batch is a list of samples of at most ``tokens_per_batch`` tokens, grouped by
  length, in a seeded order per epoch; its anchors are drawn per (seed, epoch, sample), so the result does not
  depend on the worker or GPU count. The store is preloaded into the device's memory when it fits
  (``preload``; in a background thread while the drafter is built and, on GPU, compiled on the first step's
  shapes: ``Trainer.warm_up``), else read by DataLoader workers. Every shape of a step is known on the host.
- Step (``step``): the rank's samples in packed ``forward_blocks`` passes, gradients normalised by the global
  batch's total loss weight; AdamW, or Muon on the 2-D weights; cosine with warm-up. No host sync inside a step:
  losses and gradient norms reach the log every ``log_every`` steps.
- Length: ``epochs`` whole epochs, or ``steps`` optimizer steps (as many epochs as they take, the last one stopped
  at the N-th step); the schedule and the snapshots are over the run's steps.
- Validation at each epoch end (the last one's: the run's last step); the untrained drafter's (step 0) from its
  saved initial weights after the last step, so it costs the first step nothing.
- Data parallel (``Placement``; the job entry sets up the process group): rank r takes sequences r, r+W, ... of
  each global batch and the summed gradients are all-reduced, so the update is the one-process update.
- Resume and export: ``checkpoint``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path

import torch

from .compact_fc import coefficient_fc
from ..drafter import export_config_dict
from ..losses import acceptance_proxy, default_gamma
from ..store import HiddenStateStore
from ..train_data import (VALIDATION, AnchorRule, Pack, Preloaded, StreamedSteps, eligible_counts, fits_in_memory,
                          held_dtype)
from . import checkpoint
from .batches import LengthGroupedBatches, split_indices
from .build import build_drafter
from .config import TrainConfig, seeded
from .step import accumulate_gradients, all_sum, all_sum_grads, make_optimizers, make_schedulers, packed_forward
from .timing import LoopClock

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process trains: its device, its rank among ``world`` ranks, and whether it autocasts to bf16."""

    device: torch.device
    rank: int = 0
    world: int = 1

    @property
    def amp(self) -> bool:
        return self.device.type == "cuda"  # bf16 autocast on GPU, fp32 on CPU

    @classmethod
    def of_this_process(cls, cfg: TrainConfig) -> Placement:
        """From torchrun's ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` (one process: rank 0 of 1), on CUDA when
        ``train.gpus`` asks for it and a device is visible. Sets nothing: that is the job entry's
        (``job.set_up_process``)."""
        cuda = cfg.gpus > 0 and torch.cuda.is_available()
        if cfg.gpus > 0 and not cuda:
            log.warning("train.gpus=%d but no CUDA device is visible: training on CPU", cfg.gpus)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        return cls(device, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


class Trainer:
    """One training run: one process, or one rank of several (``Placement``). The store is preloaded into the
    device's memory when ``train.preload`` says so, else streamed."""

    def __init__(self, cfg: TrainConfig, store: str, target: str, state_dir: str,
                 placement: Placement | None = None):
        began = time.perf_counter()
        self.cfg, self.placement = cfg, placement or Placement.of_this_process(cfg)
        on_coefficients = cfg.coefficients and HiddenStateStore(store).logical_dtype == "compact"
        self.data = HiddenStateStore(store, coefficients=on_coefficients)
        # a compact store's coefficients: one "layer" of r values, fed to fc' = fc U (exported as fc' U^T)
        self.basis = self.data.stored_codec.basis if on_coefficients else None
        self.num_layers = 1 if self.basis is not None else len(self.data.attrs["layer_ids"])
        held = held_dtype(self.data, self.amp)
        preloaded = None
        if cfg.preload is True or (cfg.preload == "auto" and fits_in_memory(self.data, self.device, dtype=held)):
            # the features load while the drafter is built and compiled (warm_up); the first step waits for them
            preloaded = Preloaded(self.data, self.device, threads=cfg.threads, background=True, dtype=held)
        self.drafter = build_drafter(cfg, self.data, target, self.device, torch.bfloat16 if self.amp else torch.float32)
        if self.basis is not None:
            self.drafter.fc = coefficient_fc(self.drafter.fc, self.basis)
            log.info("fc' over the compact store's %d coefficients per token (exported as fc = fc' U^T over %d "
                     "features)", self.basis.rank, self.basis.vectors.shape[0])
        self.initial_weights = {k: v.detach().clone() for k, v in self.drafter.state_dict().items()}
        self.timing: dict[str, float] = {"build_s": time.perf_counter() - began, "data_s": 0.0}  # the run's, see timing.LoopClock
        gamma = cfg.gamma or default_gamma(cfg.block_size)
        self.rule = AnchorRule(cfg.block_size, gamma, cfg.max_anchors, cfg.seed)
        self.val_rule = AnchorRule(cfg.block_size, gamma, cfg.val_max_anchors or cfg.max_anchors, cfg.seed)
        train_ids, val_ids = self._split(preloaded.loss_mask if preloaded is not None
                                         else self.data.token_array("loss_mask"))
        self.sampler = LengthGroupedBatches(train_ids, self.data.lengths, cfg.tokens_per_batch, cfg.seed)
        self.val_batches = LengthGroupedBatches(val_ids, self.data.lengths, cfg.tokens_per_batch, cfg.seed,
                                                shuffle=False).batches(0)
        self.preloaded = preloaded
        self.streamed = None if preloaded else StreamedSteps(self.data, self.drafter.config.hidden_size,
                                                             cfg.num_workers, cfg.prefetch_factor, self.amp, held)
        self.per_epoch = len(self.sampler.batches(0))
        self.total = cfg.steps or self.per_epoch * cfg.epochs
        self.epochs = math.ceil(self.total / self.per_epoch)  # with train.steps the last one may stop part-way
        self.log_every = cfg.log_every or max(1, self.total // 100)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizers = make_optimizers(cfg, self.drafter)
        self.schedulers = make_schedulers(self.optimizers, self.total, cfg.warmup_ratio)
        self.fingerprint = checkpoint.fingerprint(cfg, self.data, export_config_dict(self.drafter.config))
        self.state_path = Path(state_dir) / "checkpoint.pt"
        self.snapshot_dir = Path(state_dir) / "snapshots"
        self.snapshot_steps = checkpoint.snapshot_steps(cfg.snapshots, self.total)  # step -> percentages
        self.step = self.epoch = self.batch_index = self.tokens = 0  # tokens: trained so far, all ranks
        self.rows: list[dict] = []  # the training log: one row per step, validation columns at epoch ends
        self.pending: list[tuple[dict, torch.Tensor, torch.Tensor]] = []  # rows whose loss is still on the device
        log.info("drafter: %.1fM trainable parameters, layers %s, mask token %d, B=%d, gamma %.2f, optimizer %s; "
                 "%d train / %d validation samples, %d steps per epoch, %s, world %d, %s, data %s; "
                 "built in %.1f s", sum(p.numel() for p in self.params) / 1e6,
                 self.drafter.config.target_layer_ids, self.drafter.mask_token_id, cfg.block_size, gamma,
                 cfg.optimizer, len(train_ids), len(val_ids), self.per_epoch,
                 f"{cfg.epochs} epochs" if cfg.steps is None
                 else f"{self.total} steps (train.steps: {self.total / self.per_epoch:.2f} epochs)",
                 self.world, self.device,
                 "preloaded" if preloaded else f"streamed by {cfg.num_workers} workers", self.timing["build_s"])

    device = property(lambda self: self.placement.device)
    rank = property(lambda self: self.placement.rank)
    world = property(lambda self: self.placement.world)
    amp = property(lambda self: self.placement.amp)

    def _split(self, loss_mask) -> tuple[list[int], list[int]]:
        """The train and validation samples: the seeded split, less samples without a block to train, the train
        part cut to ``max_samples``."""
        cfg = self.cfg
        trainable = eligible_counts(loss_mask, self.data.lengths) > 0
        train_ids, val_ids = split_indices(len(self.data), cfg.val_fraction, cfg.seed)
        train_ids, val_ids = [i for i in train_ids if trainable[i]], [i for i in val_ids if trainable[i]]
        if cfg.max_samples is not None and cfg.max_samples < len(train_ids):
            keep = torch.randperm(len(train_ids), generator=seeded(cfg.seed, "subset"))[: cfg.max_samples]
            train_ids = sorted(train_ids[i] for i in keep.tolist())
        if not trainable.all():
            log.info("%d of %d samples have no two response tokens in a row (no block to train): left out",
                     int((~trainable).sum()), len(trainable))
        if not train_ids:
            raise ValueError(f"{self.data.path}: no training sample has two response tokens in a row")
        return train_ids, val_ids

    # ---- data ----
    def steps(self, epoch: int, batches: list[list[int]], rule: AnchorRule, name: str = "train",
              loaded: bool = True):
        """An iterator over this rank's packs of each batch, in order (``epoch`` keys the anchors); with streamed
        data, creating it starts the ``name`` loader's workers reading ahead. ``loaded``: ``Preloaded.step``'s."""
        mine = [batch[self.rank :: self.world] for batch in batches]
        hidden, num_layers = self.drafter.config.hidden_size, self.num_layers
        mask_id = self.drafter.mask_token_id
        if self.preloaded is not None:
            return (self.preloaded.step(samples, rule, epoch, num_layers, mask_id, hidden, loaded=loaded)
                    for samples in mine)
        layouts = iter(self.streamed.loader([(rule, epoch, samples) for samples in mine], name))
        return ([Pack.to_device(layout, self.streamed.on_device(features, self.device), num_layers, mask_id,
                                rule.block_size, self.device) for layout, features in step] for step in layouts)

    def epoch_length(self, epoch: int) -> int:
        """The steps this run takes in ``epoch``: all of its batches, except in a last epoch cut at ``total``."""
        return min(self.per_epoch, self.total - epoch * self.per_epoch)

    def epoch_steps(self, epoch: int, start: int):
        return self.steps(epoch, self.sampler.batches(epoch)[start : self.epoch_length(epoch)], self.rule)

    # ---- the loop ----
    def run(self) -> list[dict]:
        """Train to the end (from the last checkpoint if there is a matching one); returns the log rows."""
        self.resume()
        if self.preloaded is not None and self.epoch < self.epochs:
            self.wait_for_preload()
        clock = LoopClock(self.device, self.step, self.tokens)
        batches = self.epoch_steps(self.epoch, self.batch_index) if self.epoch < self.epochs else iter(())
        self.drafter.train()
        clock.start()
        while self.epoch < self.epochs:
            self.train_epoch(batches, clock)
            if self.epoch + 1 < self.epochs:
                batches = self.epoch_steps(self.epoch + 1, 0)  # the next epoch's first batches load meanwhile
            clock.pause()
            clock.validation += self.timed(self.validate_epoch)
            self.epoch, self.batch_index = self.epoch + 1, 0
            clock.checkpoint += self.save_checkpoint()
        clock.validation += self.timed(self.validate_untrained)
        self.timing.update(clock.finish(self.step, self.tokens, self.rank))
        return self.rows

    def wait_for_preload(self) -> None:
        """On GPU, compile on the first step's shapes meanwhile (``warm_up``); then wait for the features."""
        if self.cfg.compile and self.device.type == "cuda":
            self.warm_up()
        self.timing.update(data_s=self.preloaded.wait(), preload_s=self.preloaded.seconds,
                           preload_gib=self.preloaded.nbytes / 2**30)
        log.info("the preload took %.1f s; the trainer waited %.1f s for it", self.preloaded.seconds,
                 self.timing["data_s"])

    # ---- what the run keeps (checkpoint) ----
    def resume(self) -> None:
        """Continue from the checkpoint in the state directory, unless there is none or it is stale."""
        if self.state_path.exists():  # in a bucket: the chunks of the steps a resume skips are not read again
            self.data.check_listed()
        position = checkpoint.resume(self.state_path, self.fingerprint, self.drafter, self.optimizers, self.schedulers)
        if position is not None:
            self.step, self.epoch, self.batch_index = position.step, position.epoch, position.batch
            self.tokens, self.rows = position.tokens, position.rows

    def save_checkpoint(self) -> float:
        """Write the resume checkpoint (rank 0; every rank waits for it) -> the seconds it took."""
        self.read_losses()
        position = checkpoint.Position(self.step, self.epoch, self.batch_index, self.tokens, self.rows)
        return checkpoint.save(self.state_path, self.fingerprint, position, self.drafter, self.optimizers,
                               self.schedulers, rank=self.rank, world=self.world)

    def export(self, directory, **extra) -> None:
        """The drafter as it is now, in the DFlash format with its ``training.json`` (``checkpoint.export``)."""
        checkpoint.export(directory, self.drafter, store=self.data, fingerprint=self.fingerprint,
                          train_config=self.cfg, basis=self.basis, **extra)

    @staticmethod
    def timed(work) -> float:
        began = time.perf_counter()
        work()
        return time.perf_counter() - began

    def train_epoch(self, batches, clock: LoopClock) -> None:
        """The rest of this epoch's steps, from ``batches`` (this rank's packs of each)."""
        global_batches = self.sampler.batches(self.epoch)  # every rank's samples: the trained-token count
        clock.waiting()
        for packs in batches:
            clock.data_ready()
            launch = time.perf_counter()
            loss, grad_norm, lr = self.train_step(packs)
            clock.launched(launch)
            self.tokens += int(self.data.lengths[global_batches[self.batch_index]].sum())
            self.step, self.batch_index = self.step + 1, self.batch_index + 1
            row = {"step": self.step, "epoch": self.epoch + self.batch_index / self.per_epoch,
                   "tokens": self.tokens, "train_loss": None, "lr": lr}
            self.rows.append(row)
            self.pending.append((row, loss.detach(), grad_norm.detach()))
            for percent in self.snapshot_steps.get(self.step, []) if self.rank == 0 else []:
                self.export(self.snapshot_dir / f"{percent}pct", steps=self.step, trained_tokens=self.tokens)
            if self.step % self.log_every == 0:
                self.read_losses()
                log.info("step %d/%d epoch %d: loss %.4f, grad norm %.3f, lr %.2e, %s", self.step, self.total,
                         self.epoch, row["train_loss"], row["grad_norm"], lr, clock.progress(self.step, self.total))
            if self.step % self.cfg.checkpoint_every == 0 and self.batch_index < self.epoch_length(self.epoch):
                clock.checkpoint += self.save_checkpoint()
            clock.step_ends()

    def train_step(self, packs: list[Pack]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimiser step over this rank's part of a global batch -> (mean loss, grad norm) on the device, lr.
        Every global batch has a loss weight (samples without an anchor are left out of training)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        total_weight = all_sum(sum((p.weights.sum().double() for p in packs), zero))
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss_sum = all_sum(accumulate_gradients(self.drafter, packs, total_weight, self.amp))
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

    def warm_up(self) -> None:
        """Compile on the next step's shapes while the store still loads: one forward and backward of its packs
        over the features loaded so far (zeros elsewhere), the gradients dropped (weights, optimiser states and
        the data order untouched)."""
        began = time.perf_counter()
        batch = self.sampler.batches(self.epoch)[self.batch_index]
        packs = next(self.steps(self.epoch, [batch], self.rule, loaded=False))
        if packs:
            accumulate_gradients(self.drafter, packs, torch.ones((), dtype=torch.float64, device=self.device),
                                 self.amp)
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timing["warm_up_s"] = time.perf_counter() - began
        log.info("compiled on the first step's shapes in %.1f s (the store %s meanwhile)", self.timing["warm_up_s"],
                 "loading" if self.preloaded.seconds is None else "loaded")

    # ---- validation ----
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

    def validate_epoch(self) -> None:
        """The validation at an epoch's end, into the last step's log row."""
        self.read_losses()
        metrics = self.validate()
        self.rows[-1].update(metrics)
        log.info("validation at step %d: loss %.4f, acceptance proxy %.3f, slot-1 accuracy %.3f", self.step,
                 metrics["val_loss"], metrics["val_proxy"], metrics["val_acc_1"])

    def validate_untrained(self) -> None:
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

    def stop_workers(self) -> None:
        """Stop streamed loaders' persistent workers now rather than at interpreter exit, and log how long it took."""
        if self.streamed is not None:
            began = time.perf_counter()
            self.streamed.close()
            log.info("stopped the data loader workers in %.1f s", time.perf_counter() - began)
