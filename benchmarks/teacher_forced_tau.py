"""τ of a drafter on fixed greedy responses, teacher-forced: a check of the speculative loop and of the
validation proxy against what speculative decoding measured.

    python benchmarks/teacher_forced_tau.py --drafter DIR --target DIR --result result.json [--limit N]

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

import torch

from dflash_pipeline.drafter import load_dflash
from dflash_pipeline.evaluate import MT_BENCH, load_prompts
from dflash_pipeline.losses import acceptance_proxy, make_block_token_ids
from dflash_pipeline.speculative import TargetSession
from dflash_pipeline.target import load_target, load_tokenizer


@torch.no_grad()
def block_matches(model, drafter, prompt_ids: list[int], output_ids: list[int], chunk: int = 256) -> list[int]:
    """Leading drafts equal to the response, for a block anchored at each response position but the last."""
    ids = torch.tensor([prompt_ids + output_ids])
    session = TargetSession(model, drafter.config.target_layer_ids)  # the features speculative decoding captures
    try:
        features = session.forward(ids[0].tolist())[1][None]
    finally:
        session.close()
    P, T, B = len(prompt_ids), ids.shape[1], drafter.block_size
    matches = []
    for start in range(P, T - 1, chunk):
        anchors = torch.arange(start, min(start + chunk, T - 1))
        blocks = make_block_token_ids(ids[0], anchors, B, drafter.mask_token_id)
        drafts = drafter.logits(drafter.forward_blocks(features, anchors, blocks)).argmax(-1)[:, 1:]
        positions = (anchors[:, None] + torch.arange(1, B)).clamp(max=T - 1)
        correct = (drafts == ids[0][positions]) & (anchors[:, None] + torch.arange(1, B) < T)
        matches += (acceptance_proxy(correct) - 1).tolist()
    return matches


def path_tau(matches: list[int]) -> tuple[int, int]:
    """(committed tokens, verify steps) of the greedy loop replayed over ``matches`` (index 0 = the first
    response token, the prefill's, which no verify step commits: as ``Generation.tau``)."""
    position, steps = 0, 0
    while position < len(matches):
        position += matches[position] + 1
        steps += 1
    return len(matches), steps


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
        c, s = path_tau(matches)
        committed, steps = committed + c, steps + s
        taus.append(c / s)
        proxies.append(sum(m + 1 for m in matches) / len(matches))
        print(f"prompt {row['id']}: {len(row['output_ids'])} tokens, path tau {c / s:.2f}, "
              f"all-anchors proxy {proxies[-1]:.2f}", flush=True)
    print(f"{len(taus)} responses: path tau mean {sum(taus) / len(taus):.3f}, pooled {committed / steps:.3f}; "
          f"all-anchors proxy mean {sum(proxies) / len(proxies):.3f}")


if __name__ == "__main__":
    main()
