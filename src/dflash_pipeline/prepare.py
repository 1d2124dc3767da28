"""Load chat conversations (OpenAI or ShareGPT shape) from .jsonl/.json/.parquet and normalise them.

Every record is either kept as ``{"id": str, "messages": [{"role", "content"}, ...]}`` with roles
system/user/assistant and each content the record's text verbatim (a list of text parts joined with
nothing between them), or dropped for the first of :data:`DROP_REASONS` that applies to it. No record
stops the job; a file that cannot be read as the format its name says does, with an :class:`InputError`
naming the file and the line, and so does a file of which no record is kept.

Reading rules per format:

* ``.jsonl``: UTF-8 (a UTF-8 byte-order mark is skipped), one record per line; blank lines are ignored,
  every line that is not JSON counts as one ``malformed_json`` and reading continues.
* ``.json``: a JSON array, streamed element by element so that a file truncated mid-record (as the
  public ShareGPT V3 dump is) still yields every complete element. A syntax error (a broken tail or
  a broken element in the middle) counts as ONE ``malformed_json``, is logged with its line, and reading
  stops there: there is no reliable way to find where the next element starts inside broken JSON.
* ``.parquet``: a ``messages`` or ``conversations`` column of lists of structs, optional ``id``.

Bytes that are not UTF-8 are carried through parsing as lone surrogates (``surrogateescape``), like a
``"\\ud800"`` escape: a record with one in its text is dropped as ``invalid_unicode``, its neighbours are read.
"""

from __future__ import annotations

import codecs
import collections
import json
import logging
import random
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dflash_pipeline.resources import resolve_path

log = logging.getLogger(__name__)

DROP_REASONS: tuple[str, ...] = (
    "malformed_json",  # not JSON
    "not_a_conversation",  # JSON, but not an object with a messages/conversations list of message objects
    "empty_conversation",
    "unknown_role",  # a role missing, not a string, or not in ROLE_MAP
    "non_text_content",  # content missing, not a string, or a list with a part that is not text
    "invalid_id",  # an id that is not a string or an integer
    "invalid_unicode",  # text with a lone surrogate (bytes that are not UTF-8, or an escape like "\ud800")
    "no_assistant_turn",
    "no_prompt",  # prompt formats (sources.py): no prompt where the format reads one, or no user message in it
    "prefix_of_another",  # chatrag: a dialogue prefix of a longer record of the same dialogue (read from that one)
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

# Byte-order marks of encodings other than UTF-8 (UTF-32 first: its little-endian mark begins with UTF-16's).
OTHER_ENCODINGS = {
    codecs.BOM_UTF32_LE: "UTF-32",
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}

FORMATS = {  # what a file of each type must be
    ".jsonl": "UTF-8 text with one JSON record per line",
    ".json": "one UTF-8 JSON array of records",
    ".parquet": "a Parquet table with a messages or conversations column",
}

MALFORMED = object()  # stands for a line/element that is not valid JSON
_SEPARATORS = re.compile(r"[\s,]*")


class InputError(ValueError):
    """A conversation file that cannot be read as the format its name says; the message says where."""


def _decode(path: Path, data: bytes) -> str:
    for bom, encoding in OTHER_ENCODINGS.items():
        if data.startswith(bom):
            raise InputError(
                f"{path} is {encoding} text (byte-order mark at byte 0), but a {path.suffix} file must be UTF-8: "
                f"convert it, e.g. with iconv -f {encoding} -t UTF-8"
            )
    return data.removeprefix(codecs.BOM_UTF8).decode("utf-8", errors="surrogateescape")


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # syntax errors, numbers over Python's digit limit, deep nesting
        return MALFORMED


def iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            text = _decode(path, line) if number == 1 else line.decode("utf-8", errors="surrogateescape")
            if text.strip(" \t\r\n"):
                yield f"line {number}", _parse(text)


def iter_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    text = _decode(path, path.read_bytes())
    decoder = json.JSONDecoder()
    pos = _SEPARATORS.match(text).end()
    if not text.startswith("[", pos):
        if pos == len(text):
            raise InputError(f"{path} is empty, but a .json file must hold one JSON array of records")
        line = text.count("\n", 0, pos) + 1
        hint = "; a file of one JSON record per line must be named .jsonl" if text[pos] == "{" else ""
        raise InputError(f"{path} must hold one JSON array of records (a .json file), but line {line} starts "
                         f"with {text[pos]!r}{hint}")
    pos, line, counted = pos + 1, 1, 0
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if text.startswith("]", pos):
            return
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            element, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError) as error:  # broken or truncated element: count once, cannot resync
            log.warning("%s: the element at line %d is not JSON (%s); reading stops there (the %d characters from "
                        "it to the end are not read)", path, line, getattr(error, "msg", type(error).__name__),
                        len(text) - pos)
            yield f"line {line}", MALFORMED
            return
        yield f"line {line}", element


def iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except pa.ArrowException as error:
        raise InputError(f"{path} cannot be read as a Parquet file: {error}") from error
    for number, row in enumerate(rows, 1):
        yield f"row {number}", row


def iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` per record of ``path``: where is ``line N`` or ``row N``; a record that is not JSON is
    ``MALFORMED``."""
    suffix = path.suffix.lower()
    readers = {".jsonl": iter_jsonl, ".json": iter_json_array, ".parquet": iter_parquet}
    if suffix not in readers:
        raise InputError(f"{path}: unsupported conversation file type {suffix!r} ({', '.join(FORMATS)})")
    if path.is_dir():
        raise InputError(f"{path} is a directory; data.source must name one .jsonl, .json or .parquet file")
    return readers[suffix](path)


def _text(content: Any) -> str | None:
    """The text of a message content (a str, or a list of text parts), None if it is not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def normalise_record(record: Any, default_id: str, require_assistant: bool = True) -> tuple[dict | None, str | None]:
    """Return ``(normalised record, None)`` or ``(None, drop reason)``; duplicates are checked later."""
    if not isinstance(record, dict):
        return None, "not_a_conversation"
    turns = record.get("messages")
    if not isinstance(turns, list):
        turns = record.get("conversations")
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None, "not_a_conversation"
    if not turns:
        return None, "empty_conversation"
    raw_roles = [t.get("role") if "role" in t else t.get("from") for t in turns]
    roles = [ROLE_MAP.get(r.lower()) if isinstance(r, str) else None for r in raw_roles]
    if None in roles:
        return None, "unknown_role"
    texts = [_text(t.get("content") if "content" in t else t.get("value")) for t in turns]
    if None in texts:
        return None, "non_text_content"
    rid = record.get("id")
    if rid is None or rid == "":
        rid = default_id
    elif isinstance(rid, int) and not isinstance(rid, bool):
        rid = str(rid)
    elif not isinstance(rid, str):
        return None, "invalid_id"
    if not all(map(_is_unicode, (rid, *texts))):
        return None, "invalid_unicode"
    if require_assistant and "assistant" not in roles:
        return None, "no_assistant_turn"
    messages = [{"role": r, "content": c} for r, c in zip(roles, texts)]
    return {"id": rid, "messages": messages}, None


def collect(items: Iterable[tuple[str, Any]], normalise: Callable, label: str,
            seen_ids: set[str]) -> tuple[list[tuple[dict, Any]], collections.Counter]:
    """Normalise ``(where, record)`` items of one file: the kept ``(record, raw record)`` pairs in order, and a Counter
    with ``read``, one key per drop reason (zeros included) and ``first_drop`` (where, in words) when one was dropped.
    ``normalise(record, default_id)`` returns ``(record, None)`` or ``(None, reason)``; an id in ``seen_ids`` (which
    grows) is a ``duplicate_id``; each drop is logged with ``label`` and where it is."""
    counts: collections.Counter = collections.Counter({"read": 0, **dict.fromkeys(DROP_REASONS, 0)})
    kept = []
    for index, (where, record) in enumerate(items):
        counts["read"] += 1
        if record is MALFORMED:
            normalised, reason = None, "malformed_json"
        else:
            normalised, reason = normalise(record, f"{label}:{index}")
        if normalised is not None and normalised["id"] in seen_ids:
            normalised, reason = None, "duplicate_id"
        if normalised is None:
            counts[reason] += 1
            counts.setdefault("first_drop", f"{where} ({reason})")
            log.info("%s %s: dropped (%s)", label, where, reason)
            continue
        seen_ids.add(normalised["id"])
        kept.append((normalised, record))
    return kept, counts


def read_conversations(source: str) -> tuple[list[dict], collections.Counter]:
    """Read and normalise all records of ``source`` (a path or ``pkg:<package>/<relpath>``).

    Returns the kept records in file order and a Counter with ``read`` (records seen, malformed
    included), one key per drop reason (zeros included) and ``valid``; each drop is logged with its line.
    Raises :class:`InputError` for a file that cannot be read, or of which no record is kept.
    """
    path = resolve_path(source)
    try:
        pairs, counts = collect(iter_records(path), normalise_record, path.name, set())
    except OSError as error:
        raise InputError(f"{path} cannot be read: {error.strerror or error}") from error
    first_drop = counts.pop("first_drop", None)
    counts["valid"] = len(pairs)
    if not counts["read"]:
        raise InputError(f"{path} holds no records")
    if not pairs:
        dropped = ", ".join(f"{counts[r]} {r}" for r in DROP_REASONS if counts[r])
        raise InputError(f"{path}: none of its {counts['read']} records is kept ({dropped}; the first is "
                         f"{first_drop}): is it {FORMATS[path.suffix.lower()]}?")
    return [record for record, _ in pairs], counts


def select_subset(records: list[dict], max_conversations: int | None, seed: int | str) -> list[dict]:
    """A seeded random subset of at most ``max_conversations`` records, kept in original order."""
    if max_conversations is None or max_conversations >= len(records):
        return list(records)
    if max_conversations < 0:
        raise ValueError(f"max_conversations must be >= 0, got {max_conversations}")
    indices = sorted(random.Random(seed).sample(range(len(records)), max_conversations))
    return [records[i] for i in indices]
