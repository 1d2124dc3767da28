"""What one training step is fed (docs/design.md, "DFlash, precisely"): its samples cut into packs, each pack's
anchors and loss slots decided on the host, its tensors on the device.

- Anchors (``draw_anchors``): per sample, among the positions p with loss_mask[p] and loss_mask[p + 1] (a response
  token followed by a response token), the ``max_anchors`` (all of them if fewer) whose hash of
  (seed, epoch, sample, p) is smallest: a uniform draw without replacement, anew each epoch, the same in any process
  and for any worker or GPU count.
- Layout (``pack_layouts``, numpy on the host): the step's samples in packs of at most ``PACK_ELEMENTS`` (context
  tokens + block slots) x hidden size, and per pack everything that fixes a shape: lengths, anchors, block counts,
  the block slots that carry a loss with their labels and weights. So the loop never asks the device for a size
  (no host sync in a step).
- Tensors, from one of two sources: ``Preloaded`` (the store's features read once into the training device's memory;
  a step gathers its rows there) or ``StreamedSteps`` (DataLoader workers read each step's samples from the store,
  for stores larger than memory). Both end in ``Pack`` (``Pack.to_device``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import sys
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .losses import slot_weights
from .store import HiddenStateStore

log = logging.getLogger(__name__)

# A packed pass holds at most PACK_ELEMENTS (context tokens + block slots) x hidden size: its activations are
# proportional to that. 2**25 is ~58k packed tokens for SmolLM2 (D 576), ~8k for D 4096: a longer sample is a
# pass alone.
PACK_ELEMENTS = 2**25
VALIDATION = -1  # the epoch key of the validation anchors: fixed, the same in every pass
# The interpreter's GIL switch interval while the store loads. A loading thread takes the GIL back after each
# file read, decode and CRC; beside a thread running Python (the trainer building and compiling its drafter) each
# take waits for the switch interval, 5 ms by default: the preload ran at a fraction of its speed alone
# (benchmarks/speed/preload_speed.py, "beside Python").
PRELOAD_SWITCH_S = 1e-4


@dataclasses.dataclass(frozen=True)
class AnchorRule:
    block_size: int
    gamma: float
    max_anchors: int
    seed: int = 0


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a bijection that scrambles every bit."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def anchor_keys(seed: int, epoch: int, samples: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """uint64 keys of (seed, epoch, sample, position): independent uniform draws, reproducible anywhere."""
    base = np.uint64(int.from_bytes(hashlib.blake2b(repr((seed, epoch)).encode(), digest_size=8).digest(), "little"))
    return _mix(_mix(base ^ samples.astype(np.uint64)) ^ positions.astype(np.uint64))


def segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start of each sample, sample of each token, position of each token in its sample) of concatenated samples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return starts, owner, np.arange(int(lengths.sum())) - starts[owner]


def eligible_positions(loss_mask: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the positions that can anchor a block: a response token followed by one of its own sample, sample of each
    token, position of each token in its sample) of concatenated samples."""
    _, owner, local = segments(lengths)
    mask = np.asarray(loss_mask, dtype=bool)
    ok = mask & np.append(mask[1:], False) & (local != np.asarray(lengths)[owner] - 1)
    return np.flatnonzero(ok), owner, local


