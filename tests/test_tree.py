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


def decode_alone(model, layer_ids, ids):
    """Logits and captured features of ``ids`` run in one plain forward of a fresh session."""
    session = TargetSession(model, layer_ids)
    try:
        return session.forward(ids)
    finally:
        session.close()


def random_drafter(model, tokenizer, block_size=16):
    torch.manual_seed(0)
    return DFlashDrafter.from_target_config(model.config, mask_token_id=resolve_mask_token_id(tokenizer, 49152),
                                            num_layers=1, block_size=block_size,
                                            embed_tokens=model.get_input_embeddings(),
                                            lm_head=model.get_output_embeddings())


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


@pytest.mark.parametrize("attention, dtype", [("sdpa", "float32"), ("eager", "float32"), ("sdpa", "bfloat16")])
@pytest.mark.parametrize("mode", ["mask", "rows"])
def test_tree_forward_equals_each_path_decoded_alone(tiny, mode, attention, dtype):
    """bfloat16 as on the GPU (the mask in the weights' dtype), compared within bf16 rounding."""
    import copy

    model = copy.deepcopy(tiny[0]).to(getattr(torch, dtype))
    model.set_attn_implementation(attention)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=0.05, rtol=0.01)
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
            expected_logits, expected_features = decode_alone(model, [0, 2], prefix[:-1] + path)
            torch.testing.assert_close(logits[node], expected_logits[-1], **tolerance)
            torch.testing.assert_close(features[node], expected_features[-1], **tolerance)
        accepted = tree.paths()[1]  # a path that is not the first branch: its nodes are not contiguous
        session.keep(accepted)
        assert session.length == len(prefix) - 1 + len(accepted)
        after, _ = session.forward([4, 0])  # the kept cache is the path's: the next forward sees only it
        expected, _ = decode_alone(model, [0, 2], prefix[:-1] + [tokens[n] for n in accepted] + [4, 0])
        torch.testing.assert_close(after, expected[-2:], **tolerance)
    finally:
        session.close()


def test_sampling_follows_the_target_distribution(tiny):
    """T = 1 with a drafter whose logits always put token 0 on top: the marginals of generated tokens 2 and 3
    match plain sampling's exact ones (accepting the drafts' tokens would make them ~all 0)."""
    model, _ = tiny
    prompt = [1, 5, 2]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(model(torch.tensor([prompt + [a] for a in range(V)])).logits[:, -1], -1)
        three = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = torch.softmax(model(three).logits[:, -1], -1).view(V, V, V)
    joint12 = p1[:, None] * p2
    marg2, marg3 = joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))

    class TopZero(Proposer):
        block_size, layer_ids = 4, None

        def block_logits(self, tokens, features):
            return torch.tensor([[3.0, 2.0, 1.0] + [0.0] * (V - 3)] * 3)

    gen, counts2, counts3, accepted, n = torch.Generator().manual_seed(1), torch.zeros(V), torch.zeros(V), [], 500
    for _ in range(n):
        g = tree_generate(model, TopZero(), prompt, budget=6, max_new_tokens=3, temperature=1.0, generator=gen,
                          eos_ids=set())
        assert len(g.tokens) == 3
        counts2[g.tokens[1]] += 1
        counts3[g.tokens[2]] += 1
        accepted += g.accepted
    tv2 = 0.5 * float((counts2 / n - marg2).abs().sum())
    tv3 = 0.5 * float((counts3 / n - marg3).abs().sum())
    assert sum(accepted) > 0.2 * len(accepted)  # the tree's tokens were accepted often: the rule was exercised
    assert tv2 < 0.1 and tv3 < 0.1, (tv2, tv3)  # sampling noise at n = 500 is ~0.05


