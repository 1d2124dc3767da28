"""Chat-template rendering, assistant-only loss masks and per-shard tokenisation."""

from __future__ import annotations

import collections
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
from transformers import PreTrainedTokenizerBase

from .atomic import atomic_path

GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


class TemplateError(ValueError):
    """The chat template cannot give assistant spans for this conversation."""


def shard_of(conversation_id: str, num_shards: int) -> int:
    """Deterministic shard of a conversation, stable when other conversations are added or removed."""
    digest = hashlib.blake2b(conversation_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
    )


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and return the character spans of its assistant turns.

    A span runs from the end of the generation prompt to the end of the rendered assistant turn, so it
    holds the response and the template's end-of-turn text (``<|im_end|>``): what the target generates.
    It is read off the template by rendering prefixes, which needs a template whose rendering of a
    conversation prefix is a prefix of the whole; otherwise a ``TemplateError`` says so.
    """
    text = _render(tokenizer, messages, False, **template_kwargs)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:turn], True, **template_kwargs) if turn else ""
        through = _render(tokenizer, messages[: turn + 1], False, **template_kwargs)
        if not (text.startswith(through) and through.startswith(before)):
            raise TemplateError(
                "the chat template does not render conversation prefixes as prefixes of the whole; "
                "add {% generation %} markers to it so assistant tokens can be found"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and the assistant-only loss mask (uint8) of one conversation, untruncated."""
    if GENERATION_BLOCK.search(tokenizer.chat_template or ""):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **template_kwargs
        )
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        return ids, np.asarray(encoded["assistant_masks"], dtype=np.uint8)
    text, spans = assistant_char_spans(tokenizer, messages, **template_kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int32)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for begin, end in spans:
        mask[(starts >= begin) & (starts < end)] = 1
    return ids, mask


def tokenize_shard(
    conversations_jsonl: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    shard: int,
    num_shards: int,
    max_length: int,
    out_parquet: str | Path,
    out_counts: str | Path,
    **template_kwargs,
) -> collections.Counter:
    """Tokenise the conversations that belong to ``shard`` and write them sorted by length.

    Length order lets extraction batch neighbours with little padding and write the store
    sequentially. Samples with fewer than 2 supervised tokens after truncation are dropped and counted.
    """
    counts = collections.Counter(conversations=0, truncated=0, too_few_supervised_tokens=0, template_error=0)
    rows = []
    with open(conversations_jsonl, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if shard_of(record["id"], num_shards) != shard:
                continue
            counts["conversations"] += 1
            try:
                ids, mask = tokenize_conversation(tokenizer, record["messages"], **template_kwargs)
            except TemplateError:
                counts["template_error"] += 1
                continue
            if len(ids) > max_length:
                counts["truncated"] += 1
                ids, mask = ids[:max_length], mask[:max_length]
            if int(mask.sum()) < 2:
                counts["too_few_supervised_tokens"] += 1
                continue
            rows.append({"id": record["id"], "num_tokens": len(ids), "input_ids": ids, "loss_mask": mask})
    rows.sort(key=lambda row: (row["num_tokens"], row["id"]))
    counts["samples"] = len(rows)
    counts["tokens"] = sum(row["num_tokens"] for row in rows)
    counts["supervised_tokens"] = int(sum(row["loss_mask"].sum() for row in rows))
    frame = pd.DataFrame(rows, columns=["id", "num_tokens", "input_ids", "loss_mask"])
    with atomic_path(out_parquet) as tmp:
        frame.to_parquet(tmp, index=False)
    with atomic_path(out_counts) as tmp:
        pd.Series(counts, name="count").rename_axis("item").to_frame().to_csv(tmp, sep="\t")
    return counts


def read_tokenized(path: str | Path) -> pd.DataFrame:
    """A tokenised shard with ``input_ids``/``loss_mask`` as int32/uint8 numpy arrays."""
    frame = pd.read_parquet(path)
    frame["input_ids"] = [np.asarray(ids, dtype=np.int32) for ids in frame["input_ids"]]
    frame["loss_mask"] = [np.asarray(mask, dtype=np.uint8) for mask in frame["loss_mask"]]
    return frame
