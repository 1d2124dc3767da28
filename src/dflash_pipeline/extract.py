"""Capture the target's hidden states at the configured layers for every real token of a shard.

The ``extract`` job at GPU speed (issue #6):

1. Only real tokens are computed: samples arrive sorted by length and are cut into batches of at most
   ``tokens_per_batch`` padded tokens (``length_batches``); on a ShareGPT-like length mix more than 98 %
   of the computed tokens are real (``real_token_share``, logged per shard). Batches are right-padded and
   run **without** an attention mask: in a causal decoder a real token only sees positions before it, so
   padding after the last real token cannot change it (attention, the Gated-DeltaNet recurrence and its
   causal short convolution alike), and without a mask SDPA takes its causal flash kernel and the GDN
   layers skip the padding multiply and its host sync. ``tests/test_extract_speed.py`` checks the result
   equals per-sample capture.
2. The forward stops after the last captured layer (``LayerCapture``): no later layers, norm, LM head or
   logits.
3. Overlapped I/O: the real-token rows are gathered, encoded (bf16 / fp32 / fp8 e4m3 with per-token,
   per-layer scales) and counted (the shard statistics) on the device; a side CUDA stream copies them
   (``non_blocking``) into a ring of pinned host buffers and records an event; a writer thread with a
   bounded queue waits for the event and does the chunking, hashing, compression and Zarr writes, so
   the forward of batch i+1 overlaps the copy and write of batch i. On CPU the same path runs without
   streams and pinned buffers (the writer thread still overlaps). A writer failure is raised in the
   main thread at its next hand-over (never a silently incomplete shard: ``atomic_path`` removes it).
4. Kernels (opt-in, CUDA only, ``extract.fla_kernels``): transformers 5.17's qwen3_5 / qwen3_next take
   the Gated-DeltaNet chunked rule from flash-linear-attention when it is installed, but the short
   convolution from the ``causal-conv1d`` package only, else a PyTorch ``F.conv1d`` fallback; the gated
   RMSNorm and the zero-centred RMSNorm are plain PyTorch. ``use_fla_kernels`` swaps in FLA's Triton
   ``causal_conv1d`` / ``rms_norm_gated`` / ``rms_norm`` (same math, float32 inside).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from torch import nn
from tqdm import tqdm

from .atomic import atomic_path
from .store import FeatureCodec, ShardWriter, StoreError, compact_codec, store_codec
from .store.writer import fold_stats
from .target import decoder_layers, final_norm, load_target, resolve_layer_ids
from .tokenization import read_tokenized

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by the last capture hook: the layers after it, the norm and the LM head are never run."""