# ---- lossless at T = 0 ----
class RankedOracle(Proposer):
    """Per-slot logits that rank the target's known greedy continuation ``reference`` at ``rank(step, slot)``
    (0: on top; other tokens above it: the next ids), so that trees accept through non-first children and reject
    inside the tree. Keeps the features it is given, in order."""

    def __init__(self, reference, prompt_length, block_size, rank, layer_ids=None, vocabulary=49152):
        self.reference, self.prompt_length, self.block_size, self.rank = reference, prompt_length, block_size, rank
        self.layer_ids, self.vocabulary = layer_ids, vocabulary

    def start(self, prompt_ids):
        self.step, self.features = 0, []

    def block_logits(self, tokens, features):
        self.features.append(features)
        done = len(tokens) - self.prompt_length
        logits = torch.zeros((self.block_size - 1, self.vocabulary))
        for slot in range(self.block_size - 1):
            true = self.reference[done + slot] if done + slot < len(self.reference) else 3
            above = self.rank(self.step, slot)
            logits[slot, [(true + 1 + j) % self.vocabulary for j in range(above)]] = 12.0 - torch.arange(above) * 0.5
            logits[slot, true] = 12.0 - above * 0.5
        self.step += 1
        return logits


QUESTIONS = ["What is 2+2?", "What is the capital of France?", "List three fruits."]
RANKS = {  # the reference token's rank at each step's slots
    "top chain": lambda step, slot: 0,
    "second at one slot": lambda step, slot: int(slot == step % 5),
    "third, then outside the tree": lambda step, slot: 2 if slot == 1 else 60 if slot == 6 else 0,
}


def chat_prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from dflash_pipeline.evaluate import autoregressive
    from dflash_pipeline.target import load_target, load_tokenizer

    model, tokenizer = load_target(str(smollm2_dir)), load_tokenizer(str(smollm2_dir))
    prompts = chat_prompts(tokenizer)
    return model, tokenizer, prompts, [autoregressive(model, ids, 40)["tokens"] for ids in prompts]


@pytest.mark.parametrize("mode", ["mask", "rows"])
def test_trees_are_lossless_on_smollm2(smollm2, mode):
    model, _, prompts, references = smollm2
    seen_ranks = set()
    for name, rank in RANKS.items():
        for ids, ref in zip(prompts, references):
            g = tree_generate(model, RankedOracle(ref, len(ids), 16, rank), ids, budget=32, max_new_tokens=40,
                              mode=mode)
            assert g.tokens == ref, (name, mode)
            assert g.mode == mode and len(g.accepted) == len(g.committed) == len(g.verified) == len(g.computed)
            assert all(v == 33 for v in g.verified) and sum(g.committed) == len(ref) - 1
            seen_ranks.add(max(g.accepted))
    assert max(seen_ranks) == 15 and min(seen_ranks) < 15  # whole blocks accepted, and paths cut inside the tree


def test_random_dflash_drafter_trees_are_lossless_on_smollm2(smollm2):
    model, tokenizer, prompts, references = smollm2
    drafter = random_drafter(model, tokenizer)
    for budget in (1, 32):
        for ids, ref in zip(prompts[:2], references):
            g = tree_generate(model, DFlashProposer(drafter), ids, budget=budget, max_new_tokens=12)
            assert g.tokens == ref[:12] and g.mode == "mask", budget


@pytest.mark.parametrize("target", ["qwen3_5_text_dir", "qwen3_next_dir"])
def test_trees_are_lossless_on_hybrid_targets(request, smollm2_tokenizer, target):
    """Gated-DeltaNet targets verify the tree's paths as rows; the drafter's context is the features of exactly
    the committed positions, equal to those of one forward over the whole sequence."""
    from dflash_pipeline.evaluate import autoregressive
    from dflash_pipeline.target import load_target

    model = load_target(str(request.getfixturevalue(target)))
    layer_ids = [0, 3, 6]  # GDN, full attention, GDN
    accepted = set()
    for ids in chat_prompts(smollm2_tokenizer)[1:]:
        ref = autoregressive(model, ids, 30)["tokens"]
        for rank in RANKS.values():
            proposer = RankedOracle(ref, len(ids), 8, rank, layer_ids)
            g = tree_generate(model, proposer, ids, budget=12, max_new_tokens=30)
            assert g.tokens == ref and g.mode == "rows", target
            accepted.update(g.accepted)
            context = torch.cat(proposer.features)
            _, expected = decode_alone(model, layer_ids, ids + ref[:-1])
            torch.testing.assert_close(context, expected[: len(context)], atol=1e-4, rtol=1e-4)
    assert 7 in accepted and len(accepted) > 2
    with pytest.raises(ValueError, match="verifies trees as rows"):
        TreeSession(model, layer_ids, "mask")


