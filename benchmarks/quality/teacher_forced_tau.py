"""τ of a drafter on fixed greedy responses, teacher-forced: a check of the speculative loop and of the
validation proxy against what speculative decoding measured.

    python benchmarks/quality/teacher_forced_tau.py --drafter DIR --target DIR --result result.json [--limit N]

``result.json``: an evaluation result (its rows' ``output_ids`` are the target's greedy responses, its prompts'
rendering comes from ``--prompts``, MT-Bench by default). For each response, one target forward over prompt +
response gives the drafter's features; the drafter then drafts a block at *every* response position (features of
the positions before it, as in training and inference). Printed per response and overall:
- **path τ**: the greedy speculative loop replayed on those blocks (anchor at the first response token; a block
  that matches k drafts commits k + 1 tokens and the next anchor is k + 1 further). Greedy decoding is lossless,
  so this is what speculative decoding must measure up to numerics (incremental vs one-pass features);
- **all-anchors proxy**: the mean of (leading matches + 1) over every response position, the quantity the
  trainer's validation estimates (on its own samples, with random anchors).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import replayed_tau, teacher_forced_matches  # noqa: E402

from dflash_pipeline.drafter import load_dflash
from dflash_pipeline.evaluate import MT_BENCH, load_prompts
from dflash_pipeline.speculative import TargetSession
from dflash_pipeline.target import load_target, load_tokenizer


@torch.no_grad()
def block_matches(model, drafter, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """``teacher_forced_matches`` of one response, its features from one target forward."""
    ids = torch.tensor(prompt_ids + output_ids)
    session = TargetSession(model, drafter.config.target_layer_ids)  # the features speculative decoding captures
    try:
        features = session.forward(ids.tolist())[1][None]
    finally:
        session.close()
    return teacher_forced_matches(drafter, features, ids, len(prompt_ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--result", required=True, help="an evaluation result.json with rows[].output_ids")
    parser.add_argument("--prompts", default=MT_BENCH)
    parser.add_argument("--limit", type=int)
    args = parser.parse_args()
    model = load_target(args.target, dtype="float32", device="cpu")
    drafter = load_dflash(args.drafter, model.get_input_embeddings(), model.get_output_embeddings(),
                          dtype=torch.float32).eval()
    prompts = load_prompts(args.prompts, load_tokenizer(args.target))
    rows = json.load(open(args.result))["rows"][: args.limit]
    committed = steps = 0
    proxies, taus = [], []
    for row in rows:
        matches = block_matches(model, drafter, prompts[row["index"]]["prompt_ids"], row["output_ids"])
        if not matches:
            continue
        c, s = replayed_tau(matches)
        committed, steps = committed + c, steps + s
        taus.append(c / s)
        proxies.append(sum(m + 1 for m in matches) / len(matches))
        print(f"prompt {row['id']}: {len(row['output_ids'])} tokens, path tau {c / s:.2f}, "
              f"all-anchors proxy {proxies[-1]:.2f}", flush=True)
    print(f"{len(taus)} responses: path tau mean {sum(taus) / len(taus):.3f}, pooled {committed / steps:.3f}; "
          f"all-anchors proxy mean {sum(proxies) / len(proxies):.3f}")


if __name__ == "__main__":
    main()
