"""The drafter's architecture keys and the exported config.json as serving engines read it (issue #35).

- The Qwen3.6-27B example (config/examples/qwen3.6-27b.yaml) exports, built on the meta device, the published
  ``z-lab/Qwen3.6-27B-DFlash`` config field for field; the fields that differ are the listed ones, each for a reason.
- Every field vLLM's ``qwen3_dflash`` and SGLang's ``dflash`` read resolves, per layer, to the attention the drafter
  computes: sliding layers causal with the window (the query's own position included), full layers bidirectional
  over the block. The engines' rules are written out below from their sources (vLLM
  ``_resolve_layer_attention``/``_dflash_layer_causal``, SGLang ``_get_dflash_layer_attention_params``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from snakemake.utils import validate
from transformers import Qwen3Config

from dflash_pipeline.drafter import (DFlashDrafter, config_from_export_dict, dflash_config_from_target,
                                     export_config_dict)

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("serving_config_table",
                                              ROOT / "benchmarks" / "quality" / "serving_config_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)

# fields where the export differs from the published config, and why (docs/serving.md)
DIFFERENCES = {
    "auto_map": "points at remote code (dflash.DFlashDraftModel) this pipeline does not ship; engines ignore it",
    "transformers_version": "the exporting library's version, not written",
    "rope_parameters": "transformers 5's form of rope_theta/rope_scaling, written beside them",
    "dflash_config.use_swa": "vLLM: sliding layers present (never true over all-full layer_types)",
    "dflash_config.swa_window_size": "vLLM prefers it to sliding_window: the same value",
    "target_hidden_size": "vLLM: the width of the target features fc concatenates (= hidden_size)",
    "draft_vocab_size": "vLLM: no draft vocabulary of its own (= vocab_size)",
}


def test_the_27b_example_exports_the_published_config():
    ours = table.flatten(table.example_export())
    published = table.flatten(json.loads(table.PUBLISHED.read_text()))
    differ = {key for key in set(ours) | set(published)
              if key not in ours or key not in published or not _same(ours[key], published[key])}
    assert differ == set(DIFFERENCES), differ
    assert ours["rope_parameters"] == {"rope_type": "default", "rope_theta": published["rope_theta"]}
    # the published config read by this pipeline is the drafter the example builds
    theirs = config_from_export_dict(json.loads(table.PUBLISHED.read_text()))
    mine = config_from_export_dict(table.example_export())
    assert theirs.to_dict() == mine.to_dict()


# the DFlash2 example beside SpecForge's published configs/qwen3.6-27b-dflash2.json: fields the published one leaves out
DFLASH2_DIFFERENCES = {
    "transformers_version": DIFFERENCES["transformers_version"],
    "rope_theta": "the legacy form of rope_parameters, written beside it (the DFlash export's too)",
    "rope_scaling": "the legacy form of rope_parameters (none), written beside it",
    "dflash_config.use_swa": DIFFERENCES["dflash_config.use_swa"],
    "dflash_config.swa_window_size": DIFFERENCES["dflash_config.swa_window_size"],
    "dflash_config.causal": "vLLM: is_causal's value for every layer (the same)",
    "target_hidden_size": DIFFERENCES["target_hidden_size"],
    "draft_vocab_size": DIFFERENCES["draft_vocab_size"],
}
DFLASH2_EXAMPLE = ROOT / "config" / "examples" / "qwen3.6-27b-dflash2.yaml"
DFLASH2_PUBLISHED = ROOT / "tests" / "data" / "qwen3.6-27b-dflash2.published.json"


def test_the_27b_dflash2_example_exports_the_published_config():
    """config/examples/qwen3.6-27b.yaml + qwen3.6-27b-dflash2.yaml: DFlash2DraftModel with the published shapes, the
    conv and selector keys and block size in dflash_config, is_causal false; read back, the published config is the
    drafter the example builds."""
    exported = table.example_export([*table.CONFIGS, DFLASH2_EXAMPLE])
    ours, published = table.flatten(exported), table.flatten(json.loads(DFLASH2_PUBLISHED.read_text()))
    differ = {key for key in set(ours) | set(published)
              if key not in ours or key not in published or not _same(ours[key], published[key])}
    assert differ == set(DFLASH2_DIFFERENCES), differ
    assert exported["architectures"] == ["DFlash2DraftModel"] and "block_size" not in exported
    theirs = config_from_export_dict(json.loads(DFLASH2_PUBLISHED.read_text()))
    assert theirs.to_dict() == config_from_export_dict(exported).to_dict()
    assert theirs.architecture == "dflash2" and theirs.is_causal is False and theirs.block_size == 8


def _same(a, b) -> bool:
    return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))


def vllm_layers(config: dict) -> list[tuple[int | None, bool]]:
    """(sliding window, causal) per layer as vLLM's qwen3_dflash resolves them from config.json."""
    dflash, layer_types = config.get("dflash_config") or {}, config.get("layer_types")
    any_sliding = bool(layer_types) and "sliding_attention" in layer_types
    result = []
    for i in range(config["num_hidden_layers"]):
        if layer_types is None or (dflash.get("use_swa") and not any_sliding):
            sliding = bool(dflash.get("use_swa"))
        else:
            sliding = layer_types[i] == "sliding_attention"
        window = dflash.get("swa_window_size", config.get("sliding_window")) if sliding else None
        causal = config.get("is_causal")
        causal = dflash.get("causal") if causal is None else causal
        causal = bool(layer_types) and layer_types[i] == "sliding_attention" if causal is None else bool(causal)
        result.append((window, causal))
    return result


