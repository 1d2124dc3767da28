"""The capacity plan (src/dflash_pipeline/plan.py): its arithmetic on a toy config, its model FLOPs against torch's
count of a real drafter step, and its workload read from a conversations file."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, LlamaConfig

from dflash_pipeline import plan
from dflash_pipeline.store import compact
from dflash_pipeline.cli import main as cli_main
from dflash_pipeline.drafter import DFlashDrafter, dflash_config_from_target
from dflash_pipeline.drafter import architecture_kwargs
from workflow_helpers import REPO

# The 27B-shape step the plan is calibrated on (benchmarks/logs/arch_step_2026-12-03/arch_step_speed.md, "merged"):
# benchmarks/speed/arch_step_speed.py's drafter and its sequences at --tokens 4096 (context tokens, blocks).
MEASURED_SEQUENCES = [(1501, 512), (1910, 512), (685, 512)]
MEASURED_FWD_BWD_S = 0.812


def published_27b_drafter():
    from transformers import Qwen3Config

    target = Qwen3Config(hidden_size=5120, vocab_size=248320, intermediate_size=17408, num_hidden_layers=64,
                         num_attention_heads=24, num_key_value_heads=4, head_dim=256, tie_word_embeddings=False)
    return dflash_config_from_target(target, mask_token_id=248070, target_layer_ids=[1, 16, 31, 46, 61], head_dim=128,
                                     num_attention_heads=32, num_key_value_heads=8, sliding_window=2048,
                                     layer_types=["sliding_attention"] * 4 + ["full_attention"])

TOY_TARGET = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
TOY = {"extract": {"num_layers": 2},
       "train": {"gpus": 2, "epochs": 3, "tokens_per_batch": 1000, "val_fraction": 0.1, "max_anchors": 20,
                 "num_layers": 1, "block_size": 4, "head_dim": 16, "num_workers": 2, "prefetch_factor": 2}}


@pytest.fixture
def toy_config(tmp_path):
    overlay = tmp_path / "toy.yaml"
    overlay.write_text(yaml.safe_dump(TOY))
    return plan.load_config([str(overlay)], str(REPO))


def test_the_plans_arithmetic_on_a_toy_config(toy_config):
    workload = plan.Workload(conversations=200, tokens_per_conversation=100, response_share=0.5, source="toy")
    result = plan.make_plan(toy_config, workload, TOY_TARGET, extract_rate=plan.Rate(1000, "toy"), gpus=4,
                            compact_ranks=[51, 25])
    assert result["tokens"] == 20_000 and result["layers"] == 2 and result["hidden"] == 64
    assert result["anchors"] == 20  # min(max_anchors 20, 0.5 x 100 eligible)
    assert result["steps"] == 54  # 20,000 tokens x 0.9 (validation held out) x 3 epochs / 1,000 per step
    stores = {s["setting"]: s for s in result["stores"]}
    # K x D = 128 features; 5 B per token of ids and loss mask
    assert list(stores) == ["bf16", "fp8 e4m3", "compact rank 51 (fp8)", "compact rank 25 (fp8)"]
    assert [s["bytes_per_token"] for s in stores.values()] == [2 * 128 + 5, 128 + 2 * 4 + 5, 51 + 4 + 5, 25 + 4 + 5]
    assert stores["bf16"]["store_bytes"] == 261 * 20_000
    assert stores["bf16"]["preloaded_bytes"] == 256 * 20_000
    assert stores["fp8 e4m3"]["preloaded_bytes"] == (128 + 2 * 4) * 20_000  # held as stored: a byte and the scales
    assert stores["compact rank 51 (fp8)"]["preloaded_bytes"] == 2 * 51 * 20_000  # bf16 coefficients
    for s in stores.values():
        assert s["extract_gpu_h"] == pytest.approx(20_000 / 1000 / 3600)
        assert s["extract_h"] == pytest.approx(20_000 / 1000 / 3600 / 4)
        assert s["train_gpu_h"] == pytest.approx(54 * s["step_s"] * 2 / 3600)
        assert s["train_h"] == pytest.approx(54 * s["step_s"] / 3600)
        assert s["fits"] == "preloaded on each GPU"  # 5 MB
    drafter = result["drafter"]
    assert drafter.target_layer_ids == [1, 5]  # the default ids of K = 2 for 8 layers
    # each of the 2 ranks: 1,000 / 2 / 100 = 5 sequences per step
    flops = 5 * plan.drafter_step_flops(drafter, 100, 20, 128)
    optimizer = plan.optimizer_seconds(plan.drafter_parameters(drafter, 128), 2)
    assert stores["bf16"]["step_s"] == pytest.approx(flops / (plan.TRAIN_MFU.value * plan.GPU_PEAK.value) + optimizer)
    assert stores["bf16"]["optimizer_share"] == pytest.approx(optimizer / stores["bf16"]["step_s"])
    assert plan.drafter_parameters(drafter, 128) == sum(p.numel() for p in DFlashDrafter(drafter).parameters())

    # the default compact settings: 1/3 and 1/5 of K * D, multiples of 64
    assert [compact.default_rank(5, 576), compact.default_rank(5, 576, 1 / 5)] == [960, 576]
    assert [compact.default_rank(5, 5120), compact.default_rank(5, 5120, 1 / 5)] == [8512, 5120]

    text = plan.format_plan(result)
    assert "| bf16 | 261 |" in text and "20,000" in text and "issue #35" in text

    # a target without a measured rate gets none, and the plan says so
    unmeasured = plan.make_plan(toy_config, workload, TOY_TARGET)
    assert all(s["extract_gpu_h"] is None for s in unmeasured["stores"])
    assert "not measured" in plan.format_plan(unmeasured)
    # where it fits follows the sizes: a billion conversations do not fit a GPU, RAM or the node's disks in bf16
    huge = plan.make_plan(toy_config, plan.Workload(10**9, 1000, 0.5, "toy"), TOY_TARGET)
    assert {s["setting"]: s["fits"] for s in huge["stores"]}["bf16"].startswith("on no disk")


def test_train_steps_sets_the_plans_steps(toy_config):
    """train.steps: the plan's training is that many steps of up to tokens_per_batch tokens, whatever the epochs."""
    workload = plan.Workload(conversations=200, tokens_per_conversation=100, response_share=0.5, source="toy")
    toy_config["train"]["steps"] = 10
    result = plan.make_plan(toy_config, workload, TOY_TARGET, compact_ranks=[51])
    assert result["steps"] == 10 and result["train_tokens"] == 10 * 1000
    assert all(s["train_h"] == pytest.approx(10 * s["step_s"] / 3600) for s in result["stores"])


