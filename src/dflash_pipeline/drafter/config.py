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
    # None: sliding layers causal inside the block, full layers not; True/False: every layer (the reference's rule)
    is_causal: bool | None = None
    output_multiplier: float = 1.0  # logits = softcap(lm_head(h) * output_multiplier)
    final_logit_softcapping: float | None = None
    # DFlash2 (drafter/dflash2.py); None: a DFlash drafter
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None

    @property
    def architecture(self) -> str:
        return "dflash" if self.selector_rank is None else "dflash2"

    def layer_causal(self, layer_type: str) -> bool:
        """Whether a layer of this type is causal inside the block."""
        return layer_type == "sliding_attention" if self.is_causal is None else bool(self.is_causal)


# the train-config keys that shape the drafter (config/schema.yaml, train:), in dflash_config_from_target's names
ARCHITECTURE_KEYS = ("architecture", "num_layers", "block_size", "head_dim", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "layer_types", "sliding_window", "rope_theta",
                     "rope_scaling", "is_causal", "output_multiplier", "final_logit_softcapping", "conv_kernel_size",
                     "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # config.json: dflash_config
# DFlash2's published values (the Qwen3.6/3.8-27B drafters'): what a dflash2 drafter gets where its key is null
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def architecture_kwargs(train_config) -> dict:
    """The drafter-shaping keys of a train config (a ``TrainConfig`` or the ``train:`` mapping)."""
    get = train_config.get if isinstance(train_config, dict) else lambda key: getattr(train_config, key)
    return {key: get(key) for key in ARCHITECTURE_KEYS}


def dflash_config_from_target(target_config, *, mask_token_id: int, num_layers: int = 5, block_size: int = 16,
                              target_layer_ids: list[int] | None = None, head_dim: int | None = None,
                              num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                              intermediate_size: int | None = None, layer_types: list[str] | None = None,
                              sliding_window: int | None = None, rope_theta: float | None = None,
                              rope_scaling: dict | None = None, architecture: str = "dflash",
                              is_causal: bool | None = None, output_multiplier: float | None = None,
                              final_logit_softcapping: float | None = None, conv_kernel_size: int | None = None,
                              conv_group_size: int | None = None, selector_rank: int | None = None,
                              selector_top_k: int | None = None, **overrides) -> DFlashConfig:
    """The drafter's config: its architecture keys where given (None: the rule below), the rest from the
    target's (text) config: D, vocab, RMS eps, max positions, bos/eos/pad ids (the text config's, else the
    multimodal config's: as the published Qwen3.6 drafter's).

    head_dim (full-head rotary): 128 when D % 128 == 0, else 64 when D % 64 == 0 (SmolLM2, D=576 -> 9
    heads of 64), else the target's D // heads. Heads = D // head_dim; KV heads = the target's count when
    it divides the heads, else the largest divisor of the heads <= heads // 4. FFN size and rope theta: the
    target's. RoPE: full-head, the target's theta and no scaling unless ``rope_scaling`` ({rope_type, factor,
    ...}, transformers' names) is given; the target's partial rotary and mRoPE sections are never copied (the
    drafter's queries and keys are its own). ``architecture`` "dflash2" adds the DFlash2 fields
    (``DFLASH2_DEFAULTS`` where None); "dflash" refuses them. ``overrides`` win.
    """
    dflash2 = dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size, selector_rank=selector_rank,
                   selector_top_k=selector_top_k)
    if architecture == "dflash2":
        dflash2 = {key: DFLASH2_DEFAULTS[key] if value is None else int(value) for key, value in dflash2.items()}
    elif architecture != "dflash":
        raise ValueError(f"drafter architecture {architecture!r}: expected dflash or dflash2")
    elif any(value is not None for value in dflash2.values()):
        raise ValueError(f"{sorted(k for k, v in dflash2.items() if v is not None)} are DFlash2 keys: set the "
                         "architecture to dflash2")
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
        num_target_layers=L, mask_token_id=int(mask_token_id), is_causal=is_causal,
        output_multiplier=1.0 if output_multiplier is None else float(output_multiplier),
        final_logit_softcapping=final_logit_softcapping, **dflash2,
    )
    fields.update(overrides)
    return checked(DFlashConfig(**fields))


def checked(config: DFlashConfig) -> DFlashConfig:
    """The config, or a ValueError where its DFlash2 fields cannot build a drafter."""
    values = [getattr(config, key) for key in DFLASH2_KEYS]
    if any(v is None for v in values) and any(v is not None for v in values):
        raise ValueError(f"DFlash2 needs all of {DFLASH2_KEYS}, got {dict(zip(DFLASH2_KEYS, values))}")
    if config.architecture == "dflash2":
        K, G, r, k = values
        if not 1 <= K <= config.block_size:
            raise ValueError(f"conv_kernel_size {K} must be in [1, block_size {config.block_size}]")
        if G < 1 or config.hidden_size % G:
            raise ValueError(f"conv_group_size {G} does not divide hidden_size {config.hidden_size}")
        if r < 1 or not 1 <= k <= config.vocab_size:
            raise ValueError(f"selector_rank {r} must be >= 1 and selector_top_k {k} in [1, vocab_size]")
    if config.architecture == "dflash" and config.is_causal is not None and any(
            config.layer_causal(t) != (t == "sliding_attention") for t in config.layer_types):
        raise ValueError(f"is_causal {config.is_causal} over layer_types {config.layer_types}: a DFlash drafter's "
                         "layers are causal when sliding and bidirectional when full (SGLang's dflash reads no "
                         "is_causal); DFlash2 takes it")
    if config.final_logit_softcapping is not None and config.final_logit_softcapping <= 0:
        raise ValueError(f"final_logit_softcapping {config.final_logit_softcapping} must be > 0 (or null: none)")
    return config


