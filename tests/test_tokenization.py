"""Assistant-only loss masks from the real SmolLM2 chat template, and per-shard tokenisation."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.target import load_tokenizer
from dflash_pipeline.tokenization import (
    TemplateError,
    read_tokenized,
    shard_of,
    tokenize_conversation,
    tokenize_shard,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return load_tokenizer(str(smollm2_dir))


def supervised_runs(tokenizer, ids, mask):
    runs, current = [], []
    for token, flag in zip(ids, mask):
        if flag:
            current.append(int(token))
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_mask_covers_exactly_the_assistant_turns_and_their_end_of_turn(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION)
    assert supervised_runs(tokenizer, ids, mask) == ["Hello! How can I help?<|im_end|>\n", "It is 4.<|im_end|>\n"]
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(ids) == full


def test_generation_markers_are_used_when_the_template_has_them(tokenizer):
    tokenizer = load_tokenizer(str(tokenizer.name_or_path))
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
        "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    )
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION)
    assert supervised_runs(tokenizer, ids, mask) == ["Hello! How can I help?<|im_end|>", "It is 4.<|im_end|>"]


def test_template_that_rewrites_history_is_a_clear_error(tokenizer):
    tokenizer = load_tokenizer(str(tokenizer.name_or_path))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    with pytest.raises(TemplateError, match="generation"):
        tokenize_conversation(tokenizer, CONVERSATION)


def test_shard_assignment_is_deterministic_and_covers_every_shard():
    ids = [f"conv-{i}" for i in range(200)]
    assert [shard_of(i, 4) for i in ids] == [shard_of(i, 4) for i in ids]
    assert {shard_of(i, 4) for i in ids} == {0, 1, 2, 3}


def test_tokenize_shard_truncates_drops_and_counts(tmp_path, tokenizer):
    records = [
        {"id": "long", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y " * 80}]},
        {"id": "cut", "messages": [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}]},
        {"id": "short", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    ]
    source = tmp_path / "conversations.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    counts = tokenize_shard(source, tokenizer, shard=0, num_shards=1, max_length=64,
                            out_parquet=tmp_path / "s.parquet", out_counts=tmp_path / "s.tsv")
    assert counts["conversations"] == 3 and counts["truncated"] == 2
    assert counts["too_few_supervised_tokens"] == 1  # "cut": its only answer lies past the truncation
    frame = read_tokenized(tmp_path / "s.parquet")
    assert list(frame["id"]) == ["short", "long"]  # sorted by length
    assert list(frame["num_tokens"]) == sorted(frame["num_tokens"]) and frame["num_tokens"].max() == 64
    assert counts["samples"] == 2 and counts["tokens"] == frame["num_tokens"].sum()
