"""Loading the target model and its tokenizer: a local checkpoint, a hub id, or a GGUF file.

Vision-language checkpoints of the hybrid Qwen3.5/3.6 family (``model_type: qwen3_5``,
``Qwen3_5ForConditionalGeneration``) are loaded text-only (docs/design.md, "Hybrid targets"): the text-only causal
LM is built from ``config.text_config`` and only the language-model tensors are read from the
safetensors (``model.language_model.*`` renamed to ``model.*``, plus ``lm_head.*``); the vision tower
(``model.visual.*``) and the multi-token-prediction head (``mtp.*``) are never read.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
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


# Multimodal model types whose local checkpoints are loaded text-only by ``load_language_model``:
# model_type -> (prefix of the language-model tensors in the checkpoint, prefixes of tensors to skip).
LANGUAGE_MODEL_ONLY = {
    "qwen3_5": ("model.language_model.", ("model.visual.", "mtp.")),
}


def load_target(
    source: str,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    revision: str | None = None,
    trust_remote_code: bool = False,
    random_weights_seed: int | None = None,
) -> nn.Module:
    """Load a causal LM for inference (eval mode, no gradients) on ``device``.

    Routed by the config: a local checkpoint of a ``LANGUAGE_MODEL_ONLY`` type loads text-only through
    ``load_language_model``; everything else (plain text checkpoints such as ``qwen3_5_text`` or
    ``qwen3_next``, hub ids, GGUF files) through ``AutoModelForCausalLM``. ``random_weights_seed``: read no
    weights; build the (text) model from the checkpoint's config.json with seeded random weights, created on
    ``device`` (for speed benchmarks of a model shape, e.g. a 27B hybrid nobody has to download).
    """
    location, extra = _gguf_args(source)
    config = None
    if not extra and Path(location).is_dir():
        config = AutoConfig.from_pretrained(location, trust_remote_code=trust_remote_code)
    if random_weights_seed is not None:
        if config is None:
            raise ValueError(f"random weights need a local checkpoint directory with a config.json, not {source}")
        log.warning("%s: random weights (seed %d), no checkpoint tensors read: for speed measurements only",
                    location, random_weights_seed)
        torch.manual_seed(random_weights_seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(text_config(config), dtype=DTYPES[dtype])
    elif config is not None and config.model_type in LANGUAGE_MODEL_ONLY:
        model = load_language_model(location, config, dtype=dtype, device=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            location,
            revision=revision,
            dtype=DTYPES[dtype],
            trust_remote_code=trust_remote_code,
            # weights only from safetensors (or the GGUF): never a pickle-based pytorch_model.bin
            **(extra or {"use_safetensors": True}),
        )
    model.requires_grad_(False)
    model = model.eval().to(device)
    warn_slow_linear_attention(model, device)
    return model


def _safetensors_weight_map(directory: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a checkpoint directory (sharded with an index, or not)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return {name: directory / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    weight_map = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            weight_map.update(dict.fromkeys(handle.keys(), file))
    if not weight_map:
        raise FileNotFoundError(f"{directory}: no safetensors weights")
    return weight_map


def load_language_model(directory: str | Path, config, *, dtype: str = "float32",
                        device: str | torch.device = "cpu") -> nn.Module:
    """The text-only causal LM of a multimodal checkpoint (``LANGUAGE_MODEL_ONLY``), e.g.
    ``Qwen3_5ForCausalLM`` from ``config.text_config`` for a ``Qwen3_5ForConditionalGeneration`` checkpoint.

    The model is built with its parameters on the meta device, then exactly the tensors it needs are read
    with ``safe_open`` straight onto ``device`` (``<prefix>X`` -> ``model.X``, ``lm_head.*`` as is). Tensors
    under the skipped prefixes (vision tower, MTP head) are never read. Any other checkpoint tensor, or a
    model parameter the checkpoint lacks (other than a tied LM head), is an error naming the keys.
    """
    directory = Path(directory)
    prefix, skipped = LANGUAGE_MODEL_ONLY[config.model_type]
    text = text_config(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(text, dtype=DTYPES[dtype])
    tied = bool(getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False))
    expected = set(model.state_dict())
    if tied:
        expected.discard("lm_head.weight")

    weight_map = _safetensors_weight_map(directory)
    renamed, unexpected = {}, []
    for name in weight_map:
        if name.startswith(skipped):
            continue
        new = "model." + name[len(prefix):] if name.startswith(prefix) else name
        if new in expected and new not in renamed:
            renamed[new] = name
        else:
            unexpected.append(name)
    missing = sorted(expected - set(renamed))
    if missing or unexpected:
        raise ValueError(
            f"{directory}: the {config.model_type} checkpoint does not match {type(model).__name__} "
            f"(language model under {prefix!r}, skipping {', '.join(skipped)}): "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
            f"unexpected {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)})"
        )

    by_file: dict[Path, list[str]] = {}
    for new, name in renamed.items():
        by_file.setdefault(weight_map[name], []).append(new)
    device_name = str(torch.device(device))
    state = {}
    for file, names in by_file.items():
        with safe_open(str(file), "pt", device=device_name) as handle:
            for new in names:
                state[new] = handle.get_tensor(renamed[new]).to(DTYPES[dtype])
    model.load_state_dict(state, strict=not tied, assign=True)
    if tied:
        model.tie_weights()
    meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if meta:
        raise RuntimeError(f"{directory}: tensors left unloaded: {meta[:8]}")
    model.name_or_path = model.config.name_or_path = str(directory)
    log.info("%s: loaded the language model only (%d tensors as %s)", directory, len(state), type(model).__name__)
    return model


def has_linear_attention(model: nn.Module) -> bool:
    """Whether the model has Gated-DeltaNet (linear-attention) layers."""
    return any(type(module).__name__.endswith("GatedDeltaNet") for module in model.modules())


def _fla_importable() -> bool:
    try:
        importlib.import_module("fla")
    except Exception:  # not installed, or its import fails (e.g. no Triton): transformers falls back too
        return False
    return True


def warn_slow_linear_attention(model: nn.Module, device: str | torch.device) -> str | None:
    """Log one warning line when a Gated-DeltaNet target will not run the flash-linear-attention kernels
    (not installed, or no CUDA device); returns the message (None when the fast path is used)."""
    if not has_linear_attention(model):
        return None
    on_cuda = torch.device(device).type == "cuda"
    fla = _fla_importable()
    if fla and on_cuda:
        return None
    if not on_cuda and fla:
        message = (f"flash-linear-attention is installed but the target runs on {torch.device(device).type}: "
                   "transformers calls its Triton kernels, which need a GPU (uninstall it for CPU runs)")
    elif not on_cuda:
        message = (f"Gated-DeltaNet layers on {torch.device(device).type} use transformers' slow PyTorch path "
                   "(flash-linear-attention kernels need a GPU)")
    else:
        message = ("flash-linear-attention not installed: Gated-DeltaNet layers use transformers' slow PyTorch "
                   "path (install flash-linear-attention for GPU speed)")
    log.warning(message)
    return message


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


# The text-config fields that stored features and a drafter depend on: what "the same target" means to a store.
TARGET_CONFIG_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                      "num_attention_heads", "num_key_value_heads", "layer_types")


def target_config_hashes(source, *, revision: str | None = None, trust_remote_code: bool = False) -> dict:
    """``target_config`` (the ``TARGET_CONFIG_KEYS`` of the text config) and its ``target_config_sha256``, for
    store manifests; ``source`` is a config or a target path / hub id / .gguf."""
    config = source
    if isinstance(source, (str, Path)):
        location, extra = _gguf_args(str(source))
        config = AutoConfig.from_pretrained(location, revision=revision, trust_remote_code=trust_remote_code, **extra)
    text = text_config(config)
    shape = {key: getattr(text, key, None) for key in TARGET_CONFIG_KEYS}
    return {"target_config": shape,
            "target_config_sha256": hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()}


def default_target_layer_ids(num_target_layers: int, k: int = 5) -> list[int]:
    """K layer ids spread from 1 to L-3: ``round(1 + i*(L-4)/(K-1))`` (Python's round, half to even); one layer: the
    middle one, L // 2. z-lab's ``build_target_layer_ids``, the same ids.

    [1, 8, 14, 20, 27] for 30 layers, [1, 9, 17, 25, 33] for 36, [1, 16, 31, 46, 61] for 64.
    """
    if k < 1 or num_target_layers < 4:
        raise ValueError(f"need k >= 1 and at least 4 target layers, got k={k}, L={num_target_layers}")
    if k == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


def resolve_layer_ids(layer_ids: list[int] | None, num_layers: int, num_target_layers: int) -> list[int]:
    """The configured ids, checked against the target's depth, or the default rule."""
    ids = list(layer_ids) if layer_ids else default_target_layer_ids(num_target_layers, num_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"extract.layer_ids {bad} out of range: the target has layers 0..{num_target_layers - 1}")
    return ids


EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "embed_tokens.weight")


def _weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a checkpoint: a single file, or a directory (sharded or not)."""
    if path.is_dir():
        return _safetensors_weight_map(path)
    with safe_open(str(path), "pt") as handle:
        return dict.fromkeys(handle.keys(), path)


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