def _first(values):
    return next((v for v in values if v is not None), None)



def export_config_dict(config: DFlashConfig) -> dict:
    """The checkpoint's config.json: the Qwen3 fields, the DFlash fields z-lab's reference and SGLang read
    (``block_size``, ``num_target_layers``, ``dflash_config.{mask_token_id, target_layer_ids}``, ``layer_types``,
    ``sliding_window``) and those vLLM reads, with the values that give our semantics: ``dflash_config.use_swa`` =
    any sliding layer (vLLM makes every layer sliding when it is set over all-full ``layer_types``),
    ``swa_window_size`` = ``sliding_window`` (vLLM prefers it), ``causal`` only when all layers share one causality
    (vLLM applies it to every layer: by default full layers are bidirectional in the block, sliding ones causal),
    ``target_hidden_size`` and ``draft_vocab_size`` (no vocabulary of its own). A DFlash2 drafter is
    ``DFlash2DraftModel`` with ``dflash_config.{block_size, conv_kernel_size, conv_group_size, selector_rank,
    selector_top_k}`` (the published checkpoints' layout) and ``is_causal`` when set; ``output_multiplier`` and
    ``final_logit_softcapping`` go in ``dflash_config`` when they change the logits. docs/serving.md has the table."""
    d = config.to_dict()
    for key in ("target_layer_ids", "mask_token_id", "transformers_version", "_name_or_path", "is_causal",
                "output_multiplier", "final_logit_softcapping", *DFLASH2_KEYS, *GENERIC_CONFIG_KEYS):
        d.pop(key, None)
    layer_types = list(config.layer_types)
    sliding = "sliding_attention" in layer_types
    window = config.sliding_window if sliding else None
    scaling = {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"}
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids),
              "use_swa": sliding, "swa_window_size": window}
    causal = {config.layer_causal(t) for t in layer_types}
    if len(causal) == 1:
        dflash["causal"] = causal.pop()
    if config.output_multiplier != 1.0:
        dflash["output_multiplier"] = config.output_multiplier
    if config.final_logit_softcapping is not None:
        dflash["final_logit_softcapping"] = config.final_logit_softcapping
    d.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=config.block_size,
             num_target_layers=config.num_target_layers, layer_types=layer_types, sliding_window=window,
             use_sliding_window=sliding, rope_theta=config.rope_parameters["rope_theta"],
             rope_scaling=None if scaling.get("rope_type", "default") == "default" else scaling,
             target_hidden_size=config.hidden_size, draft_vocab_size=config.vocab_size, dflash_config=dflash)
    if config.is_causal is not None:
        d["is_causal"] = config.is_causal
    if config.architecture == "dflash2":
        d["architectures"] = ["DFlash2DraftModel"]
        dflash.update(block_size=d.pop("block_size"), **{key: getattr(config, key) for key in DFLASH2_KEYS})
    return d


def config_from_export_dict(d: dict) -> DFlashConfig:
    """A DFlash or DFlash2 checkpoint config (ours, z-lab's, SpecForge's) as a ``DFlashConfig``; the DFlash keys are
    read from ``dflash_config`` first, then from the top level (the reference's ``_draft_value``). Fields that ask for
    attention this drafter does not compute (a ``causal`` flag against ``is_causal``'s rule, ``use_swa`` without
    sliding layers, two window sizes, a vocabulary or feature width of its own) are refused."""
    d = dict(d)
    dflash = dict(d.pop("dflash_config", {}))
    architectures = d.pop("architectures", None) or ["DFlashDraftModel"]
    for key in ("model_type", "transformers_version", "auto_map"):
        d.pop(key, None)  # a legacy top-level rope_theta/rope_scaling is converted by transformers
    extra = {key: dflash.get(key, d.pop(key, None)) for key in (*DFLASH2_KEYS, "output_multiplier",
                                                                 "final_logit_softcapping")}
    d.pop("output_multiplier", None), d.pop("final_logit_softcapping", None)
    extra["output_multiplier"] = float(extra["output_multiplier"] if extra["output_multiplier"] is not None else 1.0)
    problems = []
    dflash2 = "DFlash2DraftModel" in architectures
    if dflash2 != (extra["selector_rank"] is not None):
        problems.append(f"architectures {architectures} with selector_rank {extra['selector_rank']}")
    layer_types = d.get("layer_types") or ["full_attention"] * d["num_hidden_layers"]
    is_causal = d.pop("is_causal", None)
    causal = [t == "sliding_attention" if is_causal is None else bool(is_causal) for t in layer_types]
    if dflash.get("causal") is not None and any(bool(dflash["causal"]) != c for c in causal):
        problems.append(f"dflash_config.causal={dflash['causal']} over layer_types {layer_types} and "
                        f"is_causal {is_causal}")
    if dflash.get("use_swa") and "sliding_attention" not in layer_types:
        problems.append("dflash_config.use_swa without sliding_attention layers (every layer sliding)")
    if dflash.get("swa_window_size") not in (None, d.get("sliding_window")):
        problems.append(f"dflash_config.swa_window_size {dflash['swa_window_size']} != sliding_window "
                        f"{d.get('sliding_window')}")
    for key, same in (("target_hidden_size", "hidden_size"), ("draft_vocab_size", "vocab_size")):
        if d.pop(key, None) not in (None, d.get(same)):
            problems.append(f"{key} differs from {same}")
    if problems:
        raise ValueError("DFlash config with attention or shapes this drafter does not implement: " + "; ".join(problems))
    d["block_size"] = dflash.get("block_size", d.get("block_size", 16))
    return checked(DFlashConfig(**d, **extra, is_causal=is_causal, target_layer_ids=dflash["target_layer_ids"],
                                mask_token_id=dflash["mask_token_id"]))