def eligible_counts(loss_mask: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Per sample, the positions that can anchor a block."""
    eligible, owner, _ = eligible_positions(loss_mask, lengths)
    return np.bincount(owner[eligible], minlength=len(lengths))


def draw_anchors(loss_mask: np.ndarray, lengths: np.ndarray, samples: np.ndarray, rule: AnchorRule,
                 epoch: int) -> np.ndarray:
    """Anchor positions (indices into the concatenation of the samples, sorted) of concatenated samples."""
    eligible, owner, local = eligible_positions(loss_mask, lengths)
    if eligible.size == 0:
        return eligible
    seq = owner[eligible]
    count = np.bincount(seq, minlength=len(lengths))
    take = np.minimum(rule.max_anchors, count)
    if np.array_equal(take, count):  # every eligible position anchors: nothing to draw
        return eligible
    keys = anchor_keys(rule.seed, epoch, np.asarray(samples)[seq], local[eligible])
    order = np.lexsort((keys, seq))  # by sample, then key
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - (np.cumsum(count) - count)[seq[order]]
    return eligible[rank < take[seq]]


@dataclasses.dataclass
class PackLayout:
    """One packed pass on the host (numpy). Positions are indices into the pack's concatenated tokens."""

    samples: np.ndarray  # store indices [S]
    lengths: np.ndarray  # [S]
    anchors: np.ndarray  # [n] positions within their own sample (RoPE positions of slot 0)
    anchor_tokens: np.ndarray  # [n] token ids at the anchors
    block_counts: np.ndarray  # [S]
    slots: np.ndarray  # [m] flat indices into [n * B] of the slots with a loss
    labels: np.ndarray  # [m] token ids
    weights: np.ndarray  # [m] slot weights


def pack_layouts(input_ids: np.ndarray, loss_mask: np.ndarray, lengths: np.ndarray, samples: np.ndarray,
                 rule: AnchorRule, epoch: int, hidden_size: int,
                 pack_elements: int = PACK_ELEMENTS) -> list[tuple[slice, PackLayout]]:
    """The packs of one step's samples (given concatenated, in step order) with the token range of each."""
    lengths, samples = np.asarray(lengths, dtype=np.int64), np.asarray(samples, dtype=np.int64)
    B = rule.block_size
    anchors = draw_anchors(loss_mask, lengths, samples, rule, epoch)
    starts, owner, local = segments(lengths)
    counts = np.bincount(owner[anchors], minlength=len(lengths))
    groups, size = [], 0  # consecutive samples, greedily, under the cap; a sample over it is a pack alone
    for s, tokens in enumerate(lengths + B * counts):
        if not groups or (size + tokens) * hidden_size > pack_elements:
            groups.append([s, s])
            size = 0
        groups[-1][1], size = s + 1, size + int(tokens)
    w = _slot_weights(B, rule.gamma)
    mask = np.asarray(loss_mask, dtype=bool)
    ends = starts + lengths
    out = []
    for first, last in groups:
        begin, end = int(starts[first]), int(ends[last - 1])
        chosen = anchors[np.searchsorted(anchors, begin) : np.searchsorted(anchors, end)]  # anchors are sorted
        positions = chosen[:, None] + np.arange(B)
        # a slot has a loss if its token is a response token of its own sample (slot 0 is the anchor's, given)
        valid = (positions < ends[owner[chosen]][:, None]) & mask.take(positions, mode="clip")
        valid[:, 0] = False
        slots = np.flatnonzero(valid)
        label_positions = positions.ravel()[slots]
        out.append((slice(begin, end), PackLayout(
            samples=samples[first:last], lengths=lengths[first:last], anchors=local[chosen],
            anchor_tokens=np.asarray(input_ids)[chosen], block_counts=counts[first:last], slots=slots,
            labels=np.asarray(input_ids)[label_positions], weights=w[slots % B])))
    return out


def host_tensor(arrays: list[np.ndarray], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """The 1-D ``arrays`` end to end in one new host tensor of ``dtype``; ``pin``: in pinned memory, for a
    non-blocking copy to the GPU. numpy writes it, in the calling thread: ``Tensor.pin_memory()`` copies a large
    array with torch's intra-op threads, and the launching thread then waits for all of them to wake."""
    out = torch.empty(sum(len(a) for a in arrays), dtype=dtype, pin_memory=pin)
    np.concatenate(arrays, out=out.numpy(), casting="same_kind")
    return out


@functools.lru_cache(maxsize=8)
def _slot_weights(block_size: int, gamma: float) -> np.ndarray:
    weights = slot_weights(block_size, gamma).numpy().astype(np.float32)
    weights.flags.writeable = False
    return weights


@dataclasses.dataclass
class Pack:
    """One packed pass on the device: ``forward_blocks``' arguments and the loss slots."""

    context: torch.Tensor  # [1, T, K*D]
    anchors: torch.Tensor  # [n]
    blocks: torch.Tensor  # [n, B]
    slots: torch.Tensor  # [m]
    labels: torch.Tensor  # [m]
    weights: torch.Tensor  # [m]
    lengths: list[int]
    block_counts: list[int]

    @staticmethod
    def to_device(layout: PackLayout, features: torch.Tensor, num_layers: int, mask_token_id: int,
                  block_size: int, device) -> "Pack":
        """``features`` [T, K, D] of the pack's tokens (on ``device`` already or on the host; the first K layers of
        a store with more: a store of the former ``extract.final_hidden``); the small index arrays go over in one
        pinned, non-blocking copy."""
        ints = [layout.anchors, layout.anchor_tokens, layout.slots, layout.labels]
        sizes = [len(a) for a in ints]
        pin = torch.device(device).type == "cuda"
        packed, weights = host_tensor(ints, torch.int64, pin), host_tensor([layout.weights], torch.float32, pin)
        anchors, anchor_tokens, slots, labels = packed.to(device, non_blocking=True).split(sizes)
        features = features.to(device, non_blocking=True)
        T = features.shape[0]
        blocks = torch.full((len(layout.anchors), block_size), mask_token_id, dtype=torch.long, device=device)
        blocks[:, 0] = anchor_tokens
        return Pack(context=features[:, :num_layers].reshape(1, T, -1), anchors=anchors, blocks=blocks, slots=slots,
                    labels=labels, weights=weights.to(device, non_blocking=True),
                    lengths=layout.lengths.tolist(), block_counts=layout.block_counts.tolist())


# ---- sources ----
class Preloaded:
    """The whole store in the training device's memory: features [N tokens, K(+1), D] read once (CRC-checked, in
    ``threads`` threads), token ids and loss masks on the host. A step gathers its rows on the device.
    ``background``: the features load in a thread while the caller goes on (``wait``, or the first ``step``,
    joins it and raises a failed read). ``dtype``: what a step's features are in (default: the store's;
    ``held_dtype``). A store whose codec ``decodes_on_device`` (fp8) is held as stored, a byte per value and its
    scales (``arrays``), and a step decodes the rows it gathers, to the values the store decodes them to: half the
    memory of bfloat16. Other stores are held decoded, in ``dtype`` (``arrays["features"]``)."""

    def __init__(self, store: HiddenStateStore, device, threads: int = 8, rows_per_read: int = 1 << 15,
                 background: bool = False, dtype: torch.dtype | None = None):
        self.store, self.device = store, torch.device(device)
        self.input_ids, self.loss_mask = store.token_array("input_ids"), store.token_array("loss_mask")
        self.dtype = dtype or store.feature_dtype
        self.codec = store.codec if store.codec.decodes_on_device else None  # held as stored, decoded per step
        self.arrays = {name: torch.zeros((store.num_tokens, *shape), dtype=element, device=self.device)
                       for name, (shape, element) in held_arrays(store, self.dtype).items()}
        self.seconds = None  # how long the features took to load, once they have
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="preload")
        self._loading = pool.submit(self._load, list(store.feature_pieces(rows_per_read)), threads)
        pool.shutdown(wait=not background)
        if not background:
            self.wait()

    def _load(self, pieces: list[tuple[int, slice]], threads: int) -> None:
        started = time.perf_counter()
        load_features(self.store, self.arrays if self.codec else self.arrays["features"], pieces, threads)
        self.seconds = time.perf_counter() - started
        gib = self.nbytes / 2**30
        log.info("preloaded %d tokens of features (%.1f GiB, %s) onto %s in %.1f s (%.2f GiB/s, %d threads)",
                 self.store.num_tokens, gib, ", ".join(f"{name} {tuple(a.shape)} {a.dtype}"
                                                        for name, a in self.arrays.items()),
                 self.device, self.seconds, gib / max(self.seconds, 1e-9), threads)

    @property
    def nbytes(self) -> int:
        """The device memory the features are held in."""
        return sum(a.numel() * a.element_size() for a in self.arrays.values())

    def wait(self) -> float:
        """Until the features are in memory -> the seconds waited for them."""
        if self._loading is None:
            return 0.0
        began = time.perf_counter()
        self._loading.result()
        self._loading = None
        return time.perf_counter() - began

    def step(self, samples, rule: AnchorRule, epoch: int, num_layers: int, mask_token_id: int, hidden_size: int,
             pack_elements: int = PACK_ELEMENTS, loaded: bool = True) -> list[Pack]:
        """The step's packs; ``loaded=False``: without waiting for the features (zeros where they have not loaded
        yet: for compiling on the step's shapes only)."""
        if loaded:
            self.wait()
        if not len(samples):  # a rank with no sample in this batch
            return []
        offsets = self.store.sample_offsets
        samples = np.asarray(samples, dtype=np.int64)
        index = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in samples])
        ids, mask = self.input_ids[index], self.loss_mask[index]
        lengths = offsets[samples + 1] - offsets[samples]
        packs = []
        for rows, layout in pack_layouts(ids, mask, lengths, samples, rule, epoch, hidden_size, pack_elements):
            token_index = host_tensor([index[rows]], torch.int64, self.device.type == "cuda")
            token_index = token_index.to(self.device, non_blocking=True)
            if self.codec:
                stored = {name: a.index_select(0, token_index) for name, a in self.arrays.items()}
                features = self.codec.decode_tensors(stored).to(self.dtype)
            else:
                features = self.arrays["features"].index_select(0, token_index)
            packs.append(Pack.to_device(layout, features, num_layers, mask_token_id, rule.block_size, self.device))
        return packs


