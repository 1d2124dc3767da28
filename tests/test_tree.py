"""Tree verification (src/dflash_pipeline/tree.py).

The builder against the reference's own (tests/data/ddtree_reference.json: the trees that ``build_ddtree_tree`` of
github liranringel/ddtree at commit c96427a185677bf4133ed865dd1626a5041aef9b built for the logits stored with them;
regenerate with ``python tests/data/record_ddtree_reference.py PATH/TO/ddtree.py COMMIT`` after
``git show COMMIT:ddtree.py`` of that repository); the walk on a hand-made tree; a tree forward's logits, features
and kept cache against decoding each path alone (``mask`` and ``rows`` on a tiny Llama); lossless at T = 0 against
autoregressive decoding on the real SmolLM2 target and on the tiny hybrid targets; the sampling rule's output
distribution; budgets through ``evaluate`` and the report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_pipeline.drafter import DFlashDrafter, resolve_mask_token_id
from dflash_pipeline.speculative import DFlashProposer, Proposer, TargetSession
from dflash_pipeline.tree import Tree, TreeSession, build_tree, tree_generate, walk

REFERENCE = Path(__file__).parent / "data" / "ddtree_reference.json"


# ---- the builder and the walk ----
def test_build_tree_matches_the_reference_builder():
    recorded = json.loads(REFERENCE.read_text())
    assert recorded["commit"] == "c96427a185677bf4133ed865dd1626a5041aef9b"
    for case in recorded["cases"]:
        tree = build_tree(torch.tensor(case["logits"]), case["budget"])
        name = case["name"]
        assert tree.tokens.tolist() == case["node_tokens"], name
        assert tree.depths.tolist() == case["node_depths"], name
        assert tree.parents == case["parents"], name
        assert [row.nonzero()[:, 0].tolist() for row in tree.visibility] == case["visibility"], name
        for index, parent in enumerate(tree.parents[1:], start=1):  # parents precede children; the child maps
            assert parent < index and tree.children[parent][int(tree.tokens[index - 1])] == index, name
    sizes = [len(case["node_tokens"]) for case in recorded["cases"]]
    assert sizes == [32, 128, 64, 40, 12, 1, 0, 256]  # budgets met, an exhausted heap (3 + 9 nodes), budget 0


def test_build_tree_by_hand():
    """Slot 1: q = .6 / .3 / .1 on tokens 0 / 1 / 2; slot 2: .9 / .1 on tokens 3 / 4. Prefix probabilities:
    (0) .6, (0 3) .54, (1) .3, (1 3) .27, (2) .1, (2 3) .09, (0 4) .06, ..."""
    q = torch.tensor([[0.6, 0.3, 0.1, 1e-9, 1e-9], [1e-9, 1e-9, 1e-9, 0.9, 0.1]])
    tree = build_tree(q.log(), 4)
    assert tree.tokens.tolist() == [0, 3, 1, 3] and tree.depths.tolist() == [1, 2, 1, 2]
    assert tree.parents == [-1, 0, 1, 0, 3]
    assert tree.visibility.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0],
                                              [1, 0, 0, 1, 1]]
    assert tree.paths() == [[0, 1, 2], [0, 3, 4]]
    assert build_tree(q.log(), 7).tokens.tolist() == [0, 3, 1, 3, 2, 3, 4]


def test_walk_on_a_hand_made_tree():
    #        root
    #       /    \
    #     1:5    2:6
    #    /   \      \
    #  3:7   4:8    5:9
    #   |
    #  6:4
    tree = Tree(tokens=torch.tensor([5, 6, 7, 8, 9, 4]), depths=torch.tensor([1, 1, 2, 2, 2, 3]),
                parents=[-1, 0, 0, 1, 1, 2, 3], children=[{5: 1, 6: 2}, {7: 3, 8: 4}, {9: 5}, {4: 6}, {}, {}, {}],
                visibility=torch.eye(7, dtype=torch.bool))
    #        node:  0  1  2  3  4  5  6
    assert walk(tree, [5, 8, 0, 0, 1, 0, 0]) == ([0, 1, 4], 1)  # a leaf: its target token is the bonus
    assert walk(tree, [5, 7, 0, 4, 0, 0, 3]) == ([0, 1, 3, 6], 3)  # the deepest path
    assert walk(tree, [6, 0, 2, 0, 0, 0, 0]) == ([0, 2], 2)  # the second child; 2 is no child of node 2
    assert walk(tree, [1, 7, 9, 4, 0, 0, 0]) == ([0], 1)  # the root's choice is no child: nothing accepted
    assert tree.paths() == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]  # leaves in index order


# ---- the target side on a tiny Llama ----
V = 8


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # spread but prefix-dependent distributions
    drafter = DFlashDrafter.from_target_config(config, mask_token_id=V - 1, num_layers=1, block_size=4,
                                               target_layer_ids=[0, 2], head_dim=8,
                                               embed_tokens=model.get_input_embeddings(), lm_head=model.lm_head)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model, drafter.eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["mask", "rows"])
def test_tree_forward_equals_each_path_decoded_alone(tiny, mode, attention):
    model, _ = tiny
    model.set_attn_implementation(attention)
    prefix = [1, 5, 2, 6, 3]
    tree = build_tree(torch.randn((3, V), generator=torch.Generator().manual_seed(2)) * 2, 9)
    assert max(tree.depths.tolist()) == 3 and len(tree.paths()) > 2  # a real tree: several branches and depths
    session = TreeSession(model, [0, 2], mode)
    try:
        session.forward(prefix[:-1], last_only=True)
        logits, features, computed = session.verify(prefix[-1], tree)
        assert logits.shape == (10, V) and features.shape == (10, 64)
        assert computed == (10 if mode == "mask" else len(tree.paths()) * 4)
        tokens = [prefix[-1], *tree.tokens.tolist()]
        for node in range(tree.size):
            path = [tokens[n] for n in tree.path_to(node)]
            alone = TargetSession(model, [0, 2])
            try:
                expected_logits, expected_features = alone.forward(prefix[:-1] + path)
            finally:
                alone.close()
            torch.testing.assert_close(logits[node], expected_logits[-1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(features[node], expected_features[-1], atol=1e-5, rtol=1e-5)
        accepted = tree.paths()[1]  # a path that is not the first branch: its nodes are not contiguous
        session.keep(accepted)
        assert session.length == len(prefix) - 1 + len(accepted)
        after, _ = session.forward([4, 0])  # the kept cache is the path's: the next forward sees only it
        alone = TargetSession(model, [0, 2])
        try:
            expected, _ = alone.forward(prefix[:-1] + [tokens[n] for n in accepted] + [4, 0])
        finally:
            alone.close()
        torch.testing.assert_close(after, expected[-2:], atol=1e-5, rtol=1e-5)
    finally:
        session.close()
        model.set_attn_implementation("sdpa")
