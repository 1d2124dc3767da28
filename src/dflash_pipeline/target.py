"""Loading the target model and its tokenizer: a local checkpoint, a hub id, or a GGUF file."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from .atomic import atomic_path

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gguf_args(source: str) -> tuple[str, dict]:
    """Split ``dir/file.gguf`` into the directory and the ``gguf_file`` keyword transformers expects."""
    path = Path(source)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return source, {}


def load_tokenizer(source: str, *, revision: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    location, extra = _gguf_args(source)
    return AutoTokenizer.from_pretrained(location, revision=revision, trust_remote_code=trust_remote_code, **extra)


def load_target(
    source: str,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """Load a causal LM for inference (eval mode, no gradients) on ``device``."""
    location, extra = _gguf_args(source)
    model = AutoModelForCausalLM.from_pretrained(
        location,
        revision=revision,
        dtype=DTYPES[dtype],
        trust_remote_code=trust_remote_code,
        **extra,
    )
    model.requires_grad_(False)
    return model.eval().to(device)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> None:
    """Dequantise a GGUF checkpoint once into a safetensors checkpoint with its tokenizer.

    Loading a GGUF dequantises every tensor on every load (~15 s for SmolLM2 on 2 cores); the
    converted directory loads in about a second and is what every later rule reads.
    """
    gguf_path = Path(gguf_path)
    quantised = load_target(str(gguf_path), dtype=dtype)
    tokenizer = load_tokenizer(str(gguf_path))
    config = quantised.config
    del config.quantization_config  # the weights saved below are plain dequantised tensors
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    model.load_state_dict(quantised.state_dict())
    with atomic_path(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (Path(tmp) / "conversion.json").write_text(
            json.dumps({"source": gguf_path.name, "sha256": file_sha256(gguf_path), "dtype": dtype}, indent=2)
        )


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def text_config(config):
    """The language-model part of a config (multimodal configs keep it under ``text_config``)."""
    return getattr(config, "text_config", None) or config


def num_hidden_layers(source: str, *, revision: str | None = None, trust_remote_code: bool = False) -> int:
    location, extra = _gguf_args(source)
    config = AutoConfig.from_pretrained(location, revision=revision, trust_remote_code=trust_remote_code, **extra)
    return text_config(config).num_hidden_layers


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder layers of a causal LM, whatever its wrapper layout."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    base = getattr(base, "language_model", base)
    return base.layers


def tokenizer_hashes(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """Hashes that identify the vocabulary and the chat template (recorded in store manifests)."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    template = (tokenizer.chat_template or "").encode()
    return {
        "tokenizer_sha256": hashlib.sha256(vocab).hexdigest(),
        "chat_template_sha256": hashlib.sha256(template).hexdigest(),
    }


def default_target_layer_ids(num_target_layers: int, k: int = 5) -> list[int]:
    """K layer ids spread from 1 to L-3: ``round(1 + i*(L-4)/(K-1))`` (Python's round, half to even).

    [1, 8, 14, 20, 27] for 30 layers, [1, 9, 17, 25, 33] for 36, [1, 16, 31, 46, 61] for 64.
    """
    if k < 1 or num_target_layers < 4:
        raise ValueError(f"need k >= 1 and at least 4 target layers, got k={k}, L={num_target_layers}")
    if k == 1:
        return [1]
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


def resolve_layer_ids(layer_ids: list[int] | None, num_layers: int, num_target_layers: int) -> list[int]:
    """The configured ids, checked against the target's depth, or the default rule."""
    ids = list(layer_ids) if layer_ids else default_target_layer_ids(num_target_layers, num_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"extract.layer_ids {bad} out of range: the target has layers 0..{num_target_layers - 1}")
    return ids
