"""The DFlash drafter (docs/design.md, "DFlash, precisely"): Qwen3-style layers with KV injection of target features.

The drafter has no embedding and no LM head of its own: the target's frozen ``embed_tokens`` and
``lm_head`` are attached (``attach_target``) as plain attributes, so they are in neither
``parameters()`` nor ``state_dict()``; they follow the drafter's *device* (``.to``/``.cuda``) but keep
their own dtype (activations are cast at the boundary).

Two forward paths share the weights:
- ``forward_blocks`` (training): every block of one sequence, or of many sequences packed one after
  another, in one pass, over the whole clean sequences' context, with the DFlash mask (FlexAttention
  ``BlockMask`` on CUDA, dense bool mask on CPU); a block never sees another sequence.
- ``forward_block`` / ``draft`` (inference): one block anchored at position C, context = positions 0..C-1,
  optionally through a ``ContextCache`` of projected context keys/values.

Both return the *final-normed* hidden states (``norm`` already applied): ``logits(out)`` are the logits.

A DFlash2 drafter (``config.architecture``) has the same layers wrapped in grouped dynamic causal convolutions and a
``candidate_selector`` (drafter/dflash2.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .config import DFlashConfig, dflash_config_from_target
from .dflash2 import CandidateSelector, GroupedDynamicCausalConv, around
from .masks import dense_sequence_masks, flex_block_mask

_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale, kernel_options=None):
    global _compiled_flex
    kwargs = dict(block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options)
    if torch.compiler.is_compiling():  # inside a compiled layer pass (compile_layers): compiled with it
        return flex_attention(q, k, v, **kwargs)
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention)
        return _compiled_flex(q, k, v, **kwargs)
    return flex_attention(q, k, v, **kwargs)  # slow reference path


def _rope(x, cos, sin):  # x [b, H, S, hd]; cos/sin [b, S, hd]; the formula of Qwen3's apply_rotary_pos_emb
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    """Qwen3 attention (GQA, per-head q/k RMSNorm, RoPE) whose keys/values are [context ; block]."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        D, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(D, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(D, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, D, bias=bias)
        self.q_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(hd, eps=config.rms_norm_eps)
        self.rope = _rope  # or its compiled form (DFlashDrafter.compile_pointwise)
        self.flex_kernel_options = None  # FlexAttention's kernel_options (DFlashDrafter.set_flex_kernel_options)

    def project_kv(self, x, cos, sin):
        """Keys (k_norm + RoPE) and values [b, Hkv, S, hd] of x [b, S, D]; used for context and block alike."""
        shape = (*x.shape[:2], self.num_kv_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x).view(shape)).transpose(1, 2)
        return self.rope(k, cos, sin), self.v_proj(x).view(shape).transpose(1, 2)

    def forward(self, x, context_kv, cos, sin, mask):
        b, S, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, S, self.num_heads, self.head_dim)).transpose(1, 2)
        q = self.rope(q, cos, sin)
        out = _attention(q, context_kv, self.project_kv(x, cos, sin), mask, self.head_dim**-0.5,
                         self.flex_kernel_options)
        return self.o_proj(out.transpose(1, 2).reshape(b, S, -1))


def _attention(q, context_kv, block_kv, mask, scale, kernel_options=None):
    """Queries [b, H, S, hd] over keys/values [context ; block]. ``mask``: a FlexAttention BlockMask, a bool
    tensor or None (SDPA), or a list of (query slice, context slice, bool mask): the dense path of a packed
    batch, one sequence at a time (its queries, its context, its own blocks' keys), so that it computes no
    pair of two sequences (all masked) and its masks stay per-sequence-sized. ``kernel_options``: FlexAttention's."""
    if isinstance(mask, list):
        return torch.cat([_attention(q[:, :, qs], [t[:, :, cs] for t in context_kv], [t[:, :, qs] for t in block_kv],
                                     m, scale) for qs, cs, m in mask], dim=2)
    k, v = torch.cat([context_kv[0], block_kv[0]], dim=2), torch.cat([context_kv[1], block_kv[1]], dim=2)
    if mask is not None and not isinstance(mask, torch.Tensor):  # a FlexAttention BlockMask
        return _flex_attention(q, k, v, mask, scale, kernel_options)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def transform_logits(logits, config: DFlashConfig):
    """``output_multiplier`` and ``final_logit_softcapping`` (the reference's ``compute_logits``); none: unchanged."""
    if config.output_multiplier != 1.0:
        logits = logits * config.output_multiplier
    if config.final_logit_softcapping is not None:
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return logits


