"""Tree verification (DDTree: Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion Draft
Trees"; docs/design.md, "Tree verification (DDTree)").

One drafter pass gives a distribution q_k per drafted slot k = 1..B-1. ``build_tree`` takes the ``budget`` most
likely prefixes (highest Σ log q) as the nodes of a tree rooted at the anchor, with the builder of the reference
implementation (github liranringel/ddtree, ``build_ddtree_tree``): a best-first heap that pops the best prefix and
pushes its next sibling and its first child, so parents precede children and ties break as there. The target then
gives its own choice at every node (argmax at T = 0; at T > 0 a sample of its distribution at that node, the
reference's rule: every committed token is a draw of the target's conditional, so the output distribution is the
target's), and ``walk`` follows, from the root, the child whose token is that choice: the accepted path, then the
target's choice at its last node as the bonus token. Depth ≤ B-1, so a step commits at most B tokens.

How the target verifies a tree (``TreeSession``), both exact:

- ``mask``: attention-only targets (SDPA or eager attention, full-attention KV layers). One forward over
  [anchor, nodes] with positions start + depth and a 4D mask that lets each node see the cache and its own
  ancestors only; every node's logits and KV are then those of its root-to-node path decoded alone. The cache
  keeps the accepted path by gathering its nodes' K/V to the positions after the prefix and cropping the rest
  (no second forward).
- ``rows``: hybrid targets (Gated-DeltaNet layers, whose recurrent state an attention mask cannot keep siblings
  out of), and any other target. Each root-to-leaf path is one row of a batch (the cache repeated per row), run
  causally; a node's logits are those of the first row through it. The cache keeps the row of the accepted path:
  its KV cropped to the path, the Gated-DeltaNet states restored and recomputed over the path
  (``TargetSession.rollback``). The target computes rows × width tokens instead of the tree's nodes.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from .speculative import Generation, TargetSession, _sample_or_argmax, commit, eos_token_ids


# ---- the tree ----
@dataclass
class Tree:
    """Node 0 is the root (the anchor, already committed); nodes 1..N are drafts, parents before children.

    ``tokens``/``depths`` [N]: node i's token and depth are ``tokens[i-1]``/``depths[i-1]`` (depth 1 = the
    first drafted slot); ``parents`` [N+1] (the root's is -1); ``children[i]``: token -> child index;
    ``visibility`` [N+1, N+1] bool: [i, j] when j is i or an ancestor of i."""

    tokens: torch.Tensor
    depths: torch.Tensor
    parents: list[int]
    children: list[dict[int, int]]
    visibility: torch.Tensor

    @property
    def size(self) -> int:
        """Tokens the target verifies: the root and the N nodes."""
        return len(self.parents)

    def path_to(self, node: int) -> list[int]:
        path = [node]
        while path[-1] > 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path (node indices from 0), leaves in index order."""
        return [self.path_to(node) for node in range(self.size) if not self.children[node]]


def build_tree(logits: torch.Tensor, budget: int) -> Tree:
    """Per-slot drafter logits (or log-probabilities) [B-1, V] -> the tree of the ``budget`` prefixes of highest
    Σ log q (fewer when fewer exist), exactly as the reference builds it (heap entries, their float arithmetic
    and tie-breaking: equal scores pop in the order of their rank tuples)."""
    rows = logits.shape[0]
    if budget <= 0 or rows == 0:
        return Tree(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), [-1], [{}],
                    torch.ones((1, 1), dtype=torch.bool))
    k = min(budget, logits.shape[-1])
    logits = logits.float()
    top_logits, top_ids = torch.topk(logits, k=k, dim=-1)
    log_q = (top_logits - torch.logsumexp(logits, dim=-1, keepdim=True)).cpu().numpy()
    top_ids = top_ids.cpu().numpy()
    # (-score, ranks of the prefix, parent index, depth, rank at that depth, score)
    heap = [(-float(log_q[0, 0]), (0,), 0, 1, 0, float(log_q[0, 0]))]
    tokens, depths, parents, children = [], [], [-1], [{}]
    while heap and len(tokens) < budget:
        _, ranks, parent, depth, rank, score = heapq.heappop(heap)
        token, index = int(top_ids[depth - 1, rank]), len(parents)
        tokens.append(token)
        depths.append(depth)
        parents.append(parent)
        children.append({})
        children[parent][token] = index
        if rank + 1 < k:
            sibling = score - float(log_q[depth - 1, rank]) + float(log_q[depth - 1, rank + 1])
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, sibling))
        if depth < rows:
            child = score + float(log_q[depth, 0])
            heapq.heappush(heap, (-child, ranks + (0,), index, depth + 1, 0, child))
    size = len(parents)
    visibility = np.zeros((size, size), dtype=np.bool_)  # numpy: a row copy per node is most of a tree's build
    visibility[0, 0] = True
    for index in range(1, size):
        visibility[index, :index] = visibility[parents[index], :index]
        visibility[index, index] = True
    return Tree(torch.tensor(tokens, dtype=torch.long), torch.tensor(depths, dtype=torch.long), parents, children,
                torch.from_numpy(visibility))


