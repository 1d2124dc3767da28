"""The drafter a run starts from: checked against the store's target, seeded, on its device, compiled on GPU."""

from __future__ import annotations

import torch

from ..drafter import DFlashDrafter, architecture_kwargs, load_target_embeddings, resolve_mask_token_id
from ..drafter.mask_token import target_stop_configs
from ..store import HiddenStateStore
from .config import TrainConfig


def check_target(store: HiddenStateStore, target: str, tokenizer, target_config) -> None:
    """Refuse a target other than the one the store was built for (tokenizer, chat template, config hashes), and a
    store of a random-weight target's features."""
    from ..target import target_config_hashes, text_config, tokenizer_hashes

    if store.attrs.get("random_weights_seed") is not None:
        raise ValueError(f"{store.path} holds features of a random-weight target (target.random_weights_seed "
                         f"{store.attrs['random_weights_seed']}): a speed measurement, not training data")
    manifest, actual = store.manifest, {**tokenizer_hashes(tokenizer), **target_config_hashes(target_config)}
    differ = [f"{key}: store {manifest[key]} != target {value}" for key, value in actual.items()
              if key.endswith("_sha256") and manifest.get(key) not in (None, value)]
    recorded = manifest.get("target_config") or {}
    differ += [f"{key}: store {recorded[key]} != target {value}" for key, value in actual["target_config"].items()
               if key in recorded and recorded[key] != value]
    hidden = text_config(target_config).hidden_size
    if store.attrs.get("hidden_size") not in (None, hidden) and "hidden_size" not in recorded:  # older manifests
        differ.append(f"hidden_size: store {store.attrs['hidden_size']} != target {hidden}")
    if differ:
        raise ValueError(f"{target} is not the target the store {store.path} was built for: " + "; ".join(differ))


def build_drafter(cfg: TrainConfig, store: HiddenStateStore, target: str, device, dtype) -> DFlashDrafter:
    """A fresh drafter for the target, layer ids from the store, the target's frozen embedding and LM head."""
    from transformers import AutoConfig

    from ..target import load_tokenizer

    tokenizer = load_tokenizer(target)
    target_config = AutoConfig.from_pretrained(target)
    check_target(store, target, tokenizer, target_config)
    embed, lm_head = load_target_embeddings(target, dtype=dtype)
    mask_token_id = resolve_mask_token_id(tokenizer, embed.weight.shape[0], cfg.mask_token_id,
                                          target_configs=target_stop_configs(target, target_config))
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter.from_target_config(
        target_config, mask_token_id=mask_token_id, target_layer_ids=store.attrs["layer_ids"], embed_tokens=embed,
        lm_head=lm_head, **architecture_kwargs(cfg))
    return configure_for_training(drafter.to(device), cfg)


def configure_for_training(drafter: DFlashDrafter, cfg: TrainConfig) -> DFlashDrafter:
    """A drafter on its device set up as ``cfg`` trains it: the selector's loss weight (DFlash2), gradient
    checkpointing, FlexAttention's kernel options and, on CUDA, the compile mode."""
    drafter.selector_loss_weight = cfg.selector_loss_weight  # read by train.step.selector_loss (DFlash2)
    drafter.gradient_checkpointing = cfg.gradient_checkpointing
    drafter.set_flex_kernel_options(cfg.flex_kernel_options)
    if cfg.compile and drafter.fc.weight.is_cuda:
        drafter.compile_layers() if cfg.compile_layers else drafter.compile_pointwise()
    return drafter

