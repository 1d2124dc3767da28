"""The DFlash training attention mask (docs/design.md, "DFlash, precisely"), as key ranges per query, a FlexAttention
``mask_mod`` and ``BlockMask`` (CUDA), and dense bool masks for the SDPA path (CPU).

Keys are [T context positions | n*B block slots]; query q is slot k = q % B of block i = q // B, anchored at
position a, RoPE position a + k. Full-attention layers: the context before the anchor and the whole block.
Sliding-attention layers: causal inside the block, and only keys less than ``sliding_window`` RoPE positions back
(the window includes the query itself: HF's, vLLM's ``per_layer_sliding_window`` and SGLang's ``window_left + 1``).
``causal`` (the config's ``is_causal``; None: that rule) makes every layer causal inside the block or none: a
bidirectional sliding layer sees the slots less than ``sliding_window`` positions away on either side.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask


def block_key_ranges(anchors: torch.Tensor, T: int, B: int, layer_type: str, sliding_window: int | None,
                     starts: torch.Tensor | None = None, causal: bool | None = None):
    """The training mask as key ranges: for every query, the two half-open ranges of keys it may attend to,
    LongTensors [n*B] ``(ctx_lo, ctx_hi, blk_lo, blk_hi)``.

    Keys are [T context positions | n*B block slots]; query q is slot k = q % B of block i = q // B, anchored
    at ``anchors[i]`` = a (a position of its own sequence), at RoPE position a + k. A packed batch holds
    several sequences' contexts one after another: ``starts[i]`` is the key index where block i's sequence
    begins (None: a single sequence, all 0). A query sees context keys starts[i] + p for p < a, i.e. only
    its own sequence's positions before its anchor (the document-id comparison of a packed mask: a
    sequence's context is one contiguous range), and its own block: all B slots in full-attention layers;
    in sliding layers slots <= k, and only keys less than ``sliding_window`` RoPE positions back. Blocks
    never see each other. ``causal`` True/False: slots <= k in every layer, or all slots (within the window).
    """
    sliding = layer_type == "sliding_attention"
    causal = sliding if causal is None else causal
    if sliding and sliding_window is None:
        raise ValueError("sliding_attention layer without a sliding_window")
    n, device = anchors.shape[0], anchors.device
    block = torch.arange(n, device=device).repeat_interleave(B)
    slot = torch.arange(B, device=device).repeat(n)
    anchor = anchors[block]
    start = starts.to(device)[block] if starts is not None else torch.zeros_like(anchor)
    ctx_lo, ctx_hi = start, start + anchor
    first = T + block * B
    blk_lo, blk_hi = first, first + (slot + 1 if causal else B)
    if sliding:  # empty context range (lo >= hi) when the window ends inside the block
        ctx_lo = start + (anchor + slot - sliding_window + 1).clamp(min=0)
        blk_lo = first + (slot - sliding_window + 1).clamp(min=0)
        if not causal:
            blk_hi = first + (slot + sliding_window).clamp(max=B)
    return ctx_lo, ctx_hi, blk_lo, blk_hi


def dflash_mask_mod(anchors: torch.Tensor, T: int, B: int, layer_type: str, sliding_window: int | None,
                    starts: torch.Tensor | None = None, causal: bool | None = None):
    """The training mask (``block_key_ranges``) as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""
    return _ranges_mask_mod(block_key_ranges(anchors, T, B, layer_type, sliding_window, starts, causal))


def _ranges_mask_mod(ranges):
    ctx_lo, ctx_hi, blk_lo, blk_hi = ranges

    def mask_mod(b, h, q_idx, kv_idx):
        in_ctx = (kv_idx >= ctx_lo[q_idx]) & (kv_idx < ctx_hi[q_idx])
        return in_ctx | ((kv_idx >= blk_lo[q_idx]) & (kv_idx < blk_hi[q_idx]))

    return mask_mod


def dense_attention_mask(anchors, T: int, B: int, layer_type: str, sliding_window: int | None,
                         starts: torch.Tensor | None = None, causal: bool | None = None) -> torch.Tensor:
    """``dflash_mask_mod`` evaluated densely: BoolTensor [n*B, T + n*B], True = may attend."""
    n = anchors.shape[0]
    q_idx = torch.arange(n * B, device=anchors.device)[:, None]
    kv_idx = torch.arange(T + n * B, device=anchors.device)[None, :]
    return dflash_mask_mod(anchors, T, B, layer_type, sliding_window, starts, causal)(None, None, q_idx, kv_idx)


def dense_sequence_masks(anchors, lengths: list[int], block_counts: list[int], B: int, layer_type: str,
                         sliding_window: int | None,
                         causal: bool | None = None) -> list[tuple[slice, slice, torch.Tensor]]:
    """The dense path of a packed batch: per sequence (blocks in sequence order, ``block_counts[s]`` of them),
    its query slice, its context slice and its own ``dense_attention_mask``. Laid side by side on the packed
    [queries, keys] grid (and all else False), they are ``dense_attention_mask`` of the pack."""
    segments, ctx, blk = [], 0, 0
    for T, n in zip(lengths, block_counts):
        mask = dense_attention_mask(anchors[blk : blk + n], T, B, layer_type, sliding_window, causal=causal)
        segments.append((slice(blk * B, (blk + n) * B), slice(ctx, ctx + T), mask))
        ctx, blk = ctx + T, blk + n
    return segments


def flex_block_mask(anchors, T: int, B: int, layer_type: str, sliding_window: int | None,
                    starts: torch.Tensor | None = None, tile: int = 128, causal: bool | None = None):
    """``dflash_mask_mod`` as a FlexAttention ``BlockMask`` (tiles of ``tile`` queries x ``tile`` keys), built
    from the key ranges: a tile is empty, full or partial by how many of its pairs the ranges cover. The
    same tiles as ``create_block_mask``, without materialising the [queries, keys] mask it evaluates, which
    is quadratic in a packed batch's size."""
    Q, K = anchors.shape[0] * B, T + anchors.shape[0] * B
    q_tiles, k_tiles = -(-Q // tile), -(-K // tile)
    ranges = block_key_ranges(anchors, T, B, layer_type, sliding_window, starts, causal)
    # padded to whole query tiles with empty ranges: the kernel may call mask_mod on the padding rows
    ranges = [F.pad(r, (0, q_tiles * tile - Q)) for r in ranges]
    begin = torch.arange(k_tiles, device=anchors.device) * tile
    covered = sum((torch.minimum(hi[:, None], begin + tile) - torch.maximum(lo[:, None], begin)).clamp(min=0)
                  for lo, hi in (ranges[:2], ranges[2:]))  # [queries, key tiles]: pairs of each range in each tile
    covered = covered.view(q_tiles, tile, k_tiles).sum(1)
    full = covered == tile * tile  # a ragged last tile is never full: create_block_mask pads with False too

    def ordered(tiles):  # [q_tiles, k_tiles] bool -> per row: the count and the tile indices, present first
        tiles = tiles[None, None].to(torch.int32)
        return (tiles.sum(-1).to(torch.int32),
                torch.argsort(tiles, dim=-1, descending=True, stable=True).to(torch.int32))

    return BlockMask.from_kv_blocks(*ordered((covered > 0) & ~full), *ordered(full), BLOCK_SIZE=tile,
                                    mask_mod=_ranges_mask_mod(ranges), seq_lengths=(Q, K))

