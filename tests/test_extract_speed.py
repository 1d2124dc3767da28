"""Extraction at GPU speed (issue #6), the CPU-checkable parts: length bucketing, the overlapped
capture -> encode -> writer-thread path, the lossless and fp8 codecs, and writer-failure handling.

"Relative error" is per captured layer: max |a - b| over tokens and channels divided by max |b|.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
import zarr

import dflash_pipeline.extract as extract_module
from dflash_pipeline.extract import LayerCapture, extract_shard, length_batches, real_token_share
from dflash_pipeline.store import (
    HiddenStateStore,
    ShardWriter,
    StoreError,
    dequantize_fp8,
    fp8_error_bound,
    merge_shards,
    quantize_fp8,
    read_shard_features,
    store_codec,
)

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [3, 5, 9, 17, 33, 40, 41, 64, 70, 100, 131, 150]  # sorted; several batches, padding in most


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    dims = tuple(d for d in range(a.dim()) if d != a.dim() - 2)
    return ((a.float() - b.float()).abs().amax(dims) / b.float().abs().amax(dims)).max().item()


def schema_default(key: str):
    schema = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())
    return schema["properties"]["extract"]["properties"][key]["default"]


def sharegpt_like_lengths(n: int, max_length: int, seed: int = 0) -> np.ndarray:
    """Log-normal token counts fitted to the default data's ShareGPT conversations (log-mean 7.2,
    log-sd 0.97, i.e. median ~1300 tokens, half of them over 2048), clipped to [16, max_length]."""
    rng = np.random.default_rng(seed)
    return np.sort(np.clip(np.round(np.exp(rng.normal(7.2, 0.97, n))), 16, max_length).astype(np.int64))


@pytest.mark.parametrize("max_length", [2048, 3072])
@pytest.mark.parametrize("num_samples", [1000, 1400])
def test_bucketing_computes_at_least_98_percent_real_tokens_on_a_sharegpt_like_mix(max_length, num_samples):
    tokens_per_batch = schema_default("tokens_per_batch")
    lengths = sharegpt_like_lengths(num_samples, max_length, seed=num_samples)
    batches = length_batches(lengths, tokens_per_batch)
    assert [i for s, e in batches for i in range(s, e)] == list(range(num_samples))
    assert all((e - s) * lengths[e - 1] <= tokens_per_batch or e - s == 1 for s, e in batches)
    share = real_token_share(lengths, batches)
    print(f"max_length {max_length}, {num_samples} samples: {100 * share:.2f} % real tokens in {len(batches)} batches")
    assert share >= 0.98
    # Batches stay large (the per-call overhead term keeps the GPU busy): most carry >= half the budget.
    sizes = np.array([(e - s) * lengths[e - 1] for s, e in batches])
    assert np.median(sizes) >= tokens_per_batch / 2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def write_tokenized(path: Path, lengths, vocab: int, seed: int = 0) -> pd.DataFrame:
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=generator).numpy().astype(np.int32) for n in lengths]
    masks = [(np.arange(n) % 3 != 0).astype(np.uint8) for n in lengths]
    frame = pd.DataFrame({"id": [f"s{i}" for i in range(len(lengths))], "num_tokens": list(lengths),
                          "input_ids": ids, "loss_mask": masks})
    frame.to_parquet(path, index=False)
    return frame


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def _per_sample(model, layer_ids, frame) -> list[torch.Tensor]:
    capture = LayerCapture(model, layer_ids)
    return [capture(torch.from_numpy(ids.astype(np.int64))[None])[0] for ids in frame["input_ids"]]


def _extract(model, frame_path, out, layer_ids, store_dtype="float32", **kwargs):
    settings = dict(tokens_per_batch=400, chunk_tokens=64, compression="zstd", io_threads=2)
    settings.update(kwargs)
    meta = extract_shard(frame_path, model, out, layer_ids=layer_ids, codec=store_codec(store_dtype, "float32"),
                         attrs={"shard": 0}, **settings)
    return meta, meta["timing"]


@pytest.mark.parametrize("target", ["llama", "qwen3_5_text_dir"])
def test_overlapped_bucketed_extract_equals_per_sample_capture(target, tmp_path, request):
    if target == "llama":
        model, layer_ids = request.getfixturevalue("llama"), [0, 1, 2]
    else:
        from dflash_pipeline.target import load_target

        model, layer_ids = load_target(str(request.getfixturevalue(target))), [0, 2, 3, 5, 6]  # GDN + full attention
    vocab = model.config.get_text_config().vocab_size
    frame = write_tokenized(tmp_path / "tok.parquet", LENGTHS, vocab)
    meta, profile = _extract(model, tmp_path / "tok.parquet", tmp_path / "shard.zarr", layer_ids)
    assert profile["batches"] >= 3 and profile["real_token_share"] < 1  # padded batches, several writer hand-overs
    assert profile["real_tokens"] == sum(LENGTHS) and profile["padded_tokens"] > sum(LENGTHS)
    assert profile["seconds"] >= profile["forward_call_s"] + profile["drain_s"] + profile["close_s"] > 0
    assert meta["num_tokens"] == sum(LENGTHS) and not any(meta["stats"]["nonfinite"])
    group = zarr.open_group(str(tmp_path / "shard.zarr"), mode="r")
    offsets = group["sample_offsets"][:]
    for i, expected in enumerate(_per_sample(model, layer_ids, frame)):
        got = read_shard_features(group, slice(int(offsets[i]), int(offsets[i + 1])))
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert relative_error(got, expected) <= 1e-5, i
    # The statistics counted on the device equal those of ShardWriter.write on the same rows.
    reference = ShardWriter(tmp_path / "ref.zarr", num_tokens=sum(LENGTHS), num_layers=len(layer_ids),
                            hidden_size=model.config.get_text_config().hidden_size, codec=store_codec("float32", "float32"),
                            chunk_tokens=64)
    reference.write(read_shard_features(group, slice(0, sum(LENGTHS))))
    ref_meta = reference.close(np.concatenate(list(frame["input_ids"])), np.concatenate(list(frame["loss_mask"])),
                               LENGTHS, list(frame["id"]), {})
    assert ref_meta["features_digest"] == meta["features_digest"]
    assert ref_meta["stats"]["absmax"] == meta["stats"]["absmax"]
    np.testing.assert_allclose(ref_meta["stats"]["rms"], meta["stats"]["rms"], rtol=1e-6)


def test_attention_mask_is_not_needed_for_right_padded_batches(llama):
    """The pipeline runs padded batches without a mask; real tokens match the masked run exactly enough."""
    capture = LayerCapture(llama, [0, 3])
    ids = torch.randint(0, 1000, (3, 50), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([50, 31, 7])
    mask = (torch.arange(50)[None] < lengths[:, None]).long()
    free, masked = capture(ids), capture(ids, mask)
    for row, n in enumerate(lengths.tolist()):
        assert relative_error(free[row, :n], masked[row, :n]) <= 1e-5


def random_features(n: int, k: int, d: int, seed: int = 0) -> torch.Tensor:
    """Residual-stream-like features: unit noise, a few huge outlier channels, some tiny values, and an
    all-zero token vector (its scale falls back to 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, d, generator=g)
    x[..., 3] *= 300.0  # outlier channel
    x[: n // 4] *= 1e-3
    x[5, 1, : d // 2] = 1e-7 * torch.randn(d // 2, generator=g)  # flushes to zero next to the outlier
    x[7, 2] = 0.0
    return x


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lossless_codecs_round_trip_exactly(tmp_path, dtype):
    k, d = 3, 40
    pieces = [1, 63, 64, 65, 130, 7]  # straddling the chunk boundaries of 64 rows
    x = random_features(sum(pieces), k, d).to(getattr(torch, dtype))
    x[2, 0, 0], x[3, 1, 1] = float("inf"), float("nan")  # lossless means bit-exact, special values too
    writer = ShardWriter(tmp_path / "s.zarr", num_tokens=len(x), num_layers=k, hidden_size=d,
                         codec=store_codec(dtype, "float32"), chunk_tokens=64)
    start = 0
    for i, n in enumerate(pieces):  # both ways in: write() and the pre-encoded path the pipeline uses
        part = x[start : start + n]
        if i % 2:
            writer.write(part)
        else:
            rows, stats = writer.codec.encode(part)
            writer.add_stats(stats)
            writer.write_encoded({name: values.numpy() for name, values in rows.items()})
        start += n
    writer.close(np.zeros(len(x), np.int32), np.ones(len(x), np.uint8), [len(x)], ["a"], {"layer_ids": [0, 1, 2]})
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="r")
    got = read_shard_features(group, slice(0, len(x)))
    assert got.dtype == x.dtype
    view = torch.int32 if dtype == "float32" else torch.int16
    assert torch.equal(got.view(view), x.view(view))
    assert group.attrs["stats"]["nonfinite"] == [1, 1, 0]


def test_fp8_round_trips_within_its_documented_bound(tmp_path):
    k, d = 3, 48
    x = random_features(300, k, d, seed=1)
    q, s = quantize_fp8(x)
    assert q.dtype == torch.uint8 and s.shape == (300, k) and s.dtype == torch.float32
    back = dequantize_fp8(q, s)
    error, bound = (x - back).abs(), fp8_error_bound(x, s)
    assert bool((error <= bound).all())
    assert (error / bound).max() > 0.5  # the bound is nearly attained: not a vacuous check
    assert torch.equal(back[7, 2], torch.zeros(d)) and s[7, 2] == 1  # all-zero vector
    peak = x.abs().argmax(dim=-1, keepdim=True)  # each vector's largest element maps to +-448: float32-exact
    torch.testing.assert_close(back.gather(-1, peak), x.gather(-1, peak), rtol=2.0**-22, atol=0)
    flushed = x.abs() <= 2.0**-10 * s.unsqueeze(-1)
    assert flushed.any() and bool((back[flushed] == 0).all())

    # Through a shard, a merge and the reader: transparent dequantisation, the mode in the manifest.
    x[7, 2] = 0.5  # the merge refuses all-zero token vectors
    bound = fp8_error_bound(x, quantize_fp8(x)[1])
    for dequantized in ("float32", "bfloat16"):
        path = tmp_path / f"{dequantized}.zarr"
        writer = ShardWriter(path, num_tokens=300, num_layers=k, hidden_size=d,
                             codec=store_codec("fp8_e4m3", dequantized), chunk_tokens=64)
        writer.write(x[:100])
        writer.write(x[100:])
        meta = writer.close(np.zeros(300, np.int32), np.ones(300, np.uint8), [120, 180], ["a", "b"],
                            {"layer_ids": [0, 1, 2], "hidden_size": d})
        assert meta["logical_dtype"] == "float8_e4m3fn" and meta["feature_scale"]["array"] == "feature_scales"
        frame = pd.DataFrame({"id": ["a", "b"], "num_tokens": [120, 180],
                              "input_ids": [np.zeros(120, np.int32), np.zeros(180, np.int32)],
                              "loss_mask": [np.ones(120, np.uint8), np.ones(180, np.uint8)]})
        summary = merge_shards([path], [frame], tmp_path / f"store-{dequantized}.zarr", {"target": "x"})
        assert summary["logical_dtype"] == "float8_e4m3fn" and summary["dequantized_dtype"] == dequantized
        assert summary["feature_scale"]["value"].startswith("max over d")
        store = HiddenStateStore(tmp_path / f"store-{dequantized}.zarr")
        got = torch.cat([store[0][2], store[1][2]])
        assert got.dtype == getattr(torch, dequantized)
        extra = 0 if dequantized == "float32" else 2.0**-9 * got.float().abs()  # bf16 rounding of q*s
        assert bool(((x - got.float()).abs() <= bound + extra).all())
    # fp8 halves the bytes of bf16 (plus 4 bytes of scale per token and layer).
    assert zarr.open_group(str(tmp_path / "float32.zarr"), mode="r")["features"].dtype == np.uint8


def test_fp8_extract_is_within_the_bound_of_the_captured_features(llama, tmp_path):
    frame = write_tokenized(tmp_path / "tok.parquet", LENGTHS, 1000, seed=1)
    meta, _ = _extract(llama, tmp_path / "tok.parquet", tmp_path / "shard.zarr", [0, 2], store_dtype="fp8_e4m3")
    assert meta["logical_dtype"] == "float8_e4m3fn" and meta["dequantized_dtype"] == "float32"
    group = zarr.open_group(str(tmp_path / "shard.zarr"), mode="r")
    offsets = group["sample_offsets"][:]
    for i, expected in enumerate(_per_sample(llama, [0, 2], frame)):
        rows = slice(int(offsets[i]), int(offsets[i + 1]))
        got = read_shard_features(group, rows)
        scales = torch.from_numpy(group["feature_scales"][rows])
        # the pipeline's batched capture differs from the per-sample one by <= 1e-5 relative
        slack = 1e-5 * expected.abs().amax(dim=(0, 2), keepdim=True)
        assert bool(((got - expected).abs() <= fp8_error_bound(expected, scales) + 2 * slack).all()), i


def _writer_threads():
    return [t for t in threading.enumerate() if t.name == "extract-writer" and t.is_alive()]


def test_a_writer_thread_failure_propagates_and_leaves_no_shard(llama, tmp_path, monkeypatch):
    write_tokenized(tmp_path / "tok.parquet", LENGTHS, 1000)
    calls = []
    original = ShardWriter.write_encoded

    def failing(self, rows):
        calls.append(len(rows["features"]))
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return original(self, rows)

    monkeypatch.setattr(ShardWriter, "write_encoded", failing)
    with pytest.raises(StoreError, match="writer thread failed.*disk full") as error:
        _extract(llama, tmp_path / "tok.parquet", tmp_path / "shard.zarr", [0, 2])
    assert isinstance(error.value.__cause__, OSError)
    assert not (tmp_path / "shard.zarr").exists() and not (tmp_path / "shard.zarr.tmp").exists()
    assert not _writer_threads()


def test_a_forward_failure_stops_the_writer_and_leaves_no_shard(llama, tmp_path, monkeypatch):
    write_tokenized(tmp_path / "tok.parquet", LENGTHS, 1000)
    calls = []
    original = LayerCapture.layer_outputs

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("CUDA error (simulated)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LayerCapture, "layer_outputs", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        _extract(llama, tmp_path / "tok.parquet", tmp_path / "shard.zarr", [0, 2])
    assert not (tmp_path / "shard.zarr").exists() and not (tmp_path / "shard.zarr.tmp").exists()
    assert not _writer_threads()


def test_config_accepts_the_new_extract_keys():
    from snakemake.utils import validate

    config = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    config["extract"].update(store_dtype="fp8_e4m3", io_threads=4, fla_kernels=["conv1d", "gated_norm"])
    validate(config, str(ROOT / "config" / "schema.yaml"))
    config["extract"]["fla_kernels"] = ["no_such_kernel"]
    with pytest.raises(Exception):
        validate(config, str(ROOT / "config" / "schema.yaml"))


def test_fla_kernels_refuse_a_cpu_target(llama):
    with pytest.raises(RuntimeError, match="CUDA"):
        extract_module.use_fla_kernels(llama, ["conv1d"])
    with pytest.raises(ValueError, match="unknown FLA kernels"):
        extract_module.use_fla_kernels(llama, ["warp_drive"])