def test_model_flops_are_torchs_count_of_a_real_step(toy_config):
    """drafter_step_flops against FlopCounterMode over one forward + backward of a real drafter (the trainer's
    parts: fc on features without gradient, layers, the frozen LM head on the B - 1 predicted slots). Attention is
    left out of the comparison: torch counts none for the CPU's fused attention kernel (which computes every masked
    pair too), and would name it "attention" if it did."""
    T, n = 100, 6
    config = dflash_config_from_target(TOY_TARGET, mask_token_id=0, target_layer_ids=[1, 5],
                                       **architecture_kwargs(toy_config["train"]))
    embed, head = torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100, bias=False)
    drafter = DFlashDrafter(config, embed, head).train()
    features = torch.randn(1, T, 128)
    anchors, blocks = torch.arange(10, 10 + 12 * n, 12), torch.randint(0, 99, (n, 4))
    with FlopCounterMode(display=False) as counter:
        hidden = drafter.forward_blocks(features, anchors, blocks, attn_impl="sdpa")
        drafter.logits(hidden[:, 1:]).float().logsumexp(-1).sum().backward()
    by_op = {str(op): v for op, v in counter.get_flop_counts()["Global"].items()}
    counted = sum(v for op, v in by_op.items() if "attention" not in op)
    parts = plan.drafter_flops(config, T, n, 128)
    rotary = 2 * (config.head_dim // 2) * (T + 4 * n)  # the rotary embedding's frequencies x positions product
    assert counted == parts["fc"] + parts["layers"] + parts["lm_head"] + rotary


def test_the_workload_of_a_conversations_file(tmp_path, smollm2_dir, smollm2_tokenizer):
    from dflash_pipeline.tokenization import tokenize_conversation

    conversations = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: " + "why? " * i},
                                                  {"role": "assistant", "content": "Because. " * (3 * i + 1)}]}
                     for i in range(30)]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in conversations) + "{not json\n")
    overlay = tmp_path / "my.yaml"
    overlay.write_text(yaml.safe_dump({"data": {"source": str(source), "max_conversations": 20},
                                       "target": {"path": str(smollm2_dir)}, "tokenize": {"max_length": 40}}))
    config = plan.load_config([str(overlay)], str(REPO))
    workload = plan.workload_from_file(str(source), config, smollm2_tokenizer, sample=1000)
    assert workload.conversations == 20  # max_conversations of the 30 valid ones; the malformed line is dropped
    from dflash_pipeline.prepare import read_conversations, select_subset

    kept = select_subset(read_conversations(str(source))[0], 20, 0)
    masks = [tokenize_conversation(smollm2_tokenizer, c["messages"])[1][:40].astype(bool) for c in kept]
    assert workload.tokens_per_conversation == pytest.approx(sum(map(len, masks)) / 20)
    assert workload.response_share == pytest.approx(sum(int((m[:-1] & m[1:]).sum()) for m in masks)
                                                    / sum(map(len, masks)))
    assert max(map(len, masks)) == 40  # truncation applied

    out = tmp_path / "plan.md"
    assert cli_main(["plan", "--workflow-dir", str(REPO), "--configfile", str(overlay), "--out", str(out)]) == 0
    text = out.read_text()
    assert "conversations: 20" in text and "| bf16 | 5,765 |" in text  # SmolLM2: 5 x 576 x 2 + 5
    # SmolLM2's drafter has a measured step (host-bound: the FLOPs model would say a third of it), scaled by tokens
    assert "2026-12-02_s14" in text and f"| {0.067 * 1024 / 4096:.3g} (measured) |" in text
    assert math.isfinite(float(text.split("| bf16 | 5,765 | ")[1].split(" |")[0]))