def _host_to_device(values: list[int], device) -> torch.Tensor:
    """A small host list on the device without a stream sync (a pinned, non-blocking copy on CUDA)."""
    tensor = torch.tensor(values)
    return tensor.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else tensor


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if config.architecture == "dflash2":
            self.attention_conv, self.mlp_conv = (
                GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size,
                                         config.block_size) for _ in range(2))

    def forward(self, h, context_kv, cos, sin, mask):
        h = h + around(self.attention_conv, lambda x: self.self_attn(x, context_kv, cos, sin, mask),
                       self.input_layernorm(h))
        return h + around(self.mlp_conv, self.mlp, self.post_attention_layernorm(h))


def decoder_layer_pass(layer, h, ctx, cos_c, sin_c, cos_b, sin_b, mask):
    """A layer over block hidden states ``h`` that attend to the context ``ctx`` (not cached)."""
    return layer(h, layer.self_attn.project_kv(ctx, cos_c, sin_c), cos_b, sin_b, mask)


class ContextCache:
    """Projected context keys/values per layer for incremental drafting; context only grows."""

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0

    def update(self, layer: int, k, v):
        if layer == len(self.kv):
            self.kv.append((k, v))
        else:
            old_k, old_v = self.kv[layer]
            self.kv[layer] = (torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2))
        return self.kv[layer]


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig, embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None):
        super().__init__()
        if not config.target_layer_ids:
            raise ValueError("DFlashConfig.target_layer_ids is required")
        self.config = config
        D = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # inv_freq is a non-persistent buffer
        self.candidate_selector = None
        if config.architecture == "dflash2":
            self.candidate_selector = CandidateSelector(D, config.vocab_size, config.selector_rank,
                                                        config.selector_top_k)
        self.gradient_checkpointing = False
        self.pointwise_compiled = False
        self.selector_loss_weight = 1.0  # DFlash2: the selector term's weight in the training loss
        self.layer_pass = decoder_layer_pass  # or its compiled form (compile_layers)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_parameters()
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(config.initializer_range)
        object.__setattr__(self, "embed_tokens", None)
        object.__setattr__(self, "lm_head", None)
        if embed_tokens is not None or lm_head is not None:
            self.attach_target(embed_tokens, lm_head)

    @classmethod
    def from_target_config(cls, target_config, *, mask_token_id: int, embed_tokens=None, lm_head=None,
                           **kwargs) -> "DFlashDrafter":
        """A fresh drafter shaped for the target; ``kwargs`` go to ``dflash_config_from_target``."""
        config = dflash_config_from_target(target_config, mask_token_id=mask_token_id, **kwargs)
        return cls(config, embed_tokens, lm_head)

    def compile_pointwise(self) -> None:
        """torch.compile (dynamic shapes) the parts made of pointwise ops and row reductions: the RMSNorms, the
        MLPs (SiLU gate), RoPE and the LM-head loss's softmax (``pointwise_compiled``, read by the trainer):
        a few fused kernels instead of one kernel per op. For CUDA training; FlexAttention compiles apart.
        Weights and state-dict keys stay as they are."""
        # One RMSNorm forward sees 3-D and 4-D (q/k norms) inputs, bf16 and fp32 under autocast, inputs with and
        # without grad, training and no-grad validation: ~10 variants, more than dynamo's default limit of 8 per
        # function, past which it runs the other variants eager without saying so in the result.
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        for module in self.modules():
            if isinstance(module, (Qwen3RMSNorm, Qwen3MLP)):
                module.compile(dynamic=True)
        rope = torch.compile(_rope, dynamic=True)
        for layer in self.layers:
            layer.self_attn.rope = rope
        self.pointwise_compiled = True

    def compile_layers(self) -> None:
        """``compile_pointwise``, and each layer's training pass torch.compiled whole (dynamic shapes): the
        context's keys/values, the attention (FlexAttention inside) and the MLP, forward and backward, one graph
        that all layers share: far fewer launches and host calls per step than the compiled parts alone. Packs
        on the dense path and cached drafting stay as they are."""
        self.compile_pointwise()
        self.layer_pass = torch.compile(decoder_layer_pass, dynamic=True)

    def set_flex_kernel_options(self, options: dict | None) -> None:
        """FlexAttention's ``kernel_options`` for the training pass (e.g. ``{"BLOCK_M": 64, "BLOCK_N": 64}``: the
        forward kernel's tiles of queries and keys); None: the kernel's defaults. Tiles change the order of the
        sums, not what is computed."""
        for layer in self.layers:
            layer.self_attn.flex_kernel_options = dict(options) if options else None

    # ---- the target's frozen embedding and LM head (not parameters of the drafter) ----
    def attach_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        for module in (embed_tokens, lm_head):
            module.requires_grad_(False)
        object.__setattr__(self, "embed_tokens", embed_tokens)
        object.__setattr__(self, "lm_head", lm_head)

    def _apply(self, fn, recurse=True):  # .to()/.cuda() move the attached modules' device, never their dtype
        super()._apply(fn, recurse)
        device = self.fc.weight.device
        for module in (self.embed_tokens, self.lm_head):
            if module is not None:
                module.to(device)
        return self

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def embed(self, token_ids):
        return self.embed_tokens(token_ids).to(self.fc.weight.dtype)

    def logits(self, hidden):
        """The target's LM head on final-normed hidden states, times ``output_multiplier``, soft-capped."""
        return transform_logits(self.lm_head(hidden.to(self.lm_head.weight.dtype)), self.config)

    def fuse_context(self, features):
        """[.., K*D] concatenated target-layer features -> hidden_norm(fc(.)) [.., D]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    # ---- the shared layer stack ----
    def _run_layers(self, h, ctx, ctx_positions, blk_positions, masks, cache=None):
        positions = torch.cat([ctx_positions, blk_positions])[None]
        cos, sin = self.rotary_emb(h, positions)
        C = ctx_positions.shape[0]
        cos_c, sin_c, cos_b, sin_b = cos[:, :C], sin[:, :C], cos[:, C:], sin[:, C:]
        for i, layer in enumerate(self.layers):
            def step(h, ctx, layer=layer, i=i):
                mask = masks[layer.layer_type]
                if cache is None and isinstance(mask, BlockMask):
                    return self.layer_pass(layer, h, ctx, cos_c, sin_c, cos_b, sin_b, mask)
                kv = layer.self_attn.project_kv(ctx, cos_c, sin_c)
                if cache is not None:
                    kv = cache.update(i, *kv)
                return layer(h, kv, cos_b, sin_b, mask)

            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                h = checkpoint(step, h, ctx, use_reentrant=False)
            else:
                h = step(h, ctx)
        return self.norm(h)

    def forward_blocks(self, context_features, anchors, block_token_ids, *, lengths: list[int] | None = None,
                       block_counts: list[int] | None = None, fused: bool = False, attn_impl: str | None = None):
        """Training path. context_features [1, T, K*D] (or [1, T, D] with ``fused=True``) of the whole
        sequence; anchors LongTensor [n]; block_token_ids [n, B] -> final-normed hidden [n, B, D].

        Packed (many sequences, one pass): context_features holds S sequences' features one after another,
        ``lengths[s]`` tokens each, and the blocks are theirs in the same order, ``block_counts[s]`` each;
        ``anchors`` are positions within their own sequence (RoPE positions restart at 0 in every sequence).
        A block sees only its own sequence (``block_key_ranges``): the result equals one call per sequence.
        Without ``lengths``: one sequence.

        ``attn_impl``: "flex" (FlexAttention BlockMask), "sdpa" (dense bool masks) or None = flex on CUDA.
        """
        ctx = context_features if fused else self.fuse_context(context_features)
        ctx = ctx.to(self.fc.weight.dtype)
        T, (n, B), device = ctx.shape[1], block_token_ids.shape, ctx.device
        lengths, block_counts = lengths or [T], block_counts or [n]
        if sum(lengths) != T or sum(block_counts) != n or len(lengths) != len(block_counts):
            raise ValueError(f"lengths {lengths} / block_counts {block_counts} do not cover {T} tokens and {n} blocks")
        anchors = anchors.to(device)
        sizes = _host_to_device(lengths, device)
        offsets = sizes.cumsum(0) - sizes  # where each sequence's context begins
        ctx_positions = torch.arange(T, device=device) - offsets.repeat_interleave(sizes, output_size=T)
        h = self.embed(block_token_ids).reshape(1, n * B, -1)
        blk_positions = (anchors[:, None] + torch.arange(B, device=device)).reshape(-1)
        masks = {}
        for layer_type in set(self.config.layer_types):
            if (attn_impl or ("flex" if ctx.is_cuda else "sdpa")) == "flex":
                starts = offsets.repeat_interleave(_host_to_device(block_counts, device), output_size=n)
                masks[layer_type] = flex_block_mask(anchors, T, B, layer_type, self.config.sliding_window, starts,
                                                    causal=self.config.is_causal)
            else:
                masks[layer_type] = dense_sequence_masks(anchors, lengths, block_counts, B, layer_type,
                                                         self.config.sliding_window, self.config.is_causal)
        out = self._run_layers(h, ctx, ctx_positions, blk_positions, masks)
        return out.view(n, B, -1)

    forward = forward_blocks

    def forward_block(self, context_features, block_token_ids, start_position: int | None = None, *,
                      cache: ContextCache | None = None, fused: bool = False):
        """Inference path: one block [1, B] anchored at ``start_position`` = C, context = positions 0..C-1.

        Without a cache, context_features [1, C, K*D] covers positions 0..C-1. With a cache, it holds only
        the positions not yet cached (cache.length..C-1); they are appended. -> final-normed hidden [1, B, D].
        """
        ctx = context_features if fused else self.fuse_context(context_features)
        ctx = ctx.to(self.fc.weight.dtype)
        past = cache.length if cache is not None else 0
        C, B, dev = past + ctx.shape[1], block_token_ids.shape[1], ctx.device
        if start_position is not None and start_position != C:
            raise ValueError(f"start_position {start_position} != context length {C}")
        q_pos = torch.arange(C, C + B, device=dev)
        diff = q_pos[:, None] - torch.arange(C + B, device=dev)[None, :]  # query position - key position
        masks = {}
        for layer_type in set(self.config.layer_types):  # None: every key (the whole context and block)
            visible, causal = None, self.config.layer_causal(layer_type)
            if causal:
                visible = diff >= 0
            if layer_type == "sliding_attention":
                window = diff.abs() < self.config.sliding_window
                visible = window if visible is None else visible & window
            masks[layer_type] = visible
        ctx_pos = torch.arange(past, C, device=dev)
        out = self._run_layers(self.embed(block_token_ids), ctx, ctx_pos, q_pos, masks, cache)
        if cache is not None:
            cache.length = C
        return out

    @torch.no_grad()
    def draft(self, context_features, block_token_ids, start_position: int | None = None, *,
              cache: ContextCache | None = None, fused: bool = False):
        """The backbone's greedy drafts: argmax of the logits at slots 1..B-1 -> LongTensor [1, B-1]."""
        h = self.forward_block(context_features, block_token_ids, start_position, cache=cache, fused=fused)
        return self.logits(h[:, 1:]).argmax(-1)
