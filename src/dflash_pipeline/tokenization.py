"""Chat-template rendering, assistant-only loss masks and per-shard tokenisation.

A message's text is text: where it holds the text of one of the tokenizer's special tokens (``<|im_end|>``),
that is encoded as the plain characters it is, never as the control token, so that no record can add turns
or end one. Only the special tokens the chat template writes itself are encoded as such (``encode``).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import re
from itertools import zip_longest
from pathlib import Path

import jinja2
import numpy as np
import pandas as pd
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from .atomic import atomic_path
from .loops import apply_loop_policy

GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


class RenderError(ValueError):
    """A conversation that cannot be rendered into token ids that are exactly its turns; ``reason`` names why."""

    reason = "render_error"


class TemplateError(RenderError):
    """The chat template cannot render this conversation, or give assistant spans for it."""

    reason = "template_error"


class SpecialTokenTextError(RenderError):
    """A message holds a special token's text and the template does not insert it verbatim, so where it lies in the
    rendering (and that it must be encoded as plain text) is unknown."""

    reason = "special_token_text"


class UnencodableTextError(RenderError):
    """A message holds characters the tokenizer has no tokens for: it gives its unknown token instead."""

    reason = "unencodable_text"


def shard_of(conversation_id: str, num_shards: int) -> int:
    """Deterministic shard of a conversation, stable when other conversations are added or removed."""
    digest = hashlib.blake2b(conversation_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % num_shards


@contextlib.contextmanager
def _refusals():
    """A template's own refusal (``raise_exception``: roles must alternate, …) as a ``TemplateError``."""
    try:
        yield
    except jinja2.TemplateError as error:
        raise TemplateError(f"the chat template refuses this conversation: {error}") from error


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool = False, **kwargs) -> str:
    with _refusals():
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and return the character spans of its assistant turns.

    With ``{% generation %}`` markers in the template, the spans are those blocks. Otherwise a span runs from
    the end of the generation prompt (for a first message, from its text) to the end of the rendered assistant
    turn, so it holds the response and the template's end-of-turn text (``<|im_end|>``): what the target
    generates. It is read off the template by rendering prefixes, which needs a template whose rendering of a
    conversation prefix is a prefix of the whole; otherwise a ``TemplateError`` says so.

    An answer marked ``"truncated": true`` (cut at a repetition loop's onset, ``loops.apply_loop_policy``) did not
    end there: its span ends with its text, so no end-of-turn token is taught after it.
    """
    if GENERATION_BLOCK.search(tokenizer.chat_template or ""):
        with _refusals():
            [text], [spans] = render_jinja_template(
                [messages], chat_template=tokenizer.get_chat_template(), return_assistant_tokens_mask=True,
                **{**tokenizer.special_tokens_map, **template_kwargs},
            )
        return text, _truncated_spans(text, spans, messages)
    text = render(tokenizer, messages, False, **template_kwargs)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = render(tokenizer, messages[: turn + 1], False, **template_kwargs)
        if turn:
            before = render(tokenizer, messages[:turn], True, **template_kwargs)
        else:  # an answer to nothing: no generation prompt before it, its span starts at its text
            parts = _template_parts(tokenizer, messages[:1], through, False, **template_kwargs)
            if parts is None:
                raise TemplateError("the conversation starts with an assistant message, and the chat template does "
                                    "not insert it verbatim, so where its text starts is unknown")
            before = parts[0]
        if not (text.startswith(through) and through.startswith(before)):
            raise TemplateError(
                "the chat template does not render conversation prefixes as prefixes of the whole; "
                "add {% generation %} markers to it so assistant tokens can be found"
            )
        spans.append((len(before), len(through)))
    return text, _truncated_spans(text, spans, messages)


def _truncated_spans(text: str, spans: list[tuple[int, int]], messages: list[dict]) -> list[tuple[int, int]]:
    """The assistant spans with each truncated answer's span ending where its text ends."""
    answers = [m for m in messages if m["role"] == "assistant"]
    if not any(m.get("truncated") for m in answers):
        return spans
    if len(answers) != len(spans):
        raise TemplateError(f"{len(spans)} assistant spans for {len(answers)} answers: where a truncated one ends is "
                            "unknown")
    out = []
    for (begin, end), message in zip(spans, answers):
        if message.get("truncated"):
            content = message["content"]
            found = [(text.find(piece, begin, end), piece) for piece in (content, content.rstrip()) if piece]
            found = [(at, piece) for at, piece in found if at >= 0]
            if not found:
                raise TemplateError("the chat template does not insert a truncated answer's text verbatim, so where "
                                    "it ends is unknown")
            end = found[0][0] + len(found[0][1])
        out.append((begin, end))
    return out


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> re.Pattern:
    """The text of the tokenizer's special tokens, longest first (as the tokenizer matches them)."""
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials)) or "(?!)")


def _template_parts(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], text: str, generation_prompt: bool, **template_kwargs
) -> list[str] | None:
    """The template's own text around the contents, ``parts[0] + content_0 + parts[1] + … + parts[-1] == text``,
    found by rendering numbered markers in place of the contents; None where the template does not insert each
    content once and verbatim."""
    marker = "\ue000"  # a private-use character; made longer until no content holds it
    while any(marker in m["content"] for m in messages):
        marker += "\ue000"
    marked = [{**m, "content": f"{marker}{i}{marker}"} for i, m in enumerate(messages)]
    try:
        pieces = re.split(f"{marker}(\\d+){marker}", render(tokenizer, marked, generation_prompt, **template_kwargs))
    except TemplateError:
        return None
    parts = pieces[0::2]
    if pieces[1::2] != [str(i) for i in range(len(messages))]:
        return None
    if "".join(part + m["content"] for part, m in zip(parts, messages)) + parts[-1] != text:
        return None
    return parts