def load_features(store: HiddenStateStore, features: torch.Tensor | dict[str, torch.Tensor],
                  pieces: list[tuple[int, slice]], threads: int, switch_s: float = PRELOAD_SWITCH_S) -> None:
    """The store's feature rows ``pieces`` [(shard, rows)] into ``features`` [the store's tokens, ...] (on any
    device), decoded, or as stored into {array name: tensor} (``held_arrays``), read in ``threads`` threads, the
    interpreter's GIL switch interval ``switch_s`` meanwhile."""

    def read(piece):
        shard, rows = piece
        start = int(store.shard_token_offsets[shard])
        held = slice(start + rows.start, start + rows.stop)
        if isinstance(features, dict):
            for name, values in store.stored_rows(shard, rows).items():
                features[name][held].copy_(torch.from_numpy(np.ascontiguousarray(values)))
        else:
            features[held].copy_(store.read_features(shard, rows))

    with switch_interval(switch_s), concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(read, pieces))
    device = next(iter(features.values())).device if isinstance(features, dict) else features.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def switch_interval(seconds: float):
    """``sys.setswitchinterval(seconds)`` for the duration (process-wide), then the one before."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class _StepDataset(Dataset):
    """``dataset[(rule, epoch, samples)]`` -> the step's [(layout, features)], read from the store (in a worker).
    The features are decoded and cast to ``dtype`` there, or, for a codec that ``decodes_on_device`` (fp8), handed
    over as stored ({array name: rows}) for ``StreamedSteps.on_device``."""

    def __init__(self, store: HiddenStateStore, hidden_size: int, dtype: torch.dtype | None = None):
        self.store, self.hidden_size, self.dtype = store, hidden_size, dtype or store.feature_dtype

    def __getitem__(self, key):
        rule, epoch, samples = key
        if not len(samples):  # a rank with no sample in this batch
            return []
        reads = [self.store.stored_sample(int(s)) for s in samples]
        ids = np.concatenate([r[0].numpy() for r in reads])
        mask = np.concatenate([r[1].numpy() for r in reads])
        codec = self.store.codec
        stored = {name: np.concatenate([r[2][name] for r in reads]) for name in codec.array_names}
        if codec.decodes_on_device:
            features = {name: torch.from_numpy(rows) for name, rows in stored.items()}
        else:
            features = codec.decode(stored).to(self.dtype)
        lengths = np.array([len(r[0]) for r in reads])
        return [(layout, _take(features, rows)) for rows, layout in
                pack_layouts(ids, mask, lengths, np.asarray(samples), rule, epoch, self.hidden_size)]


def _take(features, rows: slice):
    """``rows`` of decoded features or of stored arrays ({array name: rows})."""
    return {name: values[rows] for name, values in features.items()} if isinstance(features, dict) else features[rows]


def _start_worker(worker_id: int) -> None:
    """A loader worker decodes blosc in its own thread: numcodecs otherwise starts a thread per core in a process's
    main thread, up to 8 workers x 16 beside the host-bound training loop."""
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False


class _Keys:
    """A loader's sampler whose keys are set before each pass (persistent workers keep their loader)."""

    def __init__(self):
        self.keys: list = []

    def __iter__(self):
        return iter(list(self.keys))

    def __len__(self):
        return len(self.keys)


