"""The drafter's checkpoint format (what vLLM, SGLang and z-lab load), and the target tensors it borrows (the
frozen embedding and LM head, the final norm)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .model import DFlashConfig, DFlashDrafter

EXPORT_PREFIXES = ("layers.", "fc.weight", "hidden_norm.weight", "norm.weight")


def export_config_dict(config: DFlashConfig) -> dict:
    d = config.to_dict()
    for key in ("target_layer_ids", "mask_token_id", "transformers_version", "_name_or_path"):
        d.pop(key, None)
    d.update(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=config.block_size,
             num_target_layers=config.num_target_layers, layer_types=list(config.layer_types),
             rope_theta=config.rope_parameters["rope_theta"],
             dflash_config={"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)})
    return d


def config_from_export_dict(d: dict) -> DFlashConfig:
    d = dict(d)
    dflash = d.pop("dflash_config", {})
    for key in ("architectures", "model_type", "transformers_version", "auto_map"):
        d.pop(key, None)  # a legacy top-level rope_theta is converted by transformers; rope_parameters wins
    d.setdefault("block_size", dflash.get("block_size", 16))
    return DFlashConfig(**d, target_layer_ids=dflash["target_layer_ids"], mask_token_id=dflash["mask_token_id"])


def save_dflash(drafter: DFlashDrafter, directory, dtype: torch.dtype | None = None) -> Path:
    """Write config.json and model.safetensors (only layers.*, fc, hidden_norm, norm); each file atomically."""
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
    """Load a DFlash checkpoint (safetensors only); dtype defaults to the stored weights' dtype."""
    directory = Path(directory)
    config = config_from_export_dict(json.loads((directory / "config.json").read_text()))
    state = load_file(str(directory / "model.safetensors"))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(state, strict=True)
    drafter.to(dtype or next(iter(state.values())).dtype)
    if embed_tokens is not None or lm_head is not None:
        drafter.attach_target(embed_tokens, lm_head)
    return drafter


EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")


def _weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a checkpoint (single file, directory, or sharded with an index)."""
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = path / "model.safetensors"
            files = [single] if single.exists() else sorted(path.glob("*.safetensors"))
            weight_map = {}
            for file in files:
                with safe_open(str(file), "pt") as f:
                    weight_map.update(dict.fromkeys(f.keys(), file))
    else:
        with safe_open(str(path), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), path)
    return weight_map


def load_target_tensor(path_or_dir, names: tuple[str, ...]) -> torch.Tensor:
    """The first of ``names`` that the target's safetensors hold."""
    weight_map = _weight_map(Path(path_or_dir))
    name = next((n for n in names if n in weight_map), None)
    if name is None:
        raise KeyError(f"{path_or_dir}: none of {names} in its safetensors")
    with safe_open(str(weight_map[name]), "pt") as f:
        return f.get_tensor(name)


def load_target_embeddings(path_or_dir, dtype: torch.dtype | None = None) -> tuple[nn.Embedding, nn.Linear]:
    """Read only the target's input embedding and LM head from its safetensors (single file, directory,
    or sharded with model.safetensors.index.json). Tied embeddings (no lm_head.weight, or
    tie_word_embeddings true in config.json) share one frozen weight."""
    path = Path(path_or_dir)
    directory = path if path.is_dir() else path.parent
    weight_map = _weight_map(path)

    def read(name):
        with safe_open(str(weight_map[name]), "pt") as f:
            tensor = f.get_tensor(name)
        return tensor.to(dtype) if dtype is not None else tensor

    embed_name = next((n for n in EMBED_NAMES if n in weight_map), None)
    if embed_name is None:
        raise KeyError(f"{path}: no input embedding among {EMBED_NAMES}")
    tie = "lm_head.weight" not in weight_map
    config_file = directory / "config.json"
    if config_file.exists():
        cfg = json.loads(config_file.read_text())
        tie = tie or bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
    weight = read(embed_name)
    embed = nn.Embedding(*weight.shape, _weight=weight, _freeze=True)
    lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lm_head.weight = embed.weight if tie else nn.Parameter(read("lm_head.weight"), requires_grad=False)
    return embed, lm_head
