"""The Qwen3.6-27B example's exported drafter config.json beside the published ``z-lab/Qwen3.6-27B-DFlash`` one, field by
field (the table in docs/serving.md).

The drafter is built as the train job builds it, on the meta device (no weights): the train section of
config/config.yaml merged with config/examples/qwen3.6-27b.yaml and validated by config/schema.yaml, the target's
config.json (Qwen3.6-27B's, ``tests/data/qwen3.6-27b.config.json``) and the example's ``extract.layer_ids``; then
exported as ``save_dflash`` writes config.json (``dtype`` from ``train.export_dtype``). The published config is
SpecForge's copy, ``configs/qwen3.6-27b-dflash.json`` (``tests/data/qwen3.6-27b-dflash.published.json``).

    python benchmarks/quality/serving_config_table.py > table.md
    # the DFlash2 example (an overlay on the DFlash one) beside SpecForge's configs/qwen3.6-27b-dflash2.json
    python benchmarks/quality/serving_config_table.py --overlay config/examples/qwen3.6-27b-dflash2.yaml \
        --published tests/data/qwen3.6-27b-dflash2.published.json > table.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import yaml
from snakemake.utils import update_config, validate
from transformers import AutoConfig

from dflash_pipeline.drafter import DFlashDrafter, architecture_kwargs, export_config_dict

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [ROOT / "config" / "config.yaml", ROOT / "config" / "examples" / "qwen3.6-27b.yaml"]
TARGET = ROOT / "tests" / "data" / "qwen3.6-27b.config.json"
PUBLISHED = ROOT / "tests" / "data" / "qwen3.6-27b-dflash.published.json"
# Which engine reads a field of the drafter's config (vLLM's qwen3_dflash, SGLang's dflash / dflash_utils;
# both also build the layers from the Qwen3 shape fields).
READ_BY = {
    "dflash_config.mask_token_id": "vLLM, SGLang", "dflash_config.target_layer_ids": "vLLM (+1), SGLang",
    "dflash_config.causal": "vLLM", "dflash_config.use_swa": "vLLM", "dflash_config.swa_window_size": "vLLM",
    "layer_types": "vLLM, SGLang", "sliding_window": "vLLM, SGLang", "target_hidden_size": "vLLM",
    "draft_vocab_size": "vLLM", "block_size": "SGLang", "num_target_layers": "SGLang",
    "architectures": "vLLM, SGLang (the drafter class)", "is_causal": "vLLM",
    **dict.fromkeys(("dflash_config.block_size", "dflash_config.conv_kernel_size", "dflash_config.conv_group_size",
                     "dflash_config.selector_rank", "dflash_config.selector_top_k"), "vLLM, SGLang (DFlash2)"),
    **dict.fromkeys(("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                     "max_position_embeddings", "vocab_size", "attention_bias", "hidden_act"), "vLLM, SGLang"),
}


def merged_config(paths=CONFIGS) -> dict:
    config: dict = {}
    for path in paths:
        update_config(config, yaml.safe_load(Path(path).read_text()))
    validate(config, str(ROOT / "config" / "schema.yaml"))
    return config


def example_export(paths=CONFIGS, target_config_file=TARGET) -> dict:
    """The config.json the train job would export for the example (a drafter built on the meta device)."""
    config = merged_config(paths)
    fields = json.loads(Path(target_config_file).read_text())
    target_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        drafter = DFlashDrafter.from_target_config(target_config, mask_token_id=config["train"]["mask_token_id"],
                                                   target_layer_ids=config["extract"]["layer_ids"],
                                                   **architecture_kwargs(config["train"]))
    exported = export_config_dict(drafter.config)
    exported["dtype"] = config["train"]["export_dtype"]
    return exported


def flatten(config: dict) -> dict:
    """Top-level fields, and ``dflash_config``'s as ``dflash_config.<key>``."""
    flat = {k: v for k, v in config.items() if k != "dflash_config"}
    flat.update({f"dflash_config.{k}": v for k, v in (config.get("dflash_config") or {}).items()})
    return flat


def table(ours: dict, published: dict) -> str:
    ours, published = flatten(ours), flatten(published)
    missing = object()
    lines = ["| field | this pipeline's export | published | read by |", "|---|---|---|---|"]
    for key in sorted(set(ours) | set(published)):
        a, b = ours.get(key, missing), published.get(key, missing)
        show = [("—" if v is missing else f"`{json.dumps(v)}`") for v in (a, b)]
        same = a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))
        mark = "" if same else " ≠"
        lines.append(f"| `{key}`{mark} | {show[0]} | {show[1]} | {READ_BY.get(key, '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", default=str(PUBLISHED))
    parser.add_argument("--target-config", default=str(TARGET))
    parser.add_argument("--overlay", action="append", default=[], help="config overlays after the 27B example")
    args = parser.parse_args()
    exported = example_export([*CONFIGS, *args.overlay], target_config_file=args.target_config)
    print(table(exported, json.loads(Path(args.published).read_text())))


if __name__ == "__main__":
    main()
