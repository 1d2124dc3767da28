"""The decode loop's CUDA graphs (greedy.DecodeStep): captured anew each time finished rows leave the batch, over
several batches, with the same answers as eager decode steps; and, on the CPU, the fallback when a capture fails.

A tiny random-weight Llama with a 16-token vocabulary and three end-of-sequence ids makes rows finish at many
different steps, so a batch drops rows (and captures a new graph) several times."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_pipeline import greedy

VOCAB, NEW_TOKENS = 16, 24


def tiny_llama(device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device, dtype).eval()


def batches(count: int, rows: int) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(1)
    return [[torch.randint(3, VOCAB, (int(n),), generator=generator).tolist()
             for n in torch.randint(2, 12, (rows,), generator=generator)] for _ in range(count)]


def count_captures(monkeypatch) -> list[None]:
    """One entry per CUDA graph captured (through torch's own class: the count of the code before the fix too)."""
    ended = []
    capture_end = torch.cuda.CUDAGraph.capture_end
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", lambda graph: ended.append(None) or capture_end(graph))
    return ended


def decode(model, prompt_batches, graphs: bool) -> list:
    return [greedy.greedy_batch(model, prompts, NEW_TOKENS, eos=[0, 1, 2], pad=0, graphs=graphs)
            for prompts in prompt_batches]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_steps_survive_row_drops_over_many_batches(monkeypatch):
    """Before the fix, the second capture of a batch (after its first row drop) died in the caching allocator
    (``it->second->use_count > 0 INTERNAL ASSERT FAILED``): the retired graph was its pool's only user."""
    monkeypatch.setattr(greedy, "capture_failure", None, raising=False)
    model = tiny_llama("cuda", torch.bfloat16)
    prompt_batches = batches(3, 64)
    eager = decode(model, prompt_batches, graphs=False)
    captures = count_captures(monkeypatch)
    graphed = decode(model, prompt_batches, graphs=True)
    assert greedy.capture_failure is None  # every capture succeeded: no fallback to eager steps
    assert len(captures) >= 2 * len(prompt_batches), captures  # batches captured anew after their row drops
    assert graphed == eager


def test_a_failed_capture_is_said_once_and_decodes_eagerly_with_the_same_answers(monkeypatch, caplog):
    """On the CPU: the warm-up runs the step eagerly, every capture fails as the allocator's assertion did."""
    monkeypatch.setattr(greedy, "capture_failure", None)
    captures = []

    def failing_capture(step):
        captures.append(len(step.token))
        raise RuntimeError('it->second->use_count > 0 INTERNAL ASSERT FAILED at "CUDACachingAllocator.cpp":2799')

    model = tiny_llama("cpu", torch.float32)
    prompt_batches = batches(2, 16)
    eager = decode(model, prompt_batches, graphs=False)
    monkeypatch.setattr(greedy.DecodeStep, "_warm_up", greedy.DecodeStep._advance)
    monkeypatch.setattr(greedy.DecodeStep, "_captured", failing_capture)
    with caplog.at_level(logging.WARNING, logger=greedy.__name__):
        fallback = decode(model, prompt_batches, graphs=True)
    assert fallback == eager
    assert len(captures) == 1  # one capture tried; the process decodes eagerly after it, the second batch too
    assert greedy.capture_failure.startswith("it->second->use_count > 0")
    warnings = [r for r in caplog.records if "capture" in r.getMessage()]
    assert len(warnings) == 1 and "eagerly" in warnings[0].getMessage()
