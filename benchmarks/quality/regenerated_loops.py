#!/usr/bin/env python3
"""How much of a regenerated training set loops (issue #50, ``dflash_pipeline.loops``), per source (the id's prefix
before ``/``), with the target's tokenizer: answers, those with a repeated n-token run and those that end in a loop,
answer tokens and those at or after the onset; and what ``regenerate.loops: cut`` and ``drop`` leave of it
(conversations, answers, answer tokens; ``loops.apply_loop_policy``, as tokenize applies it).

  python benchmarks/quality/regenerated_loops.py TARGET REGENERATED.jsonl[.gz] [...] [--ngram 16]

TARGET: what ``dflash_pipeline.target.load_tokenizer`` takes (a .gguf, ``pkg:`` path, checkpoint directory).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from dflash_pipeline.loops import answer_loop, apply_loop_policy, ends_in_loop  # noqa: E402
from dflash_pipeline.resources import resolve_path  # noqa: E402
from dflash_pipeline.target import load_tokenizer  # noqa: E402


def records(path: Path):
    with (gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def answer_tokens(tokenizer, messages: list[dict] | None) -> tuple[int, int]:
    """(answers, their tokens) of a conversation as training would see it."""
    answers = [m["content"] for m in messages or [] if m["role"] == "assistant"]
    return len(answers), sum(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)


def count(tokenizer, paths: list[Path], ngram: int) -> dict[str, collections.Counter]:
    sources: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in paths:
        for record in records(path):
            source = sources[str(record["id"]).split("/")[0]]
            source["conversations"] += 1
            for message in record["messages"]:
                if message["role"] != "assistant":
                    continue
                encoded = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
                onset, _, tokens = answer_loop(tokenizer, message["content"], ngram)
                source.update(answers=1, answer_tokens=tokens, looping_answers=int(onset is not None),
                              ending_in_loop=int(ends_in_loop(encoded)),
                              loop_tokens=0 if onset is None else tokens - onset)
            for policy in ("cut", "drop"):
                kept, _ = apply_loop_policy(record["messages"], tokenizer, policy, ngram)
                answers, tokens = answer_tokens(tokenizer, kept)
                source.update({f"{policy}_conversations": int(kept is not None), f"{policy}_answers": answers,
                               f"{policy}_answer_tokens": tokens})
    sources["all"] = sum(sources.values(), collections.Counter())
    return sources


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target")
    p.add_argument("regenerated", nargs="+", type=Path)
    p.add_argument("--ngram", type=int, default=16)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(str(resolve_path(args.target)))
    sources = count(tokenizer, args.regenerated, args.ngram)
    print(f"| source | conversations | answers | answers with a repeated {args.ngram}-token run | answers ending in a "
          "loop | answer tokens | tokens at or after the onset | cut: conversations / answers / answer tokens | "
          "drop: conversations / answers / answer tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, c in sorted(sources.items(), key=lambda item: (item[0] == "all", item[0])):
        share = (lambda part, whole: f"{c[part]:,} ({c[part] / c[whole]:.1%})" if c[whole] else "0")
        print(f"| {name} | {c['conversations']:,} | {c['answers']:,} | {share('looping_answers', 'answers')} | "
              f"{share('ending_in_loop', 'answers')} | {c['answer_tokens']:,} | {share('loop_tokens', 'answer_tokens')} | "
              + " | ".join(f"{c[p + '_conversations']:,} / {c[p + '_answers']:,} / "
                           f"{c[p + '_answer_tokens']:,} ({c[p + '_answer_tokens'] / c['answer_tokens']:.1%})"
                           for p in ("cut", "drop")) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
