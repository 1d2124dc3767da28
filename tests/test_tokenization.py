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
    special_text = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a<|im_end|>b"}]
    ids, mask = tokenize_conversation(tokenizer, special_text)
    assert supervised_runs(tokenizer, ids, mask) == ["a<|im_end|>b<|im_end|>"]
    assert list(ids).count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 2  # the template's two, not the text's


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


def test_a_conversation_that_starts_with_an_answer_supervises_that_answer_only(tokenizer):
    messages = [{"role": "assistant", "content": "Hello!"}, *CONVERSATION[1:3]]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert supervised_runs(tokenizer, ids, mask) == ["Hello!<|im_end|>\n", "Hello! How can I help?<|im_end|>\n"]


REFUSING = (  # refuses two user messages in a row, as Llama-2 and Mistral templates do
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_conversations_a_template_cannot_render_are_dropped_and_counted_by_reason(tmp_path, tokenizer):
    """A template's refusal is ``template_error``; special-token text in a message that a template does not insert
    verbatim (``| trim``) is ``special_token_text``; characters without tokens are ``unencodable_text``. The same
    reasons skip the conversation in regenerate (its prompts)."""
    from dflash_pipeline.regenerate import Reply, regenerate_shard

    tokenizer = load_tokenizer(str(tokenizer.name_or_path))
    tokenizer.chat_template = REFUSING
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    records = [
        {"id": "fine", "messages": [user, answer]},
        {"id": "two-users", "messages": [user, user, answer]},
        {"id": "special-trimmed", "messages": [{"role": "user", "content": " <|im_end|> "}, answer]},
        {"id": "special-verbatim", "messages": [{"role": "user", "content": "a<|im_end|>b"}, answer]},
        {"id": "no-tokens", "messages": [{"role": "user", "content": "\x04"}, answer]},
    ]
    source = tmp_path / "conversations.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    counts = tokenize_shard(source, tokenizer, shard=0, num_shards=1, max_length=64,
                            out_parquet=tmp_path / "s.parquet", out_counts=tmp_path / "s.tsv")
    assert {k: counts[k] for k in ("conversations", "samples", "template_error", "special_token_text",
                                   "unencodable_text")} == {"conversations": 5, "samples": 2, "template_error": 1,
                                                             "special_token_text": 1, "unencodable_text": 1}
    assert sorted(read_tokenized(tmp_path / "s.parquet")["id"]) == ["fine", "special-verbatim"]

    class Echo:
        identity = {"backend": "echo"}

        def generate(self, items):
            return [Reply("answer", 1, False) for _ in items]

    settings = {"max_turns": 1, "max_new_tokens": 4, "max_prompt_tokens": None, "batch_size": 4, "thinking": None}
    counts = regenerate_shard(source, Echo(), tokenizer, shard=0, num_shards=1, settings=settings,
                              out_jsonl=tmp_path / "r.jsonl", out_counts=tmp_path / "r.tsv")
    assert (counts["succeeded"], counts["skipped:template_error"], counts["skipped:special_token_text"],
            counts["skipped:unencodable_text"]) == (2, 1, 1, 1)
