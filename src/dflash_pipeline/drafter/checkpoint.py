"""The drafter's checkpoint format (what vLLM, SGLang and z-lab load): ``model.safetensors`` with the drafter's own
weights and ``config.json`` (``config.export_config_dict``; docs/serving.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import config_from_export_dict, export_config_dict
from .model import DFlashDrafter

EXPORT_PREFIXES = ("layers.", "fc.weight", "hidden_norm.weight", "norm.weight", "candidate_selector.")
# the selector's codebooks: stored without ``.weight`` (the published DFlash2 checkpoints); ``dflash``'s own
# save_pretrained writes them with it
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def save_dflash(drafter: DFlashDrafter, directory, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors (only layers.*, fc, hidden_norm, norm and a DFlash2 drafter's
    candidate_selector.*); each file atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu()
               for k, v in drafter.state_dict().items() if k.startswith(EXPORT_PREFIXES)}
    tmp = directory / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, directory / "model.safetensors")
    config = export_config_dict(drafter.config)
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, directory / "config.json")
    return directory


def load_dflash(directory, embed_tokens: nn.Module | None = None, lm_head: nn.Module | None = None,
                dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load a DFlash or DFlash2 checkpoint (safetensors only); dtype defaults to the stored weights' dtype."""
    directory = Path(directory)
    config = config_from_export_dict(json.loads((directory / "config.json").read_text()))
    state = {key.removesuffix(".weight") if key.removesuffix(".weight") in CODEBOOKS else key: value
             for key, value in load_file(str(directory / "model.safetensors")).items()}
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state, strict=True)
    drafter.to(dtype or next(iter(state.values())).dtype)
    if embed_tokens is not None or lm_head is not None:
        drafter.attach_target(embed_tokens, lm_head)
    return drafter