def walk(tree: Tree, choices: list[int]) -> tuple[list[int], int]:
    """The target's token at every node (``choices[i]`` for node i) -> (the accepted path: node indices from the
    root, following the child whose token is the target's choice while one exists; the target's token after
    it)."""
    path = [0]
    while choices[path[-1]] in tree.children[path[-1]]:
        path.append(tree.children[path[-1]][choices[path[-1]]])
    return path, choices[path[-1]]


def target_choices(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> list[int]:
    """The target's token at each node from its logits [N+1, V]: argmax at temperature 0, else one sample each."""
    if temperature <= 0:
        return logits.argmax(-1).tolist()
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()


# ---- the target side ----
def verification_mode(model: nn.Module, session: TargetSession) -> str:
    """``mask`` (one forward over the tree) where the target's layers and attention allow it, else ``rows``."""
    if session.hybrid or model.config._attn_implementation not in ("sdpa", "eager"):
        return "rows"
    return "mask" if all(type(layer) is DynamicLayer for layer in session.cache.layers) else "rows"


class TreeSession(TargetSession):
    """A ``TargetSession`` that verifies trees (module docstring): ``verify`` then ``keep``."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None, mode: str | None = None):
        super().__init__(model, layer_ids)
        self.mode = mode or verification_mode(model, self)
        if self.mode not in ("mask", "rows"):
            raise ValueError(f"tree verification mode {self.mode!r}: mask or rows")
        if self.mode == "mask" and self.hybrid:
            raise ValueError("a hybrid (Gated-DeltaNet) target verifies trees as rows: a mask cannot keep a "
                             "node's siblings out of a recurrent state")
        self._tree: tuple[int, Tree, list[list[int]]] | None = None  # (start, tree, rows) of the latest verify

    @torch.no_grad()
    def verify(self, anchor: int, tree: Tree) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Run [anchor, nodes] after the cached positions -> (float32 logits [N+1, V] and features [N+1, K*D]
        (or None) of every node as if its root-to-node path had been decoded alone, tokens the forward
        computed)."""
        start = self.length
        if self.mode == "mask":
            ids = torch.cat([torch.tensor([anchor]), tree.tokens])[None].to(self.device)
            positions = (start + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths]))[None].to(self.device)
            dtype = self.model.get_input_embeddings().weight.dtype
            mask = torch.zeros((1, 1, tree.size, start + tree.size), dtype=dtype)
            mask[0, 0, :, start:].masked_fill_(~tree.visibility, torch.finfo(dtype).min)
            logits, features = self.forward_batch(ids, attention_mask=mask.to(self.device), position_ids=positions)
            self._tree = (start, tree, [])
            return logits[0], features[0] if features is not None else None, tree.size
        paths = tree.paths()
        width = max(map(len, paths))
        tokens = [anchor, *tree.tokens.tolist()]
        ids = torch.tensor([[tokens[node] for node in path] + [tokens[path[-1]]] * (width - len(path))
                            for path in paths], device=self.device)  # padding after a path changes none of it
        logits, features = self.forward_batch(ids)
        first = {}  # node -> (row, column) of the first row through it
        for row, path in enumerate(paths):
            for column, node in enumerate(path):
                first.setdefault(node, (row, column))
        rows, columns = (torch.tensor(axis, device=self.device) for axis in zip(*(first[n] for n in range(tree.size))))
        self._tree = (start, tree, paths)
        return logits[rows, columns], features[rows, columns] if features is not None else None, ids.numel()

    @torch.no_grad()
    def keep(self, path: list[int]) -> None:
        """Keep in the cache the accepted ``path`` (node indices from the root) of the latest ``verify`` only."""
        start, tree, paths = self._tree
        self._tree = None
        if self.mode == "mask":
            kept = torch.tensor(path, device=self.device) + start
            for layer in self.cache.layers:
                layer.keys[..., start: start + len(path), :] = layer.keys[..., kept, :]
                layer.values[..., start: start + len(path), :] = layer.values[..., kept, :]
            self.cache.crop(-(tree.size - len(path)))
            return
        row = next(r for r, candidate in enumerate(paths) if candidate[: len(path)] == path)
        self.cache.reorder_cache(torch.tensor([row], device=self.device))
        self._mixer_inputs = {index: inputs[row: row + 1] for index, inputs in self._mixer_inputs.items()}
        self.rollback(start + len(path))


