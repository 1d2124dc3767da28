#!/usr/bin/env python3
"""Two sets of regenerated conversations (the regenerate rule's shard_*.jsonl, or one .jsonl/.jsonl.gz of them):
which conversations both have, how many of their assistant turns are identical, and where the others part.

    python3 benchmarks/quality/compare_regenerated.py A B [--examples 3]

A and B: a file, or a folder whose shard_*.jsonl are read (not the .partial ones). For the differing answers it
prints the length of the text they share before they part (characters), and how many differ only in that one is
the other cut short (the max_new_tokens cap on one side only).
"""

import argparse
import gzip
import json
import statistics
from pathlib import Path


def answers(path: Path) -> dict[str, list[str]]:
    files = sorted(p for p in path.glob("shard_*.jsonl") if not p.name.endswith(".partial.jsonl")) \
        if path.is_dir() else [path]
    found = {}
    for file in files:
        with (gzip.open if file.suffix == ".gz" else open)(file, "rt", encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                found[record["id"]] = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    return found


def shared_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--examples", type=int, default=3)
    args = p.parse_args()
    a, b = answers(args.a), answers(args.b)
    both = sorted(a.keys() & b.keys())
    print(f"conversations: {len(a)} in A, {len(b)} in B, {len(both)} in both, {len(a.keys() - b.keys())} only in A, "
          f"{len(b.keys() - a.keys())} only in B")
    pairs = [(cid, x, y) for cid in both for x, y in zip(a[cid], b[cid])]
    differing = [(cid, x, y) for cid, x, y in pairs if x != y]
    turns = sum(len(a[cid]) != len(b[cid]) for cid in both)
    print(f"assistant turns compared: {len(pairs)}; identical {len(pairs) - len(differing)} "
          f"({100 * (len(pairs) - len(differing)) / max(1, len(pairs)):.2f} %), differing {len(differing)}; "
          f"conversations with another number of turns: {turns}")
    if not differing:
        return
    prefixes = [shared_prefix(x, y) for _, x, y in differing]
    cut = sum(x.startswith(y) or y.startswith(x) for _, x, y in differing)
    print(f"differing: shared text before they part, characters: median {statistics.median(prefixes):.0f}, "
          f"min {min(prefixes)}, max {max(prefixes)}; share of the longer answer "
          f"{statistics.median(p / max(len(x), len(y)) for p, (_, x, y) in zip(prefixes, differing)):.2f} (median); "
          f"one a prefix of the other: {cut}")
    for cid, x, y in differing[: args.examples]:
        at = shared_prefix(x, y)
        print(f"- {cid}: part at character {at} of {len(x)} / {len(y)}: ...{x[max(0, at - 60):at]!r} then "
              f"A {x[at:at + 40]!r} | B {y[at:at + 40]!r}")


if __name__ == "__main__":
    main()