def test_dflash2_sizing_counts_the_convolutions_and_the_selector(toy_config):
    """A DFlash2 drafter's parameters and model FLOPs: the convolutions' projections counted as torch counts them,
    the selector's parameters exactly, and the Qwen3.6-27B example's selector at 2 x 248,320 x 256 + 5120 x 256."""
    train = {**toy_config["train"], "architecture": "dflash2", "conv_group_size": 16, "selector_rank": 8,
             "selector_top_k": 4}
    config = dflash_config_from_target(TOY_TARGET, mask_token_id=0, target_layer_ids=[1, 5],
                                       **architecture_kwargs(train))
    embed, head = torch.nn.Embedding(100, 64), torch.nn.Linear(64, 100, bias=False)
    drafter = DFlashDrafter(config, embed, head).train()
    assert plan.drafter_parameters(config, 128) == sum(p.numel() for p in drafter.parameters())
    assert plan.selector_parameters(config) == (2 * 100 + 64) * 8
    T, n = 100, 6
    with FlopCounterMode(display=False) as counter:
        hidden = drafter.forward_blocks(torch.randn(1, T, 128), torch.arange(10, 10 + 12 * n, 12),
                                        torch.randint(0, 99, (n, 4)), attn_impl="sdpa")
        drafter.logits(hidden[:, 1:]).float().logsumexp(-1).sum().backward()
    counted = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "attention" not in str(op))
    parts = plan.drafter_flops(config, T, n, 128)
    rotary = 2 * (config.head_dim // 2) * (T + 4 * n)
    assert counted == parts["fc"] + parts["layers"] + parts["lm_head"] + rotary
    assert parts["selector"] == 3 * 2 * n * 3 * (64 + 4) * 8

    fields = json.loads((REPO / "tests" / "data" / "qwen3.6-27b.config.json").read_text())
    target = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config = plan.load_config([str(REPO / "config" / "examples" / name)
                               for name in ("qwen3.6-27b.yaml", "qwen3.6-27b-dflash2.yaml")], str(REPO))
    result = plan.make_plan(config, plan.Workload(1000, 2000, 0.5, "toy"), target)
    assert result["drafter"].architecture == "dflash2" and result["drafter"].block_size == 8
    assert plan.selector_parameters(result["drafter"]) == 2 * 248_320 * 256 + 5120 * 256  # 128.4 M
    assert "dflash2" in plan.format_plan(result) and "128 M of them the selector" in plan.format_plan(result)
    assert all(s["step_rate"] is None for s in result["stores"])  # the measured steps are DFlash's


def test_the_utilisation_is_the_measured_steps_by_the_plans_own_flop_count():
    """TRAIN_MFU is what the measured 27B-shape step gives by drafter_step_flops (one count: the benchmark that
    measured it counts with the same function)."""
    config = published_27b_drafter()
    assert plan.drafter_parameters(config, 5 * 5120) == pytest.approx(1.73e9, rel=0.01)
    flops = sum(plan.drafter_step_flops(config, tokens, blocks, 5 * 5120) for tokens, blocks in MEASURED_SEQUENCES)
    assert flops / MEASURED_FWD_BWD_S / plan.GPU_PEAK.value == pytest.approx(plan.TRAIN_MFU.value, abs=0.005)


def test_the_benchmark_counts_its_flops_with_the_plans_function():
    import sys
    import types

    sys.path[:0] = [str(REPO / "benchmarks" / "speed"), str(REPO / "benchmarks")]
    import arch_step_speed

    config = dflash_config_from_target(TOY_TARGET, mask_token_id=0, target_layer_ids=[1, 2, 3, 4, 5],
                                       head_dim=16, num_layers=2)
    drafter = types.SimpleNamespace(config=config, mask_token_id=0)
    args = types.SimpleNamespace(length=120, max_anchors=8)
    packs = arch_step_speed.step_packs(drafter, 400, args, seed=1, device=torch.device("cpu"))
    sequences = [(t, n) for p in packs for t, n in zip(p.lengths, p.block_counts)]
    assert sum(t for t, _ in sequences) == 400 and len(sequences) > 1
    assert arch_step_speed.model_flops(config, packs) == pytest.approx(
        sum(plan.drafter_step_flops(config, t, n, 5 * 64) for t, n in sequences))


def test_the_optimizer_is_sharded_over_the_ranks():
    one = plan.optimizer_seconds(plan.OPTIMIZER_PARAMS, 1)
    assert one == pytest.approx(plan.OPTIMIZER_S.value)
    # 8 ranks: the measurement's arithmetic gave the busiest rank 0.089 s (its share of whole matrices)
    assert plan.optimizer_seconds(plan.OPTIMIZER_PARAMS, 8) == pytest.approx(0.089, rel=0.05)
    times = [plan.optimizer_seconds(plan.OPTIMIZER_PARAMS, r) for r in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert plan.optimizer_seconds(plan.OPTIMIZER_PARAMS / 2, 1) == pytest.approx(one / 2)


def test_the_peak_memory_estimate_is_the_measured_steps():
    config = published_27b_drafter()
    train = {"tokens_per_batch": 4096, "gpus": 1, "gradient_checkpointing": True}
    peak = plan.train_memory(config, train, 5 * 5120, 4096 / 3, 512, tied=False)
    assert peak == pytest.approx(plan.MEASURED_PEAK.value, rel=0.01)
    assert 39 * 2**30 < plan.MEASURED_PEAK.value < 41 * 2**30


def test_configfile_takes_a_file_from_any_directory(tmp_path, monkeypatch, capsys):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text(yaml.safe_dump({"train": {"epochs": 2}}))
    monkeypatch.chdir(tmp_path)  # no config/ here: the package's checkout gives config/config.yaml and the schema
    assert cli_main(["plan", "--configfile", str(overlay), "--conversations", "1000",
                     "--tokens-per-conversation", "300"]) == 0
    assert "# Capacity plan" in capsys.readouterr().out
    assert plan.load_config([str(overlay)])["train"]["epochs"] == 2
    with pytest.raises(FileNotFoundError, match="not a config file"):
        plan.load_config([str(tmp_path)])
