"""Load chat conversations (OpenAI or ShareGPT shape) from .jsonl/.json/.parquet and normalise them.

Every record is either kept as ``{"id": str, "messages": [{"role", "content"}, ...]}`` with
roles system/user/assistant and the text content kept verbatim, or dropped for the first of
:data:`DROP_REASONS` that applies to it.

Reading rules per format:

* ``.jsonl``: one record per line; blank lines are ignored, every bad line counts as one
  ``malformed_json`` and reading continues.
* ``.json``: a JSON array, streamed element by element so that a file truncated mid-record (as the
  public ShareGPT V3 dump is) still yields every complete element. A syntax error (a broken tail or
  a broken element in the middle) counts as ONE ``malformed_json`` and reading stops there: there is
  no reliable way to find where the next element starts inside broken JSON.
* ``.parquet``: a ``messages`` or ``conversations`` column of lists of structs, optional ``id``.
"""

from __future__ import annotations

import collections
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_pipeline.atomic import atomic_path
from dflash_pipeline.resources import resolve_path

DROP_REASONS: tuple[str, ...] = (
    "malformed_json",
    "empty_conversation",
    "unknown_role",
    "non_text_content",
    "no_assistant_turn",
    "duplicate_id",
)

ROLE_MAP: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

_MALFORMED = object()  # stands for a line/element that is not valid JSON
_SEPARATORS = re.compile(r"[\s,]*")


def _iter_jsonl(path: Path) -> Iterator[Any]:
    with open(path, encoding="utf-8-sig") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield _MALFORMED


def _iter_json_array(path: Path) -> Iterator[Any]:
    text = path.read_text(encoding="utf-8-sig")
    decoder = json.JSONDecoder()
    pos = _SEPARATORS.match(text).end()
    if not text.startswith("[", pos):
        raise ValueError(f"{path}: expected a JSON array of records")
    pos += 1
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if text.startswith("]", pos):
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:  # broken or truncated element: count once, cannot resync
            yield _MALFORMED
            return
        yield element


def _iter_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    yield from pq.read_table(path).to_pylist()


def _iter_records(path: Path) -> Iterator[Any]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _iter_jsonl(path)
    if suffix == ".json":
        return _iter_json_array(path)
    if suffix == ".parquet":
        return _iter_parquet(path)
    raise ValueError(f"{path}: unsupported conversation file type {suffix!r} (.jsonl, .json, .parquet)")


def _text(content: Any) -> str | None:
    """The text of a message content (a str, or a list of text parts), None if it is not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def normalise_record(record: Any, default_id: str, require_assistant: bool = True) -> tuple[dict | None, str | None]:
    """Return ``(normalised record, None)`` or ``(None, drop reason)``; duplicates are checked later."""
    if not isinstance(record, dict):
        return None, "malformed_json"
    turns = record.get("messages")
    if not isinstance(turns, list):
        turns = record.get("conversations")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None, "malformed_json"
    if not turns:
        return None, "empty_conversation"
    raw_roles = [t.get("role") if "role" in t else t.get("from") for t in turns]
    roles = [ROLE_MAP.get(r.lower()) if isinstance(r, str) else None for r in raw_roles]
    if None in roles:
        return None, "unknown_role"
    texts = [_text(t.get("content") if "content" in t else t.get("value")) for t in turns]
    if None in texts:
        return None, "non_text_content"
    if require_assistant and "assistant" not in roles:
        return None, "no_assistant_turn"
    rid = record.get("id")
    rid = default_id if rid is None or rid == "" else str(rid)
    messages = [{"role": r, "content": c} for r, c in zip(roles, texts)]
    return {"id": rid, "messages": messages}, None


def read_conversations(source: str) -> tuple[list[dict], collections.Counter]:
    """Read and normalise all records of ``source`` (a path or ``pkg:<package>/<relpath>``).

    Returns the kept records in file order and a Counter with ``read`` (records seen, malformed
    included), one key per drop reason (zeros included) and ``valid``.
    """
    path = resolve_path(source)
    counts: collections.Counter = collections.Counter({"read": 0, **dict.fromkeys(DROP_REASONS, 0), "valid": 0})
    kept: list[dict] = []
    seen_ids: set[str] = set()
    for index, record in enumerate(_iter_records(path)):
        counts["read"] += 1
        normalised, reason = normalise_record(record, f"{path.name}:{index}")
        if normalised is not None and normalised["id"] in seen_ids:
            normalised, reason = None, "duplicate_id"
        if normalised is None:
            counts[reason] += 1
            continue
        seen_ids.add(normalised["id"])
        kept.append(normalised)
    counts["valid"] = len(kept)
    return kept, counts


def select_subset(records: list[dict], max_conversations: int | None, seed: int) -> list[dict]:
    """A seeded random subset of at most ``max_conversations`` records, kept in original order."""
    if max_conversations is None or max_conversations >= len(records):
        return list(records)
    if max_conversations < 0:
        raise ValueError(f"max_conversations must be >= 0, got {max_conversations}")
    indices = sorted(random.Random(seed).sample(range(len(records)), max_conversations))
    return [records[i] for i in indices]


def prepare(
    source: str, out_jsonl: str, out_counts_tsv: str, max_conversations: int | None, seed: int
) -> collections.Counter:
    """Read ``source``, select a subset and write it as JSONL plus a ``reason\\tcount`` TSV (atomically)."""
    records, counts = read_conversations(source)
    selected = select_subset(records, max_conversations, seed)
    counts["selected"] = len(selected)
    with atomic_path(out_jsonl) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for record in selected:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    with atomic_path(out_counts_tsv) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("reason\tcount\n")
        for key in ("read", *DROP_REASONS, "valid", "selected"):
            f.write(f"{key}\t{counts[key]}\n")
    return counts
