"""The sources of ``data.sources`` (issue #36): files or folders of conversations or prompts, each read by the reader
of its ``format``, into prepare's records plus a task label (for per-task caps and counts).

Formats (docs/data-sources.md says which package file each was written for):

- ``conversations``: OpenAI ``messages`` or ShareGPT ``conversations`` records, read as prepare always has
  (``prepare.normalise_record``; a record needs an assistant turn).
- ``prompts``: one prompt per record in ``prompt_field``: a string (one user message) or a list of chat messages
  (system and user texts kept verbatim; each assistant message, someone else's answer, becomes a placeholder). With
  ``prompt_template`` the user message is instead that ``str.format`` template filled from the record's fields
  (e.g. an MMLU question with its four options); a field it names that the record lacks, or that is not text or a
  number, makes the record ``no_prompt``.
- ``bfcl``: Berkeley Function Calling Leaderboard records, JSON lines (whatever the file's suffix): ``question`` (a
  string, a list of messages or a list of turns of messages) under BFCL's own system prompt with the record's
  ``function`` list. Records without a ``function`` list (the multi-turn categories: their functions are the eval
  harness's classes and their later turns presume executed calls) are counted ``no_prompt``.
- ``chatrag``: ChatRAG-Bench (nvidia-lm-eval): one JSON array of dialogue prefixes, each with ``messages`` and the
  ``ctxs`` retrieved from ``documents.json`` beside it. Each dialogue is read once, from its longest record (the
  others are counted ``prefix_of_another``); the system message is lm-eval's instruction and the first ``contexts``
  retrieved documents; consecutive messages of one role are one message, joined by a space, as lm-eval does.

Prompt records end with an assistant placeholder, ``{"role": "assistant", "content": null}``, after each user turn:
regenerate writes the target's answer there (so these formats need ``regenerate.enabled``).
"""

from __future__ import annotations

import collections
import fnmatch
import json
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .prepare import (DROP_REASONS, MALFORMED, ROLE_MAP, InputError, collect, iter_json_array, iter_jsonl,
                      iter_records, normalise_record)
from .resources import resolve_path

SOURCE_FORMATS = ("conversations", "prompts", "bfcl", "chatrag")
PLACEHOLDER = {"role": "assistant", "content": None}

# BFCL's prompt for chat models without native function calling (bfcl/model_handler/constant.py,
# DEFAULT_SYSTEM_PROMPT, Apache-2.0), as system_prompt_pre_processing_chat_model puts it before the question.
BFCL_SYSTEM_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible \
functions. Based on the question, you will need to make one or more function/tool calls to achieve the purpose.
If none of the functions can be used, point it out. If the given question lacks the parameters required by the \
function, also point it out.
You should only return the function calls in your response.

If you decide to invoke any of the function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, \
params_name2=params_value2...), func_name2(params)]
You SHOULD NOT include any other text in the response.

At each turn, you should try your best to complete the tasks requested by the user within the current turn. Continue \
to output functions to call until you have fulfilled the user's request to the best of your ability. Once you have no \
more functions to call, the system will consider the current turn complete and proceed to the next turn or task.

Here is a list of functions in JSON format that you can invoke.
{functions}