class StreamedSteps:
    """Steps read from the store by ``num_workers`` DataLoader workers (spawn: zarr's async loop deadlocks in forked
    ones; persistent), ``prefetch_factor`` steps each ahead; 0 workers: read in this process. One loader per name
    (training, validation). ``dtype``: what a step's features are in once ``on_device`` (default: the store's)."""

    def __init__(self, store: HiddenStateStore, hidden_size: int, num_workers: int, prefetch_factor: int,
                 pin_memory: bool, dtype: torch.dtype | None = None):
        self.dataset = _StepDataset(store, hidden_size, dtype)
        self.codec, self.dtype = store.codec, self.dataset.dtype
        self.num_workers, self.prefetch_factor, self.pin_memory = num_workers, prefetch_factor, pin_memory
        self.loaders: dict[str, tuple[_Keys, DataLoader]] = {}

    def loader(self, keys, name: str) -> DataLoader:
        """The ``name`` loader over ``keys`` = [(rule, epoch, samples), ...]."""
        if name not in self.loaders:
            extra = {}
            if self.num_workers > 0:
                extra = dict(multiprocessing_context="spawn", persistent_workers=True,
                             prefetch_factor=self.prefetch_factor, worker_init_fn=_start_worker)
            sampler = _Keys()
            self.loaders[name] = sampler, DataLoader(self.dataset, sampler=sampler, batch_size=None,
                                                     num_workers=self.num_workers, pin_memory=self.pin_memory, **extra)
        sampler, loader = self.loaders[name]
        sampler.keys = list(keys)
        return loader

    def on_device(self, features, device) -> torch.Tensor:
        """A pack's features from a loader on ``device`` in ``dtype``; stored rows are decoded there, as the store
        decodes them (the same values)."""
        if isinstance(features, dict):
            stored = {name: rows.to(device, non_blocking=True) for name, rows in features.items()}
            return self.codec.decode_tensors(stored).to(self.dtype)
        return features.to(device, non_blocking=True)

    def close(self) -> None:
        for _, loader in self.loaders.values():
            loader._iterator = None  # the iterator's __del__ joins its workers


