#!/usr/bin/env python3
"""Write a target directory for a random-weight speed run: the config.json of a Qwen3.5-27B-shaped hybrid
(``common.hybrid_config``, the shape of ``extract_speed.py``; change it with the same options) and a tokenizer
copied from another checkpoint, no weights. The workflow builds the model from it with ``target.random_weights_seed``.

    python3 benchmarks/speed/make_random_target.py --tokenizer .gpu/smol_config --out results/targets/qwen3_5_27b
"""

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import add_hybrid_shape_arguments, hybrid_config  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a checkpoint directory whose tokenizer files are copied")
    p.add_argument("--out", required=True)
    add_hybrid_shape_arguments(p)
    args = p.parse_args()
    config = hybrid_config(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(args.tokenizer) / name).exists():
            shutil.copy(Path(args.tokenizer) / name, out / name)
    print(f"{out}: {config.model_type}, {config.num_hidden_layers} layers, D {config.hidden_size}, "
          f"vocab {config.vocab_size}; tokenizer from {args.tokenizer}")


if __name__ == "__main__":
    main()