# ---- budgets through the evaluation and the report ----
def test_tree_budgets_through_evaluate_merge_and_report(smollm2, tmp_path):
    from dflash_pipeline.evaluate import evaluate, merge_results
    from dflash_pipeline.evaluate_report import write_report_files

    model, tokenizer, prompts, _ = smollm2
    drafter = random_drafter(model, tokenizer, block_size=4)
    rows = [{"id": i, "index": i, "prompt_ids": ids} for i, ids in enumerate(prompts[:2])]
    result = evaluate(model, drafter, rows, max_new_tokens=10, tree_budgets=[2, 8], warmup=False)
    assert sorted(result["trees"]) == ["2", "8"] and result["lossless"] is True
    for budget, tree in result["trees"].items():
        assert set(result) - {"rows", "trees"} <= set(tree), budget  # a chain result's keys, for the tree's decodes
        assert tree["lossless"] is True and tree["budget"] == int(budget) and tree["mode"] == "mask"
        assert tree["verified_per_step"] == int(budget) + 1 == tree["computed_per_step"]
        assert tree["tokens_per_s"]["speculative"] > 0 and len(tree["accepted_length_histogram"]) == 4
        assert tree["tokens_per_s"]["autoregressive"] == result["tokens_per_s"]["autoregressive"]
        assert tree["verify_steps"] == sum(len(row["trees"][budget]["accepted"]) for row in result["rows"])
    # parts merge into the same trees (prompts 0 and 1 evaluated apart)
    parts = [dict(result, rows=[row]) for row in result["rows"]]
    merged = merge_results(parts)
    assert {b: t["tau_pooled"] for b, t in merged["trees"].items()} == {b: t["tau_pooled"]
                                                                         for b, t in result["trees"].items()}
    paths = write_report_files(result, tmp_path)
    assert paths["tau_vs_tree_budget"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [line.split("\t")[0] for line in paths["tau_table"].read_text().splitlines()]
    assert table[-2:] == ["ddtree_2", "ddtree_8"]


def test_the_gpu_smoke_trees_overlay_validates_over_the_quality_example():
    import yaml
    from snakemake.utils import update_config, validate

    from workflow_helpers import example_config

    root = Path(__file__).resolve().parents[1]
    config = example_config("smollm2-quality.yaml")
    update_config(config, yaml.safe_load((root / "benchmarks" / "smoke" / "gpu_smoke_trees.yaml").read_text()))
    validate(config, str(root / "config" / "schema.yaml"))
    assert config["evaluate"]["tree_budgets"] == [16, 64]


def test_cli_tree_budgets(smollm2_dir, tmp_path, capsys):
    from transformers import AutoConfig

    from dflash_pipeline.cli import main
    from dflash_pipeline.drafter import save_dflash

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(AutoConfig.from_pretrained(smollm2_dir), mask_token_id=2,
                                               num_layers=1, block_size=4, intermediate_size=256)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n")
    code = main(["evaluate", "--drafter", str(save_dflash(drafter, tmp_path / "drafter")), "--target",
                 str(smollm2_dir), "--prompts", str(prompts), "--max-new-tokens", "6", "--no-prompt-lookup",
                 "--tree-budgets", "3", "5", "--require-lossless", "--out", str(tmp_path / "result.json")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert sorted(summary["trees"]) == ["3", "5"] and all(tree["lossless"] for tree in summary["trees"].values())
    assert [tree["verified_per_step"] for tree in summary["trees"].values()] == [4, 6]
