"""Tiny random-weight hybrid (Gated-DeltaNet + full attention) targets saved as real local checkpoints.

The shapes follow the Qwen3.5/3.6 family (docs/design.md, "Hybrid targets") at toy size: the layer pattern
[GDN, GDN, GDN, full] repeated, more GDN value heads than key heads, gated full attention with
partial interleaved-mRoPE rotary, zero-centred RMSNorms, untied embeddings. The vocabulary is SmolLM2's
(49152), so the real SmolLM2 tokenizer and chat template are saved with each checkpoint.

Two changes from transformers' random init make the tests sensitive:
- ``initializer_range`` is raised so that token mixing is not drowned by the residual stream;
- the GDN decay rates ``A_log`` are set small (A in [1e-3, 0.1]) so the recurrent state remembers
  tokens across hundreds of positions, as trained models do (the default init forgets within a step).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB_SIZE = 49152  # SmolLM2's vocabulary
LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention"]
NUM_LAYERS = 8
FULL_ATTENTION_LAYERS = [i for i in range(NUM_LAYERS) if LAYER_TYPES[i % 4] == "full_attention"]  # [3, 7]


def text_config_kwargs(tokenizer) -> dict:
    """A ``qwen3_5_text`` config at toy size (hidden 64, 8 layers)."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        layer_types=[LAYER_TYPES[i % 4] for i in range(NUM_LAYERS)],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.1,
        tie_word_embeddings=False,
        # 25 % partial rotary with interleaved mRoPE, as in the real configs (8 rotary dims = 4 frequencies).
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": [2, 1, 1]},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _long_memory(model: torch.nn.Module) -> None:
    """Small GDN decay rates (long memory) and non-trivial norm weights, deterministically."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__.endswith("GatedDeltaNet"):
                heads = module.A_log.numel()
                module.A_log.copy_(torch.linspace(math.log(1e-3), math.log(0.1), heads))
        generator = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred RMSNorms: x * (1 + w)
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def _save(model, tokenizer, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def build_qwen3_5_text(out: str | Path, tokenizer, seed: int = 0) -> Path:
    """The text-only layout: ``Qwen3_5ForCausalLM.save_pretrained`` (keys ``model.layers.*``)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config_kwargs(tokenizer)))
    _long_memory(model)
    return _save(model, tokenizer, Path(out))


def build_qwen3_5_vl(out: str | Path, tokenizer, seed: int = 0) -> Path:
    """The vision-language layout of the real checkpoints: ``Qwen3_5ForConditionalGeneration`` with a tiny
    vision tower, so the safetensors hold ``model.language_model.*``, ``model.visual.*`` and ``lm_head.*``;
    plus an ``mtp.*`` tensor as the real checkpoints carry (multi-token-prediction weights)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen3_5Config(
        text_config=text_config_kwargs(tokenizer),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
        tie_word_embeddings=False,
    )
    model = Qwen3_5ForConditionalGeneration(config)
    _long_memory(model)
    out = _save(model, tokenizer, Path(out))
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1, files
    with safe_open(str(files[0]), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata()
    tensors["mtp.fc.weight"] = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    save_file(tensors, str(files[0]), metadata=metadata)
    return out


def build_qwen3_next(out: str | Path, tokenizer, seed: int = 0) -> Path:
    """A tiny ``qwen3_next`` (GDN + gated attention, sparse MoE with a shared expert), text-only layout."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    kwargs = text_config_kwargs(tokenizer)
    del kwargs["rope_parameters"]
    config = Qwen3NextConfig(
        **kwargs,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
    )
    model = Qwen3NextForCausalLM(config)
    _long_memory(model)
    return _save(model, tokenizer, Path(out))