def held_dtype(store: HiddenStateStore, amp: bool) -> torch.dtype:
    """The dtype a step's features are in (and decoded features are held in): bfloat16 under bf16 autocast, where
    the drafter takes them as bfloat16 anyway (``fc`` under autocast), so the values it computes with are the same
    and a store dequantised to float32 (compact, float32 target) takes half the memory; without autocast, the
    store's dtype. An fp8 store is held as stored whatever this is (``held_arrays``)."""
    return torch.bfloat16 if amp else store.feature_dtype


def held_arrays(store: HiddenStateStore, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """How ``Preloaded`` holds the store's features: array name -> (shape of one token's row, element type). As
    stored for a codec that ``decodes_on_device`` (fp8: a byte per value and a float32 scale per layer), else
    decoded into ``dtype``."""
    if store.codec.decodes_on_device:
        return store.codec.row_arrays(*store.feature_shape)
    return {"features": (store.feature_shape, dtype)}


def fits_in_memory(store: HiddenStateStore, device, share: float = 0.5, dtype: torch.dtype | None = None) -> bool:
    """Whether the store's features, held as ``Preloaded`` holds them (decoded: in ``dtype``, default the store's),
    take less than ``share`` of the device's free memory."""
    arrays = held_arrays(store, dtype or store.feature_dtype).values()
    need = store.num_tokens * sum(math.prod(shape) * torch.empty((), dtype=element).element_size()
                                  for shape, element in arrays)
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return need < share * free
