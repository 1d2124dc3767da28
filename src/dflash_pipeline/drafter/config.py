"""The drafter's config (docs/design.md, "DFlash, precisely"): the Qwen3 shapes of its layers, the DFlash fields, the train-config keys
that set them, and its config.json form (what z-lab's reference, vLLM and SGLang read; docs/serving.md)."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

from ..target import default_target_layer_ids

# PreTrainedConfig's fields of every model (task heads, outputs), left out of config.json: loading fills them in
GENERIC_CONFIG_KEYS = ("chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder", "output_attentions",
                       "output_hidden_states", "problem_type", "return_dict")


@strict
class DFlashConfig(Qwen3Config):
    """A Qwen3 config (the draft layers' shapes) plus the DFlash fields; ``head_dim`` is the drafter's own
    (full-head rotary), ``hidden_size`` equals the target's."""

    block_size: int = 16
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    mask_token_id: int | None = None


# the train-config keys that shape the drafter (config/schema.yaml, train:), in dflash_config_from_target's names
ARCHITECTURE_KEYS = ("num_layers", "block_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "layer_types", "sliding_window", "rope_theta", "rope_scaling")


def architecture_kwargs(train_config) -> dict:
    """The drafter-shaping keys of a train config (a ``TrainConfig`` or the ``train:`` mapping)."""
    get = train_config.get if isinstance(train_config, dict) else lambda key: getattr(train_config, key)
    return {key: get(key) for key in ARCHITECTURE_KEYS}


def dflash_config_from_target(target_config, *, mask_token_id: int, num_layers: int = 5, block_size: int = 16,
                              target_layer_ids: list[int] | None = None, head_dim: int | None = None,
                              num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                              intermediate_size: int | None = None, layer_types: list[str] | None = None,
                              sliding_window: int | None = None, rope_theta: float | None = None,
                              rope_scaling: dict | None = None, **overrides) -> DFlashConfig:
    """The drafter's config: its architecture keys where given (None: the rule below), the rest from the
    target's (text) config: D, vocab, RMS eps, max positions, bos/eos/pad ids (the text config's, else the
    multimodal config's: as the published Qwen3.6 drafter's).

    head_dim (full-head rotary): 128 when D % 128 == 0, else 64 when D % 64 == 0 (SmolLM2, D=576 -> 9
    heads of 64), else the target's D // heads. Heads = D // head_dim; KV heads = the target's count when
    it divides the heads, else the largest divisor of the heads <= heads // 4. FFN size and rope theta: the
    target's. RoPE: full-head, the target's theta and no scaling unless ``rope_scaling`` ({rope_type, factor,
    ...}, transformers' names) is given; the target's partial rotary and mRoPE sections are never copied (the
    drafter's queries and keys are its own). ``overrides`` win.
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    D, L = text.hidden_size, text.num_hidden_layers
    if head_dim is None:
        head_dim = 128 if D % 128 == 0 else 64 if D % 64 == 0 else D // text.num_attention_heads
    heads = num_attention_heads or D // head_dim
    kv = num_key_value_heads or getattr(text, "num_key_value_heads", None) or heads
    if heads % kv and num_key_value_heads is None:
        kv = max(d for d in range(1, max(1, heads // 4) + 1) if heads % d == 0)
    if heads % kv:
        raise ValueError(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    if rope_theta is None:
        rope = dict(getattr(text, "rope_parameters", None) or {})
        rope_theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    rope_parameters = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": float(rope_theta)}
    layer_types = list(layer_types or ["full_attention"] * num_layers)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} draft layers")
    sliding = "sliding_attention" in layer_types
    if sliding and sliding_window is None:
        raise ValueError("sliding_attention draft layers need a sliding_window")
    fields = dict(
        hidden_size=D, vocab_size=text.vocab_size, intermediate_size=intermediate_size or text.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=text.rms_norm_eps, max_position_embeddings=text.max_position_embeddings,
        rope_parameters=rope_parameters, hidden_act="silu", tie_word_embeddings=False, layer_types=layer_types,
        sliding_window=sliding_window if sliding else None, use_sliding_window=sliding, max_window_layers=num_layers,
        **{name: _first(getattr(c, name, None) for c in (text, target_config))
           for name in ("bos_token_id", "eos_token_id", "pad_token_id")},
        block_size=block_size, target_layer_ids=list(target_layer_ids or default_target_layer_ids(L)),
        num_target_layers=L, mask_token_id=int(mask_token_id),
    )
    fields.update(overrides)
    return DFlashConfig(**fields)


def _first(values):
    return next((v for v in values if v is not None), None)



def export_config_dict(config: DFlashConfig) -> dict:
    """The checkpoint's config.json: the Qwen3 fields, the DFlash fields z-lab's reference and SGLang read
    (``block_size``, ``num_target_layers``, ``dflash_config.{mask_token_id, target_layer_ids}``, ``layer_types``,
    ``sliding_window``) and those vLLM reads, with the values that give our semantics: ``dflash_config.use_swa`` =
    any sliding layer (vLLM makes every layer sliding when it is set over all-full ``layer_types``),
    ``swa_window_size`` = ``sliding_window`` (vLLM prefers it), ``causal`` only when all layers share one type
    (vLLM applies it to every layer: full layers are bidirectional in the block, sliding ones causal),
    ``target_hidden_size`` and ``draft_vocab_size`` (no vocabulary of its own). docs/serving.md has the table."""
    d = config.to_dict()
    for key in ("target_layer_ids", "mask_token_id", "transformers_version", "_name_or_path", *GENERIC_CONFIG_KEYS):
        d.pop(key, None)
    layer_types = list(config.layer_types)
    sliding = "sliding_attention" in layer_types
    window = config.sliding_window if sliding else None
    scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
              "use_swa": sliding, "swa_window_size": window}
    if len(set(layer_types)) == 1:
        dflash["causal"] = sliding
    d.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=config.block_size,
             num_target_layers=config.num_target_layers, layer_types=layer_types, sliding_window=window,
             use_sliding_window=sliding, rope_theta=config.rope_parameters["rope_theta"],
             rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
             target_hidden_size=config.hidden_size, draft_vocab_size=config.vocab_size, dflash_config=dflash)
    return d


def config_from_export_dict(d: dict) -> DFlashConfig:
    """A DFlash checkpoint config (ours, z-lab's, SpecForge's) as a ``DFlashConfig``; fields that ask for attention
    this drafter does not compute (a ``causal`` flag against the per-layer rule, ``use_swa`` without sliding layers,
    two window sizes, a vocabulary or feature width of its own) are refused."""
    d = dict(d)
    dflash = dict(d.pop("dflash_config", {}))
    for key in ("architectures", "model_type", "transformers_version", "auto_map"):
        d.pop(key, None)  # a legacy top-level rope_theta/rope_scaling is converted by transformers
    layer_types = d.get("layer_types") or ["full_attention"] * d["num_hidden_layers"]
    causal = [t == "sliding_attention" for t in layer_types]  # ours: sliding layers causal, full ones not
    problems = []
    for name, value in (("is_causal", d.pop("is_causal", None)), ("dflash_config.causal", dflash.get("causal"))):
        if value is not None and any(bool(value) != c for c in causal):
            problems.append(f"{name}={value} over layer_types {layer_types}")
    if dflash.get("use_swa") and not any(causal):
        problems.append("dflash_config.use_swa without sliding_attention layers (sliding bidirectional layers)")
    if dflash.get("swa_window_size") not in (None, d.get("sliding_window")):
        problems.append(f"dflash_config.swa_window_size {dflash['swa_window_size']} != sliding_window "
                        f"{d.get('sliding_window')}")
    for key, same in (("target_hidden_size", "hidden_size"), ("draft_vocab_size", "vocab_size")):
        if d.pop(key, None) not in (None, d.get(same)):
            problems.append(f"{key} differs from {same}")
    if problems:
        raise ValueError("DFlash config with attention or shapes this drafter does not implement: " + "; ".join(problems))
    d.setdefault("block_size", dflash.get("block_size", 16))
    return DFlashConfig(**d, target_layer_ids=dflash["target_layer_ids"], mask_token_id=dflash["mask_token_id"])
