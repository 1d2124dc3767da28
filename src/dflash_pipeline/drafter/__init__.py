"""The DFlash drafter (docs/design.md, "DFlash, precisely"): ``config`` (its config, the train keys that shape it, its
config.json form), ``mask_token`` (which token fills the drafted slots), ``model`` (the layers and forward paths),
``dflash2`` (what a DFlash2 drafter adds: the convolutions and the candidate selector),
``masks`` (the attention masks of packed blocks), ``checkpoint`` (the exported format). The target tensors it borrows
(frozen embedding and LM head, final norm) are read by ``target``; re-exported here."""

from ..target import default_target_layer_ids, load_target_embeddings, load_target_tensor
from .checkpoint import load_dflash, save_dflash
from .config import (
    ARCHITECTURE_KEYS,
    DFlashConfig,
    architecture_kwargs,
    config_from_export_dict,
    dflash_config_from_target,
    export_config_dict,
)
from .mask_token import resolve_mask_token_id
from .masks import (
    block_key_ranges,
    dense_attention_mask,
    dense_sequence_masks,
    dflash_mask_mod,
    flex_block_mask,
)
from .model import ContextCache, DFlashDrafter, decoder_layer_pass

__all__ = [
    "ARCHITECTURE_KEYS", "ContextCache", "DFlashConfig", "DFlashDrafter", "architecture_kwargs", "block_key_ranges",
    "config_from_export_dict", "decoder_layer_pass", "default_target_layer_ids", "dense_attention_mask",
    "dense_sequence_masks", "dflash_config_from_target", "dflash_mask_mod", "export_config_dict", "flex_block_mask",
    "load_dflash", "load_target_embeddings", "load_target_tensor", "resolve_mask_token_id", "save_dflash",
]