# ---- the loop ----
@dataclass
class TreeGeneration(Generation):
    """A ``Generation`` by tree verification; per verify step also the tokens of the tree the target verified
    (root included: 1 + nodes) and the tokens its forward computed (the same in ``mask`` mode; rows × width in
    ``rows`` mode)."""

    budget: int = 0
    mode: str = ""
    verified: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)


@torch.no_grad()
def tree_generate(model: nn.Module, proposer, prompt_ids: list[int], *, budget: int, max_new_tokens: int,
                  temperature: float = 0.0, generator: torch.Generator | None = None, eos_ids: set[int] | None = None,
                  mode: str | None = None) -> TreeGeneration:
    """``speculative_generate`` with a tree of ``budget`` nodes per verify step instead of the chain; the
    proposer must have ``block_logits(tokens, features)`` (its per-slot logits [B-1, V]). ``mode``: ``mask`` or
    ``rows`` (module docstring; None: ``verification_mode``). At temperature 0 the output equals the target's
    own greedy decoding; above it, it is distributed as the target's sampling."""
    eos_ids = eos_token_ids(model) if eos_ids is None else set(eos_ids)
    prompt_ids = [int(t) for t in prompt_ids]
    result = TreeGeneration(prompt_length=len(prompt_ids), budget=budget)
    if max_new_tokens <= 0:
        result.stopped_by = "length"
        return result
    started = time.perf_counter()
    session = TreeSession(model, proposer.layer_ids, mode)
    result.mode = session.mode
    try:
        proposer.start(prompt_ids)
        logits, features = session.forward(prompt_ids, last_only=True)
        first = _sample_or_argmax(logits[-1], temperature, generator)
        result.tokens.append(first)
        tokens, done = prompt_ids + [first], first in eos_ids
        while not done and len(result.tokens) < max_new_tokens:
            tree = build_tree(proposer.block_logits(tokens, features), budget)
            node_logits, node_features, computed = session.verify(tokens[-1], tree)
            path, bonus = walk(tree, target_choices(node_logits, temperature, generator))
            result.accepted.append(len(path) - 1)
            new = commit(result, [int(tree.tokens[node - 1]) for node in path[1:]] + [bonus], eos_ids, max_new_tokens)
            result.verified.append(tree.size)
            result.computed.append(computed)
            session.keep(path)  # the anchor and the accepted nodes
            tokens += new
            features = node_features[path] if node_features is not None else None
            done = new[-1] in eos_ids
        result.stopped_by = "eos" if result.tokens[-1] in eos_ids else "length"
    finally:
        session.close()
    result.seconds = time.perf_counter() - started
    return result