class LayerCapture:
    """Forward hooks that keep the outputs of decoder layers ``layer_ids`` (z-lab numbering: the
    output of decoder layer x, which is ``output_hidden_states[x + 1]``) and stop the forward after
    the last of them; with ``final_hidden``, also the final norm's output (the LM head's input, HF's last
    ``output_hidden_states``), after the captured layers, and stop there."""

    def __init__(self, model: nn.Module, layer_ids: list[int], final_hidden: bool = False):
        layers = decoder_layers(model)
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= len(layers):
            raise ValueError(f"layer ids {layer_ids} out of range for a target of {len(layers)} layers")
        self.model, self.layers, self.layer_ids, self.outputs = model, layers, list(layer_ids), {}
        self.norm = final_norm(model) if final_hidden else None

    def _hook(self, index):
        def hook(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output
            if index == "final" or (self.norm is None and index == max(self.layer_ids)):
                raise _StopForward

        return hook

    @torch.no_grad()
    def layer_outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The outputs [batch, seq, D] of the captured layers, in ``layer_ids`` order."""
        self.outputs.clear()
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in set(self.layer_ids)]
        if self.norm is not None:
            handles.append(self.norm.register_forward_hook(self._hook("final")))
        try:
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        outputs = [self.outputs[i] for i in self.layer_ids + (["final"] if self.norm is not None else [])]
        self.outputs.clear()
        return outputs

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features [batch, seq, K(+1), D] of the captured layers, in ``layer_ids`` order (then the final one)."""
        return torch.stack(self.layer_outputs(input_ids, attention_mask), dim=2)


def length_batches(lengths: np.ndarray, tokens_per_batch: int, overhead_tokens: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ranges of length-sorted samples whose padded size (rows x longest) stays within
    ``tokens_per_batch`` (a longer sample is a batch alone), chosen to minimise the padded tokens plus
    ``overhead_tokens`` per batch (the cost of one forward call in padded-token equivalents: launches and
    weight reads; default ``tokens_per_batch // 32``). An exact dynamic programme over the split points:
    a greedy fill wastes up to a batch's length spread on short samples, this finds the cheapest cut."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return []
    overhead = tokens_per_batch // 32 if overhead_tokens is None else overhead_tokens
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        width = int(lengths[end - 1])
        first = max(0, end - max(1, tokens_per_batch // max(width, 1)))
        starts = np.arange(first, end)
        cost = best[first:end] + (end - starts) * width + overhead
        pick = int(np.argmin(cost))  # ties: the earliest start, i.e. the fewest batches
        best[end], choice[end] = cost[pick], first + pick
    batches, end = [], n
    while end > 0:
        batches.append((int(choice[end]), end))
        end = int(choice[end])
    return batches[::-1]


def real_token_share(lengths: np.ndarray, batches: list[tuple[int, int]]) -> float:
    """Real tokens / computed (padded) tokens of right-padded batches of length-sorted samples."""
    padded = sum((end - start) * int(lengths[end - 1]) for start, end in batches)
    return float(np.sum(lengths)) / max(padded, 1)


# ---- kernels ----

_FLA_NAMES = ("conv1d", "gated_norm", "rms_norm")
_ZERO_CENTRED_RMSNORMS = ("Qwen3_5RMSNorm", "Qwen3NextRMSNorm")


def _fla_conv1d_fn():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        from fla.modules.convolution import causal_conv1d
    return causal_conv1d


def use_fla_kernels(model: nn.Module, kernels=("conv1d",)) -> contextlib.ExitStack:
    """Swap flash-linear-attention Triton kernels into a hybrid target (CUDA only); returns an ExitStack
    whose ``close()`` undoes the swaps. Kernels: ``conv1d`` (the GDN short convolution: transformers'
    ``causal_conv1d_fn`` falls back to ``F.conv1d`` + SiLU without the ``causal-conv1d`` package),
    ``gated_norm`` (the GDN output's RMSNorm x SiLU(gate)) and ``rms_norm`` (the zero-centred RMSNorms,
    ``x / rms(x) * (1 + w)`` in float32). Raises if FLA is missing or the model is not on CUDA."""
    unknown = sorted(set(kernels) - set(_FLA_NAMES))
    if unknown:
        raise ValueError(f"unknown FLA kernels {unknown} (expected some of {list(_FLA_NAMES)})")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise RuntimeError(f"FLA kernels need a CUDA device, the target is on {device}")
    undo = contextlib.ExitStack()
    gdn = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if "conv1d" in kernels and gdn:
        import importlib

        fla_conv = _fla_conv1d_fn()
        for module_name in sorted({type(m).__module__ for m in gdn}):
            modeling = importlib.import_module(module_name)
            original = getattr(modeling, "causal_conv1d_fn", None)
            if original is None:
                log.warning("%s has no causal_conv1d_fn: its short convolution is left as it is", module_name)
                continue

            def conv1d(hidden_states, weight, bias=None, activation=None, _original=original, **kwargs):
                if not hidden_states.is_cuda:
                    return _original(hidden_states, weight, bias, activation=activation, **kwargs)
                # transformers passes [B, C, T] as a transposed view of the contiguous [B, T, C] projection
                out, _ = fla_conv(x=hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation)
                return out.transpose(1, 2)

            modeling.causal_conv1d_fn = conv1d
            undo.callback(setattr, modeling, "causal_conv1d_fn", original)
    if "gated_norm" in kernels:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        for m in gdn:
            norm = m.norm

            def forward(self, hidden_states, gate):
                return rms_norm_gated(hidden_states, gate, self.weight, None, activation="swish",
                                      eps=self.variance_epsilon).to(hidden_states.dtype)

            norm.forward = types.MethodType(forward, norm)
            undo.callback(vars(norm).pop, "forward", None)
    if "rms_norm" in kernels:
        from fla.modules.norm.layernorm import rms_norm

        for m in model.modules():
            if type(m).__name__ in _ZERO_CENTRED_RMSNORMS:
                def forward(self, x):
                    weight = self.weight.float() + 1.0  # tiny; recomputed so weight edits are seen
                    return rms_norm(x, weight, None, eps=self.eps).to(x.dtype)

                m.forward = types.MethodType(forward, m)
                undo.callback(vars(m).pop, "forward", None)
    return undo


# ---- the overlapped device -> host -> Zarr path ----


@dataclass
class _Item:
    rows: dict[str, np.ndarray]  # codec array name -> encoded rows
    event: object = None  # torch.cuda.Event: the copy into the pinned slot is done
    release: object = None  # returns the pinned slot


class _Writer:
    """A thread that writes encoded rows to the shard in order, fed through a bounded queue. Its first
    error is kept; later items are dropped (their slots still returned) and ``check`` raises it."""

    def __init__(self, shard: ShardWriter, depth: int):
        self.shard, self.error, self.abort, self.busy = shard, None, False, 0.0
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.thread = threading.Thread(target=self._run, name="extract-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                if self.error is None and not self.abort:
                    started = time.perf_counter()
                    if item.event is not None:
                        item.event.synchronize()
                    self.shard.write_encoded(item.rows)
                    self.busy += time.perf_counter() - started
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                self.error = error
            finally:
                if item.release is not None:
                    item.release()

    def check(self) -> None:
        if self.error is not None:
            raise StoreError(f"the shard writer thread failed: {self.error!r}") from self.error

    def put(self, item) -> None:
        while True:
            self.check()
            if not self.thread.is_alive():
                raise StoreError("the shard writer thread stopped")
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        self.put(None)
        self.thread.join()
        self.check()

    def stop(self) -> None:
        self.abort = True
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=0.05)
            except queue.Full:
                continue
            self.thread.join()


class _PinnedRing:
    """Pinned host buffers for the copies of ``slots`` batches in flight (CUDA only), shaped like ``like``'s
    encoded arrays with ``rows`` rows."""

    def __init__(self, slots: int, rows: int, like: dict[str, torch.Tensor]):
        self.free: queue.Queue = queue.Queue()
        for _ in range(slots):
            self.free.put({name: torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
                           for name, t in like.items()})

    def take(self, writer: _Writer):
        while True:
            writer.check()
            try:
                return self.free.get(timeout=0.05)
            except queue.Empty:
                continue


class _Pipeline:
    """Gathers real-token rows, encodes and counts them on the device and hands them to the writer."""

    def __init__(self, shard: ShardWriter, device: torch.device, *, max_rows: int, depth: int):
        self.shard, self.device, self.cuda = shard, device, device.type == "cuda"
        self.totals = None
        self.waited = 0.0
        self.writer = _Writer(shard, depth)
        self.max_rows, self.depth, self.ring = max_rows, depth, None
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.cuda:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    def submit(self, outputs: list[torch.Tensor], lengths: np.ndarray) -> None:
        """``outputs``: the captured layers' [B, W, D] outputs of one right-padded batch."""
        batch, width, hidden = outputs[0].shape
        rows = int(lengths.sum())
        if rows == batch * width:
            flat = torch.stack([o.reshape(rows, hidden) for o in outputs], dim=1)
        else:
            index = self._to_device(np.flatnonzero(np.arange(width)[None, :] < lengths[:, None]))
            flat = torch.stack([o.reshape(batch * width, hidden).index_select(0, index) for o in outputs], dim=1)
        encoded, stats = self.shard.codec.encode(flat)
        del flat
        self._add(stats)
        if self.cuda:
            if self.ring is None:  # pinned once, in the element types the codec stores (fp32 / uint16 / uint8)
                self.ring = _PinnedRing(self.depth + 1, self.max_rows, encoded)
            started = time.perf_counter()
            slot = self.ring.take(self.writer)
            self.waited += time.perf_counter() - started
            ready = torch.cuda.Event()
            ready.record()
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(ready)
                for name, values in encoded.items():
                    slot[name][:rows].copy_(values, non_blocking=True)
                done = torch.cuda.Event()
                done.record()
            for values in encoded.values():
                values.record_stream(self.copy_stream)
            item = _Item({name: buffer[:rows].numpy() for name, buffer in slot.items()}, done,
                         lambda: self.ring.free.put(slot))
        else:
            item = _Item({name: values.cpu().numpy() for name, values in encoded.items()})
        started = time.perf_counter()
        self.writer.put(item)
        self.waited += time.perf_counter() - started

    def _add(self, stats: dict) -> None:
        self.totals = fold_stats(self.totals or {}, {k: v for k, v in stats.items() if k != "token_absmax"})

    def finish(self) -> None:
        self.writer.finish()
        if self.totals is not None:
            self.shard.add_stats({k: v.cpu() for k, v in self.totals.items()})


def batched_layer_outputs(capture: LayerCapture, samples: list[np.ndarray], tokens_per_batch: int, device):
    """The captured layers' outputs of ``samples`` (length-sorted token ids), one right-padded batch at a time:
    yields (outputs [B, W, D] per layer, the batch's lengths)."""
    lengths = np.array([len(sample) for sample in samples], dtype=np.int64)
    for start, end in length_batches(lengths, tokens_per_batch):
        ids = np.zeros((end - start, int(lengths[end - 1])), dtype=np.int64)
        for row, sample in enumerate(samples[start:end]):
            ids[row, : len(sample)] = sample
        yield capture.layer_outputs(torch.from_numpy(ids).to(device)), lengths[start:end]


def extract_shard(
    tokenized_path: str | Path,
    model: nn.Module,
    out_path: str | Path,
    *,
    layer_ids: list[int],
    codec: FeatureCodec,
    tokens_per_batch: int,
    chunk_tokens: int,
    compression: str,
    attrs: dict,
    io_threads: int = 8,
    queue_depth: int = 2,
    attention_mask: bool = False,
    flush_early: bool = True,
    final_hidden: bool = False,
    profile: dict | None = None,
) -> dict:
    """Run the target over one tokenised shard and write its features as a store shard, atomically.

    ``codec``: how the features are stored (``store_codec``: float32, bfloat16 or fp8 e4m3 with per-token,
    per-layer scales).
    ``io_threads``: chunks Zarr compresses and writes at once. ``queue_depth``: encoded batches waiting
    for the writer (pinned buffers: ``queue_depth + 1``). ``attention_mask``: pass the padding mask to
    the model (not needed for right-padded causal batches; kept to measure it). ``flush_early``: fsync
    chunk files while extracting (``ShardWriter``). ``final_hidden``: also store the target's final normed
    hidden state, after the K layers (soft labels; the forward then runs every layer). ``profile``: filled with
    the timing breakdown.
    """
    frame = read_tokenized(tokenized_path)
    lengths = frame["num_tokens"].to_numpy().astype(np.int64)
    if len(lengths) and np.any(np.diff(lengths) < 0):
        raise ValueError(f"{tokenized_path}: samples are not sorted by length")
    device = next(model.parameters()).device
    capture = LayerCapture(model, layer_ids, final_hidden)
    hidden = model.config.get_text_config().hidden_size
    batches = length_batches(lengths, tokens_per_batch)
    share = real_token_share(lengths, batches)
    max_rows = max((int(lengths[s:e].sum()) for s, e in batches), default=1)
    samples = list(frame["input_ids"])
    started = time.perf_counter()
    forward = submit = 0.0
    with atomic_path(out_path) as tmp:
        with zarr.config.set({"async.concurrency": max(1, int(io_threads))}):
            writer = ShardWriter(tmp, num_tokens=int(lengths.sum()), num_layers=len(layer_ids) + final_hidden,
                                 hidden_size=hidden, codec=codec, chunk_tokens=chunk_tokens,
                                 compression=compression, flush_early=flush_early)
            pipeline = _Pipeline(writer, device, max_rows=max_rows, depth=queue_depth)
            first_forward = None
            try:
                for start, end in tqdm(batches, desc=f"extract {Path(tokenized_path).stem}", mininterval=10):
                    batch_lengths = lengths[start:end]
                    width = int(batch_lengths.max())
                    ids = np.zeros((end - start, width), dtype=np.int64)
                    for row, sample in enumerate(samples[start:end]):
                        ids[row, : len(sample)] = sample
                    mask = None
                    if attention_mask:
                        mask = pipeline._to_device((np.arange(width)[None, :] < batch_lengths[:, None]).astype(np.int64))
                    began = time.perf_counter()
                    first_forward = first_forward or began
                    outputs = capture.layer_outputs(pipeline._to_device(ids), mask)
                    submitting = time.perf_counter()
                    forward += submitting - began
                    pipeline.submit(outputs, batch_lengths)
                    submit += time.perf_counter() - submitting
                    del outputs
                draining = time.perf_counter()
                pipeline.finish()
                drained = time.perf_counter()
            finally:
                pipeline.writer.stop()
            closing = time.perf_counter()
            meta = writer.close(
                np.concatenate(samples) if len(frame) else np.zeros(0, np.int32),
                np.concatenate(list(frame["loss_mask"])) if len(frame) else np.zeros(0, np.uint8),
                lengths, list(frame["id"]),
                {**attrs, "layer_ids": list(layer_ids), "hidden_size": hidden, "final_hidden": bool(final_hidden)},
            )
            closed = time.perf_counter()
    seconds = time.perf_counter() - started
    real = int(lengths.sum())
    log.info("%d samples, %d tokens in %d batches, %.1f s (%.0f tok/s); %.2f %% of computed tokens real; "
             "writer busy %.1f s, main thread waited %.1f s for it", len(lengths), real, len(batches), seconds,
             real / max(seconds, 1e-9), 100 * share, pipeline.writer.busy, pipeline.waited)
    if profile is not None:
        parts = list(writer.row_writers.values())
        profile.update(seconds=seconds, real_tokens=real, padded_tokens=int(round(real / share)) if real else 0,
                       real_token_share=share, batches=len(batches), setup_s=(first_forward or started) - started,
                       forward_call_s=forward, submit_s=submit, drain_s=drained - draining,
                       writer_busy_s=pipeline.writer.busy, main_waited_s=pipeline.waited,
                       close_s=closed - closing, fsync_rename_s=seconds - (closed - started),
                       early_fsync_s=writer.flusher.seconds if writer.flusher else 0.0,
                       **{f"{key}_s": sum(part.seconds[key] for part in parts) for key in parts[0].seconds})
    return meta


def run_extract(tokenized_path, out_path, *, target: str, revision, trust_remote_code: bool, dtype: str,
                settings: dict, shard: int, device: str | None = None, random_weights_seed: int | None = None,
                basis: str | None = None) -> dict:
    """The ``extract`` job: load the target, resolve the layer ids, write one store shard. ``basis``: the
    ``compact_basis`` job's file (``extract.store_dtype: compact``)."""
    codec = compact_codec(basis, settings, dtype) if settings["store_dtype"] == "compact" else None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(target, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code,
                        random_weights_seed=random_weights_seed)
    num_target_layers = model.config.get_text_config().num_hidden_layers
    layer_ids = resolve_layer_ids(settings["layer_ids"], settings["num_layers"], num_target_layers)
    codec = codec or store_codec(settings["store_dtype"], dtype)
    kernels = list(settings.get("fla_kernels") or [])
    if kernels and torch.device(device).type == "cuda":
        use_fla_kernels(model, kernels)
    elif kernels:
        log.info("extract.fla_kernels %s ignored: the target runs on %s", kernels, device)
    log.info("shard %d on %s (leased GPUs: %s): layers %s of %d, store %s", shard, device,
             os.environ.get("CUDA_VISIBLE_DEVICES", "none"), layer_ids, num_target_layers, codec.name)
    return extract_shard(
        tokenized_path, model, out_path, layer_ids=layer_ids, codec=codec,
        tokens_per_batch=settings["tokens_per_batch"], chunk_tokens=settings["chunk_tokens"],
        compression=settings["compression"], io_threads=settings.get("io_threads", 8),
        final_hidden=settings.get("final_hidden", False),
        attrs={"shard": shard, "num_target_layers": num_target_layers, "target_dtype": dtype,
               **({"random_weights_seed": random_weights_seed} if random_weights_seed is not None else {})},
    )
