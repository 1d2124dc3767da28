#!/usr/bin/env python3
"""Extraction speed (issue #6): a bare transformers forward against the ``extract`` pipeline, one process.

Builds a Qwen3.5-27B-shaped random-weight hybrid (``Qwen3_5ForCausalLM``: 64 layers = [GDN x3, full] x16,
D 5120, FFN 17408, vocab 248320, gated full attention 24 q / 4 kv heads of 256 with 25 % rotary, GDN 16 key /
48 value heads of 128, conv 4) directly on the device in bf16 (no checkpoint), makes a seeded ShareGPT-like
length mix, and times on the same tokens:

  bare 8x2048     ``model.model`` on 8 x 2048 all-real random tokens: the issue's reference rate
  bare naive      ``model.model`` as a user's script: samples in data order, 8 per call, padded to the
                  longest with an attention mask (HF ``padding=True``), full 64 layers + final norm
  bare buckets    ``model.model`` on the pipeline's length buckets (with the mask)
  pipeline        ``extract_shard``: buckets, no mask, stop after the last captured layer, gather +
                  encode + statistics on the GPU, side-stream D2H into pinned buffers, writer thread
                  (hash, blosc zstd, Zarr) and the shard's fsync + rename, all counted
  pipeline +fla   the same with flash-linear-attention's conv1d / gated-norm / RMSNorm kernels swapped in
  (optional, if time is left: bare buckets +fla, pipeline +fla in the other store dtype,
  a kernel profile of one batch)

Rates count real tokens only. Every pass is preceded by a warm-up of all its batch shapes through the first
four layers (Triton compiles and autotunes per batch size). Self-checks: the stored rows of one padded batch
equal a fresh capture of that batch bit for bit (after the same encoding), stored features of a few
samples match a plain ``output_hidden_states[x+1]`` forward within bf16 (+fp8) tolerance, the shard's
statistics are finite with no zero vectors, and the FLA kernels match transformers' PyTorch paths. The
table is printed last and written with a JSON of all numbers to ``--report`` (e.g. $OUT).

GPU:  python3 benchmarks/speed/extract_speed.py --out /tmp/xb --report $OUT
CPU smoke test: python3 benchmarks/speed/extract_speed.py --device cpu --layers 4 --hidden 128 --intermediate 256
      --heads 4 --kv-heads 2 --head-dim 32 --linear-k-heads 2 --linear-v-heads 4 --linear-k-dim 16
      --linear-v-dim 16 --vocab 1000 --tokens 2000 --max-length 256 --tokens-per-batch 1024 --out /tmp/xb
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))  # runs from a bare checkout too (the GPU machine has no editable install)

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import add_hybrid_shape_arguments, hybrid_config  # noqa: E402

STARTED = time.perf_counter()


def log(*args):
    print(f"[{time.perf_counter() - STARTED:7.1f}s]", *args, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_hybrid_shape_arguments(p)
    run = p.add_argument_group("run")
    run.add_argument("--tokens", type=int, default=196608, help="real tokens of the length mix")
    run.add_argument("--tokens-per-batch", type=int, default=16384)
    run.add_argument("--store-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3", "float32"])
    run.add_argument("--layer-ids", default=None, help="comma-separated; default: the 5-layer rule (1,16,31,46,61)")
    run.add_argument("--kernels", default="conv1d,gated_norm,rms_norm",
                     help="FLA kernels of the '+fla' passes (empty: no such passes)")
    run.add_argument("--naive-batch", type=int, default=8)
    run.add_argument("--chunk-tokens", type=int, default=256)
    run.add_argument("--compression", default="zstd", choices=["zstd", "none"])
    run.add_argument("--io-threads", type=int, default=8)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default=None, help="default: cuda if available")
    run.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    run.add_argument("--out", default="/tmp/extract_speed", help="scratch dir: tokens and shards (removed after)")
    run.add_argument("--report", default=None, help="dir for extract_speed.txt / .json (e.g. $OUT)")
    run.add_argument("--budget-s", type=float, default=300.0,
                     help="skip optional passes that would end past this many seconds since start")
    run.add_argument("--fla-warmup-estimate-s", type=float, default=220.0,
                     help="expected Triton autotuning time of the +fla kernels (skip them when it would pass the budget)")
    run.add_argument("--skip", default=set(), type=lambda text: {name for name in text.split(",") if name},
                     help="comma-separated pass names to skip")
    p.add_argument("--codecs", metavar="STORE", default=None,
                   help="instead: codec ratios and fp8 errors on the features of a merged store, then exit")
    return p.parse_args(argv)


# ---------------------------------------------------------------- model and data


def build_model(args, device, dtype):
    from transformers import AutoModelForCausalLM

    config = hybrid_config(args)
    started = time.perf_counter()
    with torch.device(device):  # parameters are created and initialised (normal, std 0.02) on the device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.requires_grad_(False).eval()
    if device.type == "cuda":
        torch.cuda.synchronize()
    params = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    log(f"built {type(model).__name__} on {device} in {time.perf_counter() - started:.1f} s: "
        f"{params / 1e9:.2f} B parameters ({(params - embed) / 1e9:.2f} B without embeddings and LM head), {dtype}")
    return model


def length_mix(args) -> np.ndarray:
    """Seeded ShareGPT-like token counts: log-normal fitted to the default data's conversations (log-mean
    7.2, log-sd 0.97: median ~1300 tokens), clipped to [16, max_length], until ``--tokens`` real tokens."""
    rng = np.random.default_rng(args.seed)
    lengths, total = [], 0
    while total < args.tokens:
        n = int(np.clip(round(float(np.exp(rng.normal(7.2, 0.97)))), 16, args.max_length))
        n = min(n, args.tokens - total) if args.tokens - total >= 16 else n
        lengths.append(n)
        total += n
    return np.array(lengths, dtype=np.int64)


def make_samples(args, lengths):
    rng = np.random.default_rng(args.seed + 1)
    return [rng.integers(0, args.vocab, n, dtype=np.int64).astype(np.int32) for n in lengths]


def write_tokenized(path: Path, samples) -> pd.DataFrame:
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i]), i))
    frame = pd.DataFrame({
        "id": [f"s{i:06d}" for i in order],
        "num_tokens": [len(samples[i]) for i in order],
        "input_ids": [samples[i] for i in order],
        "loss_mask": [np.ones(len(samples[i]), np.uint8) for i in order],
    })
    frame.to_parquet(path, index=False)
    return frame


def padded(samples, lengths=None):
    lengths = np.array([len(s) for s in samples]) if lengths is None else lengths
    ids = np.zeros((len(samples), int(lengths.max())), dtype=np.int64)
    for row, s in enumerate(samples):
        ids[row, : len(s)] = s
    mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.int64)
    return ids, mask


# ---------------------------------------------------------------- timing helpers


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def to_device(array, device):
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


@torch.no_grad()
def bare_pass(model, batches, device, use_mask: bool = True) -> dict:
    """``model.model`` over (ids, mask) batches; real tokens counted from the masks."""
    real = sum(int(mask.sum()) for _, mask in batches)
    computed = sum(ids.size for ids, _ in batches)
    sync(device)
    reset_peak(device)
    started = time.perf_counter()
    for ids, mask in batches:
        out = model.model(input_ids=to_device(ids, device),
                          attention_mask=to_device(mask, device) if use_mask else None, use_cache=False)
        del out
    sync(device)
    seconds = time.perf_counter() - started
    return dict(seconds=seconds, real_tokens=real, computed_tokens=computed, peak_gib=peak_gib(device))


@torch.no_grad()
def warmup(model, shapes, device, layers_run: int = 4, use_mask=False):
    """Run each distinct (batch, width) through the first ``layers_run`` layers: Triton compiles and
    autotunes per batch size (FLA's cumsum kernels specialise on it), not per layer."""
    from dflash_pipeline.extract import LayerCapture

    capture = LayerCapture(model, [min(layers_run, len(model.model.layers)) - 1])
    started = time.perf_counter()
    for batch, width in sorted(set(shapes)):
        ids = torch.randint(0, model.config.vocab_size, (batch, width), device=device)
        mask = torch.ones_like(ids) if use_mask else None
        if use_mask and width > 1:
            mask[-1, -1] = 0  # a padded batch takes the masked kernels
        capture.layer_outputs(ids, mask)
    sync(device)
    return time.perf_counter() - started


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---------------------------------------------------------------- checks


def relative_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer: ||got - ref|| / ||ref|| and max|got - ref| / max|ref|, for [T, K, D]."""
    got, ref = got.float(), ref.float()
    frob = ((got - ref).norm(dim=(0, 2)) / ref.norm(dim=(0, 2))).tolist()
    peak = ((got - ref).abs().amax(dim=(0, 2)) / ref.abs().amax(dim=(0, 2))).tolist()
    return frob, peak


@torch.no_grad()
def check_chain_exact(model, frame, shard_path, layer_ids, batches, device, tokens_per_batch) -> dict:
    """The stored rows of the first padded batch equal a fresh capture of the same batch after the same
    encoding, bit for bit: gather, encode, D2H, writer thread, chunking and Zarr are exact."""
    import zarr

    from dflash_pipeline.extract import LayerCapture
    from dflash_pipeline.store import codec_from_attrs, read_shard_features

    lengths = frame["num_tokens"].to_numpy()
    padded_batches = [(s, e) for s, e in batches if lengths[s] != lengths[e - 1]] or batches
    start, end = padded_batches[0]
    ids, mask = padded(list(frame["input_ids"][start:end]), lengths[start:end])
    outputs = LayerCapture(model, layer_ids).layer_outputs(to_device(ids, device))
    flat = torch.stack([o[torch.from_numpy(mask.astype(bool)).to(device)] for o in outputs], dim=1)
    group = zarr.open_group(str(shard_path), mode="r")
    attrs = dict(group.attrs)
    rows = slice(int(lengths[:start].sum()), int(lengths[:end].sum()))
    encoded, _ = codec_from_attrs(attrs).encode(flat)
    equal = all(torch.equal(torch.from_numpy(group[name][rows]), values.cpu()) for name, values in encoded.items())
    decoded = read_shard_features(group, rows, attrs).float()
    reference = flat.float().cpu()
    rel = float((decoded - reference).abs().max() / reference.abs().max())
    # bit-exact when the GPU kernels are deterministic; a misplaced row or a wrong decode is off by O(1)
    limit = 0.07 if attrs["logical_dtype"] == "float8_e4m3fn" else 0.01
    return dict(batch=[int(start), int(end)], rows=rows.stop - rows.start, bit_exact=bool(equal),
                rel_max_diff_vs_capture=rel, limit=limit, ok=bool(equal or rel <= limit))


@torch.no_grad()
def check_against_hidden_states(model, frame, shard_path, layer_ids, device, store_dtype, reference_kernels=None) -> dict:
    """Stored features of a few samples vs a plain forward's ``output_hidden_states[x + 1]`` (batch of one),
    computed inside ``reference_kernels`` (a context: transformers' own kernels for the '+fla' passes)."""
    import zarr

    from dflash_pipeline.store import read_shard_features

    group = zarr.open_group(str(shard_path), mode="r")
    attrs = dict(group.attrs)
    offsets = group["sample_offsets"][:]
    n = len(frame)
    picks = sorted({0, n // 2, n - 1})
    frob_all, peak_all = [], []
    for i in picks:
        ids = torch.from_numpy(frame["input_ids"][i].astype(np.int64))[None].to(device)
        with (reference_kernels or contextlib.nullcontext)():
            hidden = model.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        reference = torch.stack([hidden[x + 1][0] for x in layer_ids], dim=1).float().cpu()
        del hidden
        got = read_shard_features(group, slice(int(offsets[i]), int(offsets[i + 1])), attrs)
        frob, peak = relative_errors(got, reference)
        frob_all.append(frob)
        peak_all.append(peak)
    frob = np.max(frob_all, axis=0).tolist()
    row = dict(samples=picks, lengths=[int(frame["num_tokens"][i]) for i in picks], rel_frobenius_per_layer=frob,
               rel_max_per_layer=np.max(peak_all, axis=0).tolist())
    if next(model.parameters()).dtype != torch.float32:
        # Measured on the H200 (benchmarks/journal/2026-11-29.md): in bf16 a batch of one rounds differently from the pipeline's
        # batches, and on 61 random-weight layers that grows to 5-10 %: reported, not a pass/fail check. The
        # stored rows == fresh capture check above and the fp32 tests are the correctness checks.
        return {**row, "ok": None, "note": "bf16 forward: batch-shape rounding, reported only"}
    limit = {"float32": 1e-4, "bfloat16": 1e-2}.get(store_dtype, 0.06)  # the store's rounding (fp8: its bound)
    return {**row, "limit": limit, "ok": bool(max(frob) <= limit)}


def check_stats(meta) -> dict:
    stats = meta["stats"]
    ok = not any(stats["nonfinite"]) and not any(stats["zero_tokens"])
    return dict(ok=ok, nonfinite=stats["nonfinite"], zero_tokens=stats["zero_tokens"],
                rms=[round(x, 4) for x in stats["rms"]], absmax=[round(x, 2) for x in stats["absmax"]])


@torch.no_grad()
def check_fla_kernels(model, kernels, device, limit: float = 2e-2) -> dict:
    """Each FLA kernel swapped in alone against the PyTorch code it replaces, on random inputs: relative max
    error, or the error it raised. A kernel that fails or exceeds ``limit`` is left out of the '+fla' passes."""
    import importlib

    from dflash_pipeline.extract import use_fla_kernels

    gdn = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    norm = next((m for m in model.modules() if type(m).__name__ in ("Qwen3_5RMSNorm", "Qwen3NextRMSNorm")), None)
    g = torch.Generator(device=device).manual_seed(0)
    inputs = {}
    if gdn is not None:
        modeling = importlib.import_module(type(gdn).__module__)
        wdtype = gdn.conv1d.weight.dtype
        x = torch.randn(2, 600, gdn.conv_dim, device=device, dtype=wdtype, generator=g)
        inputs["conv1d"] = lambda: modeling.causal_conv1d_fn(x.transpose(1, 2), gdn.conv1d.weight.squeeze(1), None,
                                                             activation=gdn.activation).transpose(1, 2)
        h = torch.randn(1200, gdn.head_v_dim, device=device, dtype=wdtype, generator=g)
        z = torch.randn(1200, gdn.head_v_dim, device=device, dtype=wdtype, generator=g)
        inputs["gated_norm"] = lambda: gdn.norm(h, z)
    if norm is not None:
        r = 3 * torch.randn(2, 600, norm.weight.numel(), device=device, dtype=norm.weight.dtype, generator=g)
        inputs["rms_norm"] = lambda: norm(r)
    result = {}
    for kernel in kernels:
        if kernel not in inputs:
            result[kernel] = {"ok": False, "error": "no such module in the model"}
            continue
        try:
            reference = inputs[kernel]().float()
            undo = use_fla_kernels(model, [kernel])
            try:
                swapped = inputs[kernel]().float()
            finally:
                undo.close()
            error = float((swapped - reference).abs().max() / reference.abs().max())
            result[kernel] = {"rel_max_err": error, "ok": error <= limit}
        except Exception as exc:  # noqa: BLE001
            result[kernel] = {"ok": False, "error": repr(exc)}
    return result


def bound_implementations() -> dict:
    """Which function transformers' qwen3_5 GDN calls: FLA / causal_conv1d package or the PyTorch reference."""
    import importlib

    modeling = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    found = {}
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(modeling, name)
        impl = None
        if fn.__closure__:
            cells = dict(zip(fn.__code__.co_freevars, fn.__closure__))
            if "implementation" in cells:
                impl = cells["implementation"].cell_contents
        found[name] = f"{impl.__module__}.{impl.__name__}" if impl is not None else f"patched/unknown ({fn.__module__})"
    return found


def kernel_profile(model, batch_ids, device, layer_ids, top=25) -> str:
    """CUDA kernel time of one pipeline-shaped batch (capture up to the last layer), top kernels."""
    from torch.profiler import ProfilerActivity, profile

    from dflash_pipeline.extract import LayerCapture

    capture = LayerCapture(model, layer_ids)
    ids = to_device(batch_ids, device)
    capture.layer_outputs(ids)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        capture.layer_outputs(ids)
        sync(device)
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70)


def host_caps(bytes_per_token: float, megabytes: int = 64, directory=None) -> dict:
    """Single-core rates of the writer's CPU work on bf16-like data, and the token rate each one caps
    (the digest is one sequential thread; CRC and zstd run per chunk, zstd on ``io_threads`` threads)."""
    import hashlib

    import crc32c
    import numcodecs
    from numcodecs import blosc

    data = (torch.randn(megabytes << 19) * torch.rand(megabytes << 19).pow(4) * 4).to(torch.bfloat16)
    data = data.view(torch.uint16).numpy()
    rates = {}
    started = time.perf_counter()
    hashlib.blake2b(data, digest_size=16)
    rates["blake2b"] = data.nbytes / (time.perf_counter() - started)
    started = time.perf_counter()
    crc32c.crc32c(data)
    rates["crc32c"] = data.nbytes / (time.perf_counter() - started)
    blosc.use_threads = False  # as in zarr's worker threads: one core per chunk
    codec = numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE)
    chunk = 256 * 5 * 576  # one chunk of a 256-token store row block
    started = time.perf_counter()
    packed = sum(len(codec.encode(data[i : i + chunk])) for i in range(0, len(data) // 4, chunk))
    rates["zstd3_shuffle_1core"] = (data.nbytes // 4) / (time.perf_counter() - started)
    blosc.use_threads = None
    if directory is not None:  # the disk under --out: 512 MB written and fsynced (the shard's final flush)
        probe = Path(directory) / "disk_probe.bin"
        block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
        started = time.perf_counter()
        with open(probe, "wb") as handle:
            for _ in range(8):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        rates["disk_write_fsync"] = 8 * len(block) / (time.perf_counter() - started)
        probe.unlink()
    out = {k: f"{v / 1e6:,.0f} MB/s = {v / bytes_per_token:,.0f} tok/s" for k, v in rates.items()}
    out["zstd3_ratio_synthetic"] = round((data.nbytes // 4) / packed, 3)
    out["cpus"] = os.cpu_count()
    return out


# ---------------------------------------------------------------- codecs on a real store


def codec_report(store_path: str, chunk_tokens: int = 256) -> str:
    """Compression ratios (blosc zstd, level 3, 256-token chunks as the store writes them) and fp8
    reconstruction errors per layer on the features of a merged store."""
    import numcodecs

    from dflash_pipeline.store import HiddenStateStore, dequantize_fp8, fp8_error_bound, quantize_fp8

    store = HiddenStateStore(store_path)
    features = torch.cat([store[i][2] for i in range(len(store))]).float()
    tokens, k, d = features.shape
    lines = [f"store {store_path}: {len(store)} samples, {tokens} tokens, K={k}, D={d}, "
             f"layers {store.attrs['layer_ids']}, stored as {store.logical_dtype}"]

    def ratio(array: np.ndarray, shuffle) -> float:
        codec = numcodecs.Blosc(cname="zstd", clevel=3, shuffle=shuffle)
        raw = packed = 0
        for start in range(0, len(array), chunk_tokens):
            block = np.ascontiguousarray(array[start : start + chunk_tokens])
            raw += block.nbytes
            packed += len(codec.encode(block))
        return raw / packed

    bf16 = features.to(torch.bfloat16)
    q, scales = quantize_fp8(bf16)
    arrays = {"float32": features.numpy(), "bfloat16": bf16.view(torch.uint16).numpy(), "fp8 values": q.numpy(),
              "fp8 scales (f32)": scales.numpy()}
    lines.append("codec ratios (raw bytes / blosc-zstd-3 bytes):")
    for name, array in arrays.items():
        lines.append(f"  {name:18s} byte-shuffle {ratio(array, numcodecs.Blosc.SHUFFLE):.3f}  "
                     f"no-shuffle {ratio(array, numcodecs.Blosc.NOSHUFFLE):.3f}  "
                     f"bit-shuffle {ratio(array, numcodecs.Blosc.BITSHUFFLE):.3f}")
    bf16_bytes = 2 * k * d / ratio(arrays["bfloat16"], numcodecs.Blosc.SHUFFLE)
    fp8_bytes = k * d / ratio(arrays["fp8 values"], numcodecs.Blosc.SHUFFLE) + 4 * k / ratio(
        arrays["fp8 scales (f32)"], numcodecs.Blosc.SHUFFLE)
    lines.append(f"  stored bytes/token: float32 {4 * k * d / ratio(arrays['float32'], numcodecs.Blosc.SHUFFLE):.0f}, "
                 f"bfloat16 {bf16_bytes:.0f}, fp8+scales {fp8_bytes:.0f} (raw bf16 {2 * k * d})")
    x = bf16.float()
    back = dequantize_fp8(q, scales)
    back_bf16 = dequantize_fp8(q, scales, torch.bfloat16).float()
    within = bool(((x - back).abs() <= fp8_error_bound(x, scales)).all())
    lines.append(f"fp8 e4m3 per-token per-layer scale, error vs the bf16 features (bound |e| <= 2^-4|x| + 2^-10 s "
                 f"holds on every element: {within}):")
    lines.append("  layer   ||x-x^||/||x|| (f32 out)  (bf16 out)   max|x-x^|/max|x|   flushed-to-0   bf16-vs-f32 ||.||")
    for j, layer in enumerate(store.attrs["layer_ids"]):
        a, b, c = x[:, j], back[:, j], back_bf16[:, j]
        rel = float((a - b).norm() / a.norm())
        rel16 = float((a - c).norm() / a.norm())
        peak = float((a - b).abs().max() / a.abs().max())
        flushed = float(((b == 0) & (a != 0)).float().mean())
        bf = float((features[:, j] - a).norm() / features[:, j].norm())
        lines.append(f"  {layer:5d}   {rel:.5f}                  {rel16:.5f}      {peak:.5f}            "
                     f"{flushed:.2e}       {bf:.2e}")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    if args.codecs:
        print(codec_report(args.codecs, args.chunk_tokens))
        return 0

    import transformers

    from dflash_pipeline.extract import extract_shard, length_batches, real_token_share
    from dflash_pipeline.store import store_codec
    from dflash_pipeline.target import default_target_layer_ids

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    report_dir = Path(args.report) if args.report else None
    kernels = [k for k in args.kernels.split(",") if k]
    fla_ok = False
    if device.type == "cuda" and kernels:
        try:
            import importlib

            importlib.import_module("fla")
            fla_ok = True
        except Exception as error:  # noqa: BLE001
            log(f"flash-linear-attention not importable ({error!r}): no '+fla' passes")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": vars(args),
               "machine": {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__,
                           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()},
               "passes": {}, "checks": {}, "errors": []}
    try:
        import importlib.metadata as md

        results["machine"]["fla"] = md.version("flash-linear-attention")
    except Exception:  # noqa: BLE001
        results["machine"]["fla"] = "not installed"
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()] if Path("/proc/mounts").exists() else []
    where = max((m for m in mounts if str(out.resolve()).startswith(m[1])), key=lambda m: len(m[1]), default=None)
    results["machine"]["out_filesystem"] = f"{where[1]} ({where[2]})" if where else "unknown"
    log("machine:", results["machine"])

    layer_count = len([int(x) for x in args.layer_ids.split(",")]) if args.layer_ids else 5
    raw_bytes = layer_count * args.hidden * {"bfloat16": 2, "float32": 4, "fp8_e4m3": 1}[args.store_dtype]
    results["host_caps"] = host_caps(raw_bytes, directory=out)
    log(f"host CPU rates for {raw_bytes} raw feature bytes/token:", results["host_caps"])
    model = build_model(args, device, dtype)
    results["machine"]["attn_implementation"] = model.config._attn_implementation
    results["kernels_bound_by_transformers"] = bound_implementations()
    log("transformers' GDN kernels:", results["kernels_bound_by_transformers"])
    layer_ids = ([int(x) for x in args.layer_ids.split(",")] if args.layer_ids
                 else sorted(set(default_target_layer_ids(args.layers, 5))))
    lengths = length_mix(args)
    samples = make_samples(args, lengths)
    frame = write_tokenized(out / "tokens.parquet", samples)
    sorted_lengths = frame["num_tokens"].to_numpy()
    batches = length_batches(sorted_lengths, args.tokens_per_batch)
    share = real_token_share(sorted_lengths, batches)
    naive = [padded(samples[i : i + args.naive_batch]) for i in range(0, len(samples), args.naive_batch)]
    bucket_batches = [padded(list(frame["input_ids"][s:e]), sorted_lengths[s:e]) for s, e in batches]
    naive_share = sum(int(m.sum()) for _, m in naive) / sum(i.size for i, _ in naive)
    results["data"] = dict(samples=len(lengths), real_tokens=int(lengths.sum()), median_length=float(np.median(lengths)),
                           at_max_length=float(np.mean(lengths == args.max_length)), layer_ids=layer_ids,
                           bucket_batches=len(batches), bucket_real_share=share, naive_batches=len(naive),
                           naive_real_share=naive_share)
    log("data:", results["data"])
    full_ref = args.tokens_per_batch // args.max_length
    reference = [(np.random.default_rng(7).integers(0, args.vocab, (full_ref, args.max_length)),
                  np.ones((full_ref, args.max_length), np.int64))] * max(1, min(4, args.tokens // args.tokens_per_batch))

    bucket_shapes = [(e - s, int(sorted_lengths[e - 1])) for s, e in batches]
    naive_shapes = [(ids.shape[0], ids.shape[1]) for ids, _ in naive]
    pipeline_pass_s = [None]

    def pipeline(name, store_dtype, *, check=False, reference_kernels=None):
        shard = out / f"{name.replace(' ', '_').replace('+', '')}.zarr"
        sync(device)
        reset_peak(device)
        started = time.perf_counter()
        meta = extract_shard(out / "tokens.parquet", model, shard, layer_ids=layer_ids,
                             codec=store_codec(store_dtype, dtype_name),
                             tokens_per_batch=args.tokens_per_batch, chunk_tokens=args.chunk_tokens,
                             compression=args.compression, attrs={"shard": 0}, io_threads=args.io_threads)
        profile = meta["timing"]  # extract_shard's clock (extract/timing.py)
        sync(device)
        seconds = time.perf_counter() - started
        pipeline_pass_s[0] = seconds
        stored = dir_bytes(shard)
        row = dict(seconds=seconds, real_tokens=int(lengths.sum()), computed_tokens=profile["padded_tokens"],
                   peak_gib=peak_gib(device), stored_bytes=stored, store_dtype=store_dtype, profile=profile)
        results["passes"][name] = row
        log(f"{name}: {row['real_tokens'] / seconds:,.0f} real tok/s, {stored / row['real_tokens']:.0f} B/token; "
            f"profile {({k: round(v, 3) if isinstance(v, float) else v for k, v in profile.items()})}")
        results["checks"][f"{name}: stats finite, no zero vectors"] = check_stats(meta)
        if check:
            results["checks"][f"{name}: stored rows == fresh capture of the batch"] = check_chain_exact(
                model, frame, shard, layer_ids, batches, device, args.tokens_per_batch)
            label = "transformers' kernels" if reference_kernels else "same kernels"
            results["checks"][f"{name}: vs output_hidden_states[x+1] ({label})"] = check_against_hidden_states(
                model, frame, shard, layer_ids, device, store_dtype, reference_kernels)
            for key in list(results["checks"])[-2:]:
                log(key, results["checks"][key])
        shutil.rmtree(shard, ignore_errors=True)
        return row

    def bare(name, batch_list, use_mask=True):
        row = bare_pass(model, batch_list, device, use_mask)
        results["passes"][name] = row
        log(f"{name}: {row['real_tokens'] / row['seconds']:,.0f} real tok/s "
            f"({row['computed_tokens'] / row['seconds']:,.0f} computed tok/s)")
        return row

    def optional(name, estimate_s, fn):
        if name in args.skip:
            log(f"skipped {name} (--skip)")
            return
        elapsed = time.perf_counter() - STARTED
        if estimate_s is not None and elapsed + estimate_s > args.budget_s:
            log(f"skipped {name}: {elapsed:.0f} s + ~{estimate_s:.0f} s would pass --budget-s {args.budget_s:.0f}")
            results["errors"].append(f"skipped {name} (time budget)")
            return
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - report and go on; the table says what ran
            log(f"{name} FAILED: {error!r}")
            traceback.print_exc()
            results["errors"].append(f"{name}: {error!r}")
        write_report(results, device, report_dir)  # a call killed at its time limit still brings back what ran

    try:
        run_passes(model, args, device, results, optional, bare, pipeline, pipeline_pass_s, kernels, fla_ok,
                   bucket_shapes, naive_shapes, sorted_lengths, full_ref, reference, naive, bucket_batches,
                   layer_ids)
    except Exception as error:  # noqa: BLE001 - whatever ran is still reported
        log(f"run FAILED: {error!r}")
        traceback.print_exc()
        results["errors"].append(f"run: {error!r}")

    if "kernel_profile" in results:
        print(results["kernel_profile"])
    print(write_report(results, device, report_dir), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    failed = [k for k, v in results["checks"].items() if isinstance(v, dict) and v.get("ok") is False]
    return 1 if failed or not any(k.startswith("pipeline") for k in results["passes"]) else 0


def write_report(results, device, report_dir: Path | None) -> str:
    """The table of what has run so far; written with the JSON of all numbers to ``report_dir`` if given."""
    text = render(results, device)
    if report_dir is not None:
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / "extract_speed.txt").write_text(text + "\n")
        (report_dir / "extract_speed.json").write_text(json.dumps(results, indent=1, default=str))
        if "kernel_profile" in results:
            (report_dir / "kernel_profile.txt").write_text(results["kernel_profile"])
    return text


def run_passes(model, args, device, results, optional, bare, pipeline, pipeline_pass_s, kernels, fla_ok,
               bucket_shapes, naive_shapes, sorted_lengths, full_ref, reference, naive, bucket_batches, layer_ids):
    """The timed passes, in order; optional ones are skipped past the time budget."""
    from dflash_pipeline.extract import use_fla_kernels

    # ---- default kernels
    log("warm-up (default kernels): first-layer-block pass over", len(set(bucket_shapes)), "bucket shapes")
    default_bucket_passes = {"bare buckets", "pipeline", "pipeline +mask"} - args.skip  # warm only what runs
    results["warmup_s"] = {"default": warmup(model, (bucket_shapes if default_bucket_passes else [])
                                             + [(1, int(sorted_lengths[-1]))], device)
                           + warmup(model, ([] if "bare naive" in args.skip else naive_shapes)
                                    + [(full_ref, args.max_length)], device, use_mask=True)}
    log(f"warm-up done in {results['warmup_s']['default']:.1f} s")
    optional("bare 8x2048", None, lambda: bare(f"bare {full_ref}x{args.max_length}", reference, use_mask=False))
    optional("bare naive", None, lambda: bare("bare naive", naive))
    optional("bare buckets", None, lambda: bare("bare buckets", bucket_batches))
    optional("pipeline", None, lambda: pipeline("pipeline", args.store_dtype, check=True))

    # ---- FLA kernels
    if fla_ok and time.perf_counter() - STARTED + args.fla_warmup_estimate_s > args.budget_s:
        log(f"skipped the +fla passes: their warm-up (~{args.fla_warmup_estimate_s:.0f} s) would pass --budget-s")
        results["errors"].append("skipped the +fla passes (time budget)")
        fla_ok = False
    if fla_ok:
        try:
            checked = check_fla_kernels(model, kernels, device)
            results["checks"]["FLA kernels vs PyTorch"] = {"ok": True, **checked}  # failures drop the kernel only
            log("FLA kernels vs PyTorch:", checked)
            kernels = [k for k in kernels if checked[k]["ok"]]
            if not kernels:
                raise RuntimeError(f"no FLA kernel passed its check: {checked}")
            results["fla_kernels_used"] = kernels
            swaps = {"undo": use_fla_kernels(model, kernels)}

            @contextlib.contextmanager
            def transformers_kernels():  # the reference of the correctness checks: the kernels transformers picks
                swaps["undo"].close()
                try:
                    yield
                finally:
                    swaps["undo"] = use_fla_kernels(model, kernels)

            try:
                results["kernels_with_swaps"] = bound_implementations()
                results["warmup_s"]["fla"] = warmup(model, bucket_shapes + [(1, int(sorted_lengths[-1]))], device)
                log(f"warm-up (+fla) done in {results['warmup_s']['fla']:.1f} s")
                optional("pipeline +fla", None, lambda: pipeline("pipeline +fla", args.store_dtype, check=True,
                                                                 reference_kernels=transformers_kernels))
                est = pipeline_pass_s[0]
                other = "fp8_e4m3" if args.store_dtype != "fp8_e4m3" else "bfloat16"
                optional(f"pipeline +fla {other}", est, lambda: pipeline(f"pipeline +fla {other}", other, check=True,
                                                                         reference_kernels=transformers_kernels))
                optional("profile", 15, lambda: results.__setitem__("kernel_profile", kernel_profile(
                    model, bucket_batches[len(bucket_batches) // 2][0], device, layer_ids)))
                optional("bare buckets +fla", est, lambda: bare("bare buckets +fla", bucket_batches))
            finally:
                swaps["undo"].close()
        except Exception as error:  # noqa: BLE001
            log(f"FLA passes FAILED: {error!r}")
            traceback.print_exc()
            results["errors"].append(f"FLA passes: {error!r}")
    else:
        optional("profile", 20, lambda: results.__setitem__("kernel_profile", kernel_profile(
            model, bucket_batches[len(bucket_batches) // 2][0], device, layer_ids)))


def render(results, device) -> str:
    passes = results["passes"]
    rate = {k: v["real_tokens"] / v["seconds"] for k, v in passes.items()}
    naive, buckets = rate.get("bare naive"), rate.get("bare buckets")
    lines = ["", "=" * 112,
             f"extract_speed  {results['date']}  {results['machine']['device']}  torch {results['machine']['torch']}  "
             f"transformers {results['machine']['transformers']}  fla {results['machine']['fla']}",
             f"command: {results['command']}",
             f"data: {results['data']['samples']} samples, {results['data']['real_tokens']} real tokens, layers "
             f"{results['data']['layer_ids']}; buckets {results['data']['bucket_batches']} "
             f"({100 * results['data']['bucket_real_share']:.2f} % real), naive {results['data']['naive_batches']} "
             f"({100 * results['data']['naive_real_share']:.2f} % real)",
             f"out: {results['machine'].get('out_filesystem')}",
             f"{'pass':26s} {'real tok/s':>10s} {'x naive':>7s} {'x bucket':>8s} {'real %':>6s} {'B/token':>7s} "
             f"{'peak GiB':>8s} {'seconds':>7s} {'fsync s':>7s} {'tok/s w/o fsync':>15s}", "-" * 112]
    for name, row in passes.items():
        real_pct = 100 * row["real_tokens"] / max(row["computed_tokens"], 1)
        stored = f"{row['stored_bytes'] / row['real_tokens']:.0f}" if "stored_bytes" in row else "-"
        fsync = row.get("profile", {}).get("fsync_rename_s")
        no_sync = f"{row['real_tokens'] / (row['seconds'] - fsync):,.0f}" if fsync is not None else "-"
        lines.append(f"{name:26s} {rate[name]:10,.0f} {rate[name] / naive if naive else float('nan'):7.3f} "
                     f"{rate[name] / buckets if buckets else float('nan'):8.3f} {real_pct:6.2f} {stored:>7s} "
                     f"{row['peak_gib']:8.1f} {row['seconds']:7.1f} {'-' if fsync is None else f'{fsync:.1f}':>7s} "
                     f"{no_sync:>15s}")
    lines.append("-" * 112)
    full = next((k for k in passes if k.startswith("bare ") and "x" in k.split()[1]), None)  # e.g. "bare 8x2048"
    for name in (k for k in passes if k.startswith("pipeline")):
        ok = naive and rate[name] >= 1.2 * naive and rate[name] >= 11000
        versus_full = f", {rate[name] / rate[full]:.2f} x {full}" if full else ""
        lines.append(f"goal (>= 1.2 x bare naive and >= 11,000 real tok/s, fsync counted): {name}: "
                     f"{'MET' if ok else 'not met'} ({rate[name]:,.0f} tok/s, "
                     f"{rate[name] / naive if naive else float('nan'):.2f} x bare naive{versus_full})")
    for key, value in results["checks"].items():
        lines.append(f"check {key}: {json.dumps(value, default=str)}")
    lines.append(f"warm-up s: {results.get('warmup_s')}; kernels bound: {results.get('kernels_bound_by_transformers')}"
                 f"; attention: {results['machine'].get('attn_implementation')}")
    lines.append(f"host caps (single core): {results.get('host_caps')}; FLA kernels in '+fla' passes: "
                 f"{results.get('fla_kernels_used', 'none')}")
    for name, row in passes.items():
        if "profile" in row:
            lines.append(f"profile {name}: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row["profile"].items()))
    if results["errors"]:
        lines.append(f"errors/skips: {results['errors']}")
    lines.append("=" * 112)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
