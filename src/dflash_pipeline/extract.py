"""Capture the target's hidden states at the configured layers for every real token of a shard."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from .atomic import atomic_path
from .store import ShardWriter
from .target import decoder_layers, load_target, resolve_layer_ids
from .tokenization import read_tokenized

log = logging.getLogger(__name__)


class _StopForward(Exception):
    """Raised by the last capture hook: the layers after it, the norm and the LM head are never run."""


class LayerCapture:
    """Forward hooks that keep the outputs of decoder layers ``layer_ids`` (z-lab numbering: the
    output of decoder layer x, which is ``output_hidden_states[x + 1]``) and stop the forward after
    the last of them."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(model)
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= len(layers):
            raise ValueError(f"layer ids {layer_ids} out of range for a target of {len(layers)} layers")
        self.model, self.layers, self.layer_ids, self.outputs = model, layers, list(layer_ids), {}

    def _hook(self, index: int):
        def hook(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output
            if index == max(self.layer_ids):
                raise _StopForward

        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features [batch, seq, K, D] of the captured layers, in ``layer_ids`` order."""
        self.outputs.clear()
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in set(self.layer_ids)]
        try:
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        features = torch.stack([self.outputs[i] for i in self.layer_ids], dim=2)
        self.outputs.clear()
        return features


def length_batches(lengths: np.ndarray, tokens_per_batch: int) -> list[tuple[int, int]]:
    """Consecutive ranges of length-sorted samples whose padded size stays within ``tokens_per_batch``."""
    batches, start = [], 0
    for end in range(1, len(lengths) + 1):
        if (end - start) * int(lengths[end - 1]) > tokens_per_batch and end - 1 > start:
            batches.append((start, end - 1))
            start = end - 1
    if start < len(lengths):
        batches.append((start, len(lengths)))
    return batches


def extract_shard(
    tokenized_path: str | Path,
    model: nn.Module,
    out_path: str | Path,
    *,
    layer_ids: list[int],
    store_dtype: str,
    tokens_per_batch: int,
    chunk_tokens: int,
    compression: str,
    attrs: dict,
) -> dict:
    """Run the target over one tokenised shard and write its features as a store shard, atomically."""
    frame = read_tokenized(tokenized_path)
    lengths = frame["num_tokens"].to_numpy()
    if len(lengths) and np.any(np.diff(lengths) < 0):
        raise ValueError(f"{tokenized_path}: samples are not sorted by length")
    device = next(model.parameters()).device
    capture = LayerCapture(model, layer_ids)
    hidden = model.config.get_text_config().hidden_size
    stored = {"float32": torch.float32, "bfloat16": torch.bfloat16}[store_dtype]
    batches = length_batches(lengths, tokens_per_batch)
    started, padded = time.perf_counter(), 0
    with atomic_path(out_path) as tmp:
        writer = ShardWriter(tmp, num_tokens=int(lengths.sum()), num_layers=len(layer_ids), hidden_size=hidden,
                             logical_dtype=store_dtype, chunk_tokens=chunk_tokens, compression=compression)
        for start, end in tqdm(batches, desc=f"extract {Path(tokenized_path).stem}", mininterval=10):
            width = int(lengths[end - 1])
            ids = torch.zeros((end - start, width), dtype=torch.long)
            mask = torch.zeros((end - start, width), dtype=torch.long)
            for row, sample in enumerate(frame["input_ids"].iloc[start:end]):
                ids[row, : len(sample)] = torch.from_numpy(sample)
                mask[row, : len(sample)] = 1
            padded += ids.numel()
            features = capture(ids.to(device), mask.to(device)).to(stored).cpu()
            for row in range(end - start):
                writer.write(features[row, : int(lengths[start + row])])
        meta = writer.close(
            np.concatenate(list(frame["input_ids"])) if len(frame) else np.zeros(0, np.int32),
            np.concatenate(list(frame["loss_mask"])) if len(frame) else np.zeros(0, np.uint8),
            lengths, list(frame["id"]),
            {**attrs, "layer_ids": list(layer_ids), "hidden_size": hidden},
        )
    seconds = time.perf_counter() - started
    real = int(lengths.sum())
    log.info("%d samples, %d tokens in %.1f s (%.0f tok/s), %.1f %% of computed tokens real",
             len(lengths), real, seconds, real / max(seconds, 1e-9), 100 * real / max(padded, 1))
    return meta


def run_extract(tokenized_path, out_path, *, target: str, revision, trust_remote_code: bool, dtype: str,
                settings: dict, shard: int, device: str | None = None) -> dict:
    """The ``extract`` job: load the target, resolve the layer ids, write one store shard."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(target, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code)
    num_target_layers = model.config.get_text_config().num_hidden_layers
    layer_ids = resolve_layer_ids(settings["layer_ids"], settings["num_layers"], num_target_layers)
    store_dtype = dtype if settings["store_dtype"] == "auto" else settings["store_dtype"]
    if store_dtype == "float16":
        store_dtype = "bfloat16"
    log.info("shard %d on %s (leased GPUs: %s): layers %s of %d, store %s", shard, device,
             os.environ.get("CUDA_VISIBLE_DEVICES", "none"), layer_ids, num_target_layers, store_dtype)
    return extract_shard(
        tokenized_path, model, out_path, layer_ids=layer_ids, store_dtype=store_dtype,
        tokens_per_batch=settings["tokens_per_batch"], chunk_tokens=settings["chunk_tokens"],
        compression=settings["compression"],
        attrs={"shard": shard, "num_target_layers": num_target_layers, "target_dtype": dtype},
    )