def sglang_layers(config: dict) -> list[tuple[int | None, bool]]:
    """(window incl. the query, causal) per layer as SGLang's dflash model resolves them: full layers
    ENCODER_ONLY (bidirectional), sliding layers DECODER with window_left = sliding_window - 1."""
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    window_left = config["sliding_window"] - 1 if "sliding_attention" in layer_types else None
    return [(window_left + 1, True) if t == "sliding_attention" else (None, False) for t in layer_types]


def ours(config) -> list[tuple[int | None, bool]]:
    return [(config.sliding_window, True) if t == "sliding_attention" else (None, False) for t in config.layer_types]


def small_target() -> Qwen3Config:
    return Qwen3Config(hidden_size=64, vocab_size=128, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, rope_theta=1e6)


@pytest.mark.parametrize("layer_types", [["full_attention"] * 3, ["sliding_attention"] * 3,
                                         ["sliding_attention", "full_attention", "sliding_attention"]])
def test_engines_read_the_attention_the_drafter_computes(layer_types):
    config = dflash_config_from_target(small_target(), mask_token_id=127, num_layers=3, layer_types=layer_types,
                                       sliding_window=7)
    exported = export_config_dict(config)
    assert vllm_layers(exported) == sglang_layers(exported) == ours(config)
    assert exported["dflash_config"]["target_layer_ids"] == config.target_layer_ids  # vLLM adds 1: HF's index
    assert exported["dflash_config"]["mask_token_id"] == 127 and exported["block_size"] == 16
    assert exported["num_target_layers"] == 8 and exported["target_hidden_size"] == exported["hidden_size"] == 64
    assert exported["draft_vocab_size"] == exported["vocab_size"] == 128
    assert config_from_export_dict(exported).to_dict() == config.to_dict()


def test_configs_that_ask_for_other_attention_are_refused():
    exported = export_config_dict(dflash_config_from_target(small_target(), mask_token_id=127, num_layers=2,
                                                            layer_types=["sliding_attention", "full_attention"],
                                                            sliding_window=7))
    for change, message in [({"is_causal": True}, "is_causal"),
                            ({"dflash_config": {**exported["dflash_config"], "causal": False}}, "causal"),
                            ({"dflash_config": {**exported["dflash_config"], "swa_window_size": 9}}, "swa_window_size"),
                            ({"layer_types": ["full_attention"] * 2}, "use_swa"),
                            ({"draft_vocab_size": 32}, "draft_vocab_size"),
                            ({"target_hidden_size": 32}, "target_hidden_size")]:
        with pytest.raises(ValueError, match=message):
            config_from_export_dict({**exported, **change})


def test_architecture_keys():
    target = small_target()
    config = dflash_config_from_target(target, mask_token_id=1, num_layers=2, head_dim=8, num_attention_heads=6,
                                       num_key_value_heads=3, intermediate_size=40, rope_theta=5e5,
                                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 1024})
    assert (config.head_dim, config.num_attention_heads, config.num_key_value_heads) == (8, 6, 3)
    assert config.intermediate_size == 40 and config.max_window_layers == 2
    assert config.rope_parameters == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                      "rope_theta": 5e5}
    exported = export_config_dict(config)
    assert exported["rope_theta"] == 5e5 and exported["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    assert config_from_export_dict(exported).rope_parameters == config.rope_parameters
    drafter = DFlashDrafter(config)  # q 6 x 8 = 48 from D = 64: the published 27B drafter's kind of shape
    assert drafter.layers[0].self_attn.q_proj.weight.shape == (48, 64)
    assert drafter.layers[0].self_attn.k_proj.weight.shape == (24, 64)
    assert drafter.layers[0].mlp.gate_proj.weight.shape == (40, 64)
    plain = dflash_config_from_target(target, mask_token_id=1)  # the rule, as before the keys existed: D 64 ->
    assert (plain.head_dim, plain.num_attention_heads, plain.num_key_value_heads, plain.intermediate_size) == (
        64, 1, 1, 96)  # one head of 64, and 1 KV head (the target's 2 do not divide it); the target's FFN
    assert plain.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    with torch.no_grad():  # the scaling reaches the rotary embedding
        x, positions = torch.zeros(1, 1, 8), torch.tensor([[2000]])
        assert not torch.allclose(DFlashDrafter(config).rotary_emb(x, positions)[0],
                                  DFlashDrafter(dflash_config_from_target(target, mask_token_id=1, num_layers=2,
                                                                          head_dim=8, num_attention_heads=6,
                                                                          num_key_value_heads=3,
                                                                          rope_theta=5e5)).rotary_emb(x, positions)[0])
    for kwargs, message in [(dict(num_attention_heads=6, num_key_value_heads=4), "does not divide"),
                            (dict(layer_types=["full_attention"]), "entries for 2 draft layers"),
                            (dict(layer_types=["sliding_attention", "full_attention"]), "need a sliding_window")]:
        with pytest.raises(ValueError, match=message):
            dflash_config_from_target(target, mask_token_id=1, num_layers=2, head_dim=8, **kwargs)


def test_schema_checks_the_rope_scaling_key():
    config = table.merged_config()
    config["train"]["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    validate(config, str(ROOT / "config" / "schema.yaml"))
    for bad in ({"factor": 4.0}, {"rope_type": "yarn", "rope_theta": 1e6}, {"rope_type": "ntk"}):
        config["train"]["rope_scaling"] = bad
        with pytest.raises(Exception, match="rope_scaling|rope_type|rope_theta"):
            validate(config, str(ROOT / "config" / "schema.yaml"))
