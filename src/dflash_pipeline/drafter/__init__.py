"""The DFlash drafter (docs/design.md, "DFlash, precisely"): ``model`` (the config, layers and forward paths),
``masks`` (the attention masks of packed blocks), ``checkpoint`` (the exported format and the target tensors it
borrows)."""

from ..target import default_target_layer_ids
from .checkpoint import (
    config_from_export_dict,
    export_config_dict,
    load_dflash,
    load_target_embeddings,
    load_target_tensor,
    save_dflash,
)
from .masks import (
    block_key_ranges,
    dense_attention_mask,
    dense_sequence_masks,
    dflash_mask_mod,
    flex_block_mask,
)
from .model import (
    ContextCache,
    DFlashConfig,
    DFlashDrafter,
    decoder_layer_pass,
    dflash_config_from_target,
    resolve_mask_token_id,
)

__all__ = [
    "ContextCache", "DFlashConfig", "DFlashDrafter", "block_key_ranges", "config_from_export_dict",
    "decoder_layer_pass", "default_target_layer_ids", "dense_attention_mask", "dense_sequence_masks",
    "dflash_config_from_target", "dflash_mask_mod", "export_config_dict", "flex_block_mask", "load_dflash",
    "load_target_embeddings", "load_target_tensor", "resolve_mask_token_id", "save_dflash",
]