"""

# lm_eval/tasks/chatrag_bench/utils.py's SYSTEM, without its "System: " prefix (here it is a system message).
CHATRAG_SYSTEM = ("This is a chat between a user and an artificial intelligence assistant. The assistant gives helpful, "
                  "detailed, and polite answers to the user's questions based on the context. The assistant should also "
                  "indicate when the answer cannot be found in the context.")


@dataclass(frozen=True)
class Source:
    """One entry of ``data.sources`` (config/README.md)."""

    name: str
    path: str
    format: str = "conversations"
    files: str | None = None  # glob of the files of a folder path
    exclude: tuple[str, ...] = ()  # fnmatch patterns of folder-relative paths left out (e.g. "steganography/*")
    prompt_field: str = "prompt"
    prompt_template: str | None = None
    task_field: str | None = None
    contexts: int = 5
    max_conversations: int | None = None
    max_per_task: int | None = None

    @classmethod
    def from_config(cls, entry: dict) -> Source:
        if entry.get("format", "conversations") not in SOURCE_FORMATS:
            raise ValueError(f"data.sources {entry.get('name')}: format {entry.get('format')!r}, not one of "
                             f"{SOURCE_FORMATS}")
        template = entry.get("prompt_template")
        if template is not None:
            try:
                names = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
            except ValueError as error:
                raise ValueError(f"data.sources {entry.get('name')}: prompt_template: {error}") from None
            if not names or not all(name.isidentifier() for name in names):
                raise ValueError(f"data.sources {entry.get('name')}: prompt_template {template!r} must name record "
                                 "fields, each as {field} ({{ and }} for literal braces)")
        return cls(**{**entry, "exclude": tuple(entry.get("exclude") or ())})


def source_files(source: Source) -> list[tuple[Path, str | None]]:
    """``(file, task from its place)`` per file of a source: the path itself (no task), or for a folder every file
    ``files`` matches and no ``exclude`` pattern does (sorted), its task the first folder under the source's (a file
    directly in it: its stem)."""
    path = resolve_path(source.path)
    if not path.is_dir():
        if source.files:
            raise InputError(f"data.sources {source.name}: files {source.files!r} is set but {path} is not a folder")
        return [(path, None)]
    if not source.files:
        raise InputError(f"data.sources {source.name}: {path} is a folder; set files (a glob such as **/*.jsonl)")
    found = sorted(p for p in path.glob(source.files) if p.is_file() and not any(
        fnmatch.fnmatchcase(p.relative_to(path).as_posix(), pattern) for pattern in source.exclude))
    if not found:
        raise InputError(f"data.sources {source.name}: no file under {path} matches {source.files!r}")
    return [(p, p.relative_to(path).parts[0] if len(p.relative_to(path).parts) > 1 else p.stem) for p in found]


def _with_placeholders(messages: list[dict]) -> list[dict]:
    """Assistant texts replaced by placeholders; one more after a trailing user or system message."""
    out = [dict(PLACEHOLDER) if m["role"] == "assistant" else m for m in messages]
    return out if out[-1]["role"] == "assistant" else out + [dict(PLACEHOLDER)]


def _without_answer(message: Any) -> Any:
    """An assistant message with its text left out (someone else's answer, or a placeholder already)."""
    role = message.get("role", message.get("from")) if isinstance(message, dict) else None
    if isinstance(role, str) and ROLE_MAP.get(role.lower()) == "assistant":
        return {"role": "assistant", "content": ""}
    return message


def prompt_record(messages: Any, default_id: str, record_id: Any = None) -> tuple[dict | None, str | None]:
    """A prompt record from a string or a list of chat messages, through ``normalise_record``'s checks (an
    assistant message's content is not read: it becomes a placeholder)."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list) or not messages:
        return None, "no_prompt"
    messages = [_without_answer(m) for m in messages]
    normalised, reason = normalise_record({"id": record_id, "messages": messages}, default_id, require_assistant=False)
    if reason in ("not_a_conversation", "empty_conversation"):
        return None, "no_prompt"
    if normalised is None:
        return None, reason
    if not any(m["role"] == "user" for m in normalised["messages"]):
        return None, "no_prompt"
    normalised["messages"] = _with_placeholders(normalised["messages"])
    return normalised, None


def _filled(template: str, record: dict) -> str | None:
    """``template`` filled from ``record``'s text and number fields; None when it names any other."""
    fields = {k: v for k, v in record.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
    try:
        return template.format_map(fields)
    except KeyError:
        return None


def _prompts(source: Source) -> Callable:
    def normalise(record: Any, default_id: str) -> tuple[dict | None, str | None]:
        if not isinstance(record, dict):
            return None, "no_prompt"
        if source.prompt_template is not None:
            return prompt_record(_filled(source.prompt_template, record), default_id, record.get("id"))
        return prompt_record(record.get(source.prompt_field), default_id, record.get("id"))
    return normalise


def _bfcl(record: Any, default_id: str) -> tuple[dict | None, str | None]:
    if not isinstance(record, dict) or not isinstance(record.get("function"), list):
        return None, "no_prompt"
    question = record.get("question")
    if isinstance(question, list) and question and all(isinstance(turn, list) for turn in question):
        if not all(question):
            return None, "no_prompt"  # a turn without a message
        turns = question
    else:
        turns = [[{"role": "user", "content": question}] if isinstance(question, str) else question]
    if not all(isinstance(turn, list) and all(isinstance(m, dict) for m in turn) for turn in turns):
        return None, "no_prompt"
    system = BFCL_SYSTEM_PROMPT.format(functions=json.dumps(record["function"], ensure_ascii=False))
    messages = [m for turn in turns for m in [*turn, PLACEHOLDER]]
    if messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        messages[0] = {"role": "system", "content": system + "\n\n" + messages[0]["content"]}
    else:
        messages.insert(0, {"role": "system", "content": system})
    return prompt_record(messages, default_id, record.get("id"))


def _joined_roles(messages: list) -> list:
    """Consecutive messages of one role as one, their texts joined by a space (lm-eval's process_messages)."""
    out = []
    for message in messages:
        if out and isinstance(message, dict) and isinstance(out[-1], dict) and message.get("role") == out[-1].get(
                "role") and isinstance(message.get("content"), str) and isinstance(out[-1].get("content"), str):
            out[-1] = {**out[-1], "content": out[-1]["content"] + " " + message["content"]}
        else:
            out.append(message)
    return out


def _chatrag(source: Source, path: Path) -> tuple[Iterator[tuple[str, Any]], Callable]:
    documents_path = path.parent / "documents.json"
    try:
        documents = json.loads(documents_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise InputError(f"{documents_path} (the documents of {path}) cannot be read: {error}") from error
    items = list(iter_json_array(path))

    def key(record):
        messages = record.get("messages") if isinstance(record, dict) else None
        return json.dumps(messages) if isinstance(messages, list) else None
    prefixes = set()
    for _, record in items:
        if record is not MALFORMED and key(record) is not None:
            messages = record["messages"]
            prefixes.update(json.dumps(messages[:end]) for end in range(1, len(messages)))

    def normalise(record: Any, default_id: str) -> tuple[dict | None, str | None]:
        if not isinstance(record, dict) or key(record) is None:
            return None, "no_prompt"
        if key(record) in prefixes:
            return None, "prefix_of_another"
        try:
            contexts = [documents[record["document"]][i] for i in record["ctxs"][: source.contexts]]
        except (KeyError, IndexError, TypeError):
            return None, "no_prompt"  # a document or context the documents file does not hold
        system = "\n\n".join([CHATRAG_SYSTEM, *map(str, contexts)])
        return prompt_record([{"role": "system", "content": system}, *_joined_roles(record["messages"])], default_id,
                             record.get("id"))
    return iter(items), normalise


def read_source(source: Source) -> tuple[list[dict], collections.Counter]:
    """The kept records of every file of ``source`` (``{"id", "task", "messages"}``, ids without the source's name)
    and their counts (prepare's rows). A source of which no record is kept stops the job, naming it."""
    counts = collections.Counter({"read": 0, **dict.fromkeys(DROP_REASONS, 0)})
    kept: list[dict] = []
    seen: set[str] = set()
    root = resolve_path(source.path)
    for path, place in source_files(source):
        label = str(path.relative_to(root)) if root.is_dir() else path.name
        if source.format == "chatrag":
            items, normalise = _chatrag(source, path)
        elif source.format == "bfcl":
            items, normalise = iter_jsonl(path), _bfcl
        else:
            items = iter_records(path)
            normalise = _prompts(source) if source.format == "prompts" else normalise_record
        try:
            pairs, file_counts = collect(items, normalise, label, seen)
        except OSError as error:
            raise InputError(f"{path} cannot be read: {error.strerror or error}") from error
        file_counts.pop("first_drop", None)
        counts.update(file_counts)
        for record, raw in pairs:
            task = raw.get(source.task_field) if source.task_field and isinstance(raw, dict) else place
            kept.append({"id": record["id"], "task": None if task is None else str(task), "messages": record["messages"]})
    counts["valid"] = len(kept)
    if not kept:
        dropped = ", ".join(f"{counts[r]} {r}" for r in DROP_REASONS if counts[r])
        raise InputError(f"data.sources {source.name} ({source.path}): none of its {counts['read']} records is kept"
                         f"{f' ({dropped})' if dropped else ''}: is it the {source.format} format (config/README.md)?")
    return kept, counts
