"""Records tests/data/ddtree_reference.json: the draft trees that DDTree's own builder (``build_ddtree_tree`` of
``ddtree.py`` in github liranringel/ddtree, MIT) makes for fixed per-position logits. tests/test_tree.py compares
``dflash_pipeline.tree.build_tree`` with them node for node.

The reference's module imports CUDA timing and its model package, so only the builder's source is taken from the
file (unchanged) and run with the modules it uses; its CUDA timer is replaced by a CPU clock (timings only).

    python tests/data/record_ddtree_reference.py PATH/TO/ddtree/ddtree.py COMMIT
"""

import ast
import heapq
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

CASES = [  # name, rows (B-1), vocabulary, budget, logit scale, identical rows
    ("spread", 15, 64, 32, 1.0, False),
    ("sharp_budget_128", 15, 64, 128, 3.0, False),
    ("peaked_short_block", 7, 48, 64, 6.0, False),
    ("identical_rows_ties", 4, 16, 40, 1.0, True),
    ("exhausted_heap", 2, 3, 20, 1.0, False),
    ("budget_1", 15, 64, 1, 1.0, False),
    ("budget_0", 15, 64, 0, 1.0, False),
    ("budget_above_vocabulary", 15, 64, 256, 2.0, False),
]


def reference_builder(ddtree_py: Path):
    tree = ast.parse(ddtree_py.read_text())
    function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "build_ddtree_tree")
    namespace = {"torch": torch, "np": np, "heapq": heapq, "time": time, "cuda_time": time.perf_counter,
                 "empty_stage_times": lambda names: dict.fromkeys(names, 0.0),
                 "DDTREE_TREE_BUILD_STAGE_ORDER": ("copy", "heap", "visibility")}
    exec(compile(ast.Module(body=[function], type_ignores=[]), str(ddtree_py), "exec"), namespace)
    return namespace["build_ddtree_tree"]


def main() -> None:
    ddtree_py, commit = Path(sys.argv[1]), sys.argv[2]
    build = reference_builder(ddtree_py)
    generator = torch.Generator().manual_seed(54)
    cases = []
    for name, rows, vocabulary, budget, scale, identical in CASES:
        logits = torch.randn((1 if identical else rows, vocabulary), generator=generator) * scale
        logits = logits.expand(rows, vocabulary).contiguous() if identical else logits
        tokens, depths, parents, _, visibility, _ = build(logits, budget)
        cases.append({"name": name, "budget": budget, "logits": logits.tolist(), "node_tokens": tokens.tolist(),
                      "node_depths": depths.tolist(), "parents": [int(p) for p in parents],
                      "visibility": [row.nonzero()[0].tolist() for row in visibility.numpy()]})
    out = Path(__file__).with_name("ddtree_reference.json")
    out.write_text(json.dumps({"reference": "github.com/liranringel/ddtree", "commit": commit,
                               "file": "ddtree.py", "function": "build_ddtree_tree", "cases": cases}) + "\n")
    print(f"{out}: {len(cases)} cases, nodes {[len(c['node_tokens']) for c in cases]}")


if __name__ == "__main__":
    main()
