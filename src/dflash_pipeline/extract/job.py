"""The extract job: one tokenised shard through the target into a store shard (``extract_shard``), and the job's
entry point (``run_extract``: load the target, resolve the layer ids and the store codec)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
import zarr
from torch import nn
from tqdm import tqdm

from ..store import FeatureCodec, ShardWriter, compact_codec, store_codec
from ..store.remote import shard_destination
from ..target import load_target, resolve_layer_ids
from ..tokenization import read_tokenized
from .capture import LayerCapture, length_batches, real_token_share
from .kernels import use_fla_kernels
from .pipeline import Pipeline
from .timing import ExtractClock

log = logging.getLogger(__name__)


QUEUE_DEPTH = 2  # encoded batches waiting for the writer (pinned buffers: one more)


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
    record_path: str | Path | None = None,
) -> dict:
    """Run the target over one tokenised shard and write its features as a store shard, atomically: a local
    directory appears under its name when complete; a shard in a bucket (``out_path`` an s3:// URL) is complete when
    its completion record, written last to ``record_path``, is there (``store.remote``). -> the shard's metadata
    and, under ``timing``, where the time went (``ExtractClock``).

    ``codec``: how the features are stored (``store_codec``: float32, bfloat16 or fp8 e4m3 with per-token,
    per-layer scales). ``io_threads``: chunks Zarr compresses and writes at once.
    """
    clock = ExtractClock()
    frame = read_tokenized(tokenized_path)
    lengths = frame["num_tokens"].to_numpy().astype(np.int64)
    if len(lengths) and np.any(np.diff(lengths) < 0):
        raise ValueError(f"{tokenized_path}: samples are not sorted by length")
    device = next(model.parameters()).device
    capture = LayerCapture(model, layer_ids)
    hidden = model.config.get_text_config().hidden_size
    batches = length_batches(lengths, tokens_per_batch)
    share = real_token_share(lengths, batches)
    max_rows = max((int(lengths[s:e].sum()) for s, e in batches), default=1)
    samples = list(frame["input_ids"])
    with shard_destination(out_path, record_path) as tmp:
        with zarr.config.set({"async.concurrency": max(1, int(io_threads))}):
            writer = ShardWriter(tmp, num_tokens=int(lengths.sum()), num_layers=len(layer_ids), hidden_size=hidden,
                                 codec=codec, chunk_tokens=chunk_tokens, compression=compression)
            pipeline = Pipeline(writer, device, max_rows=max_rows, depth=QUEUE_DEPTH)
            try:
                for start, end in tqdm(batches, desc=f"extract {Path(tokenized_path).stem}", mininterval=10):
                    batch_lengths = lengths[start:end]
                    ids = np.zeros((end - start, int(batch_lengths.max())), dtype=np.int64)
                    for row, sample in enumerate(samples[start:end]):
                        ids[row, : len(sample)] = sample
                    with clock.timing("forward_call_s"):
                        outputs = capture.layer_outputs(pipeline.to_device(ids))
                    with clock.timing("submit_s"):
                        pipeline.submit(outputs, batch_lengths)
                    del outputs
                with clock.timing("drain_s"):
                    pipeline.finish()
            finally:
                pipeline.writer.stop()
            with clock.timing("close_s"):
                meta = writer.close(
                    np.concatenate(samples) if len(frame) else np.zeros(0, np.int32),
                    np.concatenate(list(frame["loss_mask"])) if len(frame) else np.zeros(0, np.uint8),
                    lengths, list(frame["id"]), {**attrs, "layer_ids": list(layer_ids), "hidden_size": hidden},
                )
    real = int(lengths.sum())
    timing = clock.finish(real_tokens=real, real_token_share=share, batches=len(batches), pipeline=pipeline,
                          writer=writer)
    log.info("%d samples, %d tokens in %d batches, %.1f s (%.0f tok/s); %.2f %% of computed tokens real; "
             "writer busy %.1f s, main thread waited %.1f s for it", len(lengths), real, len(batches),
             timing["seconds"], real / max(timing["seconds"], 1e-9), 100 * share, pipeline.writer.busy,
             pipeline.waited)
    return {**meta, "timing": timing}


def run_extract(tokenized_path, out_path, *, target: str, revision, trust_remote_code: bool, dtype: str,
                settings: dict, shard: int, device: str | None = None, random_weights_seed: int | None = None,
                record_path=None, basis: str | None = None) -> dict:
    """The ``extract`` job: load the target, resolve the layer ids, write one store shard (``out_path``: a local
    directory, or an s3:// URL with its completion record at ``record_path``). ``basis``: the ``compact_basis``
    job's file (``extract.store_dtype: compact``)."""
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
        compression=settings["compression"], io_threads=settings.get("io_threads", 8), record_path=record_path,
        attrs={"shard": shard, "num_target_layers": num_target_layers, "target_dtype": dtype,
               **({"random_weights_seed": random_weights_seed} if random_weights_seed is not None else {})},
    )