def _encode(tokenizer: PreTrainedTokenizerBase, text: str, offset: int = 0, **kwargs) -> tuple[list[int], list[int]]:
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, **kwargs)
    return encoded["input_ids"], [offset + start for start, _ in encoded["offset_mapping"]]


def encode(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], text: str, generation_prompt: bool = False,
    **template_kwargs,
) -> tuple[list[int], list[int]]:
    """Token ids of ``text``, the template's rendering of ``messages``, and each token's first character.

    Where no message holds a special token's text, that is the tokenizer's own encoding of ``text``. Otherwise
    special tokens are encoded only where the template wrote them, and the text between them with the
    tokenizer's ``split_special_tokens`` (as plain characters); if the template does not insert each message
    verbatim, where its text lies is unknown: a ``SpecialTokenTextError``. Characters the tokenizer can only
    encode as its unknown token (SmolLM2 has no tokens for some bytes) are an ``UnencodableTextError``.
    """
    special = _special_tokens(tokenizer)
    if not any(special.search(m["content"]) for m in messages):
        ids, starts = _encode(tokenizer, text)
    else:
        parts = _template_parts(tokenizer, messages, text, generation_prompt, **template_kwargs)
        if parts is None:
            raise SpecialTokenTextError(
                "a message holds the text of a special token, and the chat template does not insert it verbatim"
            )
        structure, position = [], 0  # the character spans of the special tokens the template wrote
        for part, message in zip_longest(parts, messages):
            structure += [(position + m.start(), position + m.end()) for m in special.finditer(part)]
            position += len(part) + (len(message["content"]) if message else 0)
        ids, starts = _encode_specials_at(tokenizer, text, structure)
    unknown = tokenizer.unk_token_id
    if unknown is not None and any(i == unknown and not text.startswith(tokenizer.unk_token, s) for i, s in
                                   zip(ids, starts)):
        raise UnencodableTextError("a message holds characters the tokenizer has no tokens for")
    return ids, starts


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the generation prompt, the messages' text
    encoded as text (``encode``); a ``RenderError`` where they cannot be."""
    return encode(tokenizer, messages, render(tokenizer, messages, True, **template_kwargs), True,
                  **template_kwargs)[0]


def _encode_specials_at(
    tokenizer: PreTrainedTokenizerBase, text: str, specials: list[tuple[int, int]]
) -> tuple[list[int], list[int]]:
    """``text`` encoded with special tokens at the character spans ``specials`` and nowhere else: the text between
    them is encoded on its own, as the tokenizer does between the special tokens it finds."""
    ids, starts, done = [], [], 0
    for begin, end in [*specials, (len(text), len(text))]:
        if begin > done:
            piece_ids, piece_starts = _encode(tokenizer, text[done:begin], done, split_special_tokens=True)
            ids, starts = ids + piece_ids, starts + piece_starts
        if end > begin:
            ids.append(tokenizer.convert_tokens_to_ids(text[begin:end]))
            starts.append(begin)
        done = end
    return ids, starts


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], **template_kwargs
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (int32) and the assistant-only loss mask (uint8) of one conversation, untruncated: the tokens
    that start inside an assistant span (``assistant_char_spans``)."""
    text, spans = assistant_char_spans(tokenizer, messages, **template_kwargs)
    ids, starts = encode(tokenizer, messages, text, **template_kwargs)
    starts = np.asarray(starts, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for begin, end in spans:
        mask[(starts >= begin) & (starts < end)] = 1
    return np.asarray(ids, dtype=np.int32), mask


def tokenize_shard(
    conversations_jsonl: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    *,
    shard: int,
    num_shards: int,
    max_length: int,
    out_parquet: str | Path,
    out_counts: str | Path,
    loops: str = "keep",
    loop_ngram: int = 16,
    **template_kwargs,
) -> collections.Counter:
    """Tokenise the conversations that belong to ``shard`` and write them sorted by length.

    Length order lets extraction batch neighbours with little padding and write the store
    sequentially. Conversations that cannot be encoded as exactly their turns (``RenderError``) and samples
    with fewer than 2 supervised tokens after truncation are dropped and counted by reason. ``loops``
    (``regenerate.loops``: keep, cut or drop) decides what is trained of conversations with an answer that loops
    (``loops.apply_loop_policy``, n = ``loop_ngram``): ``loop_conversations`` counts them, ``loop_cut`` those cut at
    the onset, ``loop_dropped`` those left out.
    """
    dropped = ("template_error", "special_token_text", "unencodable_text", "too_few_supervised_tokens",
               "loop_dropped")
    counts = collections.Counter(conversations=0, truncated=0, loop_conversations=0, loop_cut=0,
                                 **dict.fromkeys(dropped, 0))
    rows = []
    with open(conversations_jsonl, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if shard_of(record["id"], num_shards) != shard:
                continue
            counts["conversations"] += 1
            messages, outcome = apply_loop_policy(record["messages"], tokenizer, loops, loop_ngram)
            counts["loop_conversations"] += outcome != "clean"
            counts["loop_cut"] += outcome == "cut"
            if messages is None:
                counts["loop_dropped"] += 1
                continue
            try:
                ids, mask = tokenize_conversation(tokenizer, messages, **template_kwargs)
            except RenderError as error:
                counts[error.reason] += 1
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
    assert counts["conversations"] == counts["samples"] + sum(counts[reason] for reason in dropped), counts
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
