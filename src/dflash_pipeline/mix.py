"""What the prepare stage writes: the conversations of ``data.source``, or the mix of ``data.sources`` (issue #36),
capped, checked against the prompts the run is scored on, and counted.

In order: each source is read by its format's reader (drops counted by reason, ``sources.py``); per task a seeded
subset of at most ``max_per_task`` records; per source a seeded subset of at most ``max_conversations``; of all
sources together a seeded subset of at most ``data.max_conversations``; then every system and user message of what is
left is checked against the scored prompts (``leakage.py``): a match stops the job naming the conversation and the
scored prompt (``data.leakage.action: fail``) or drops the conversation, counted as ``leaked``
(``drop``). Every record ends in one row: read = valid + the drops, valid = over_task_cap + over_source_cap +
over_total_cap + leaked + selected, per source and in ``all``.

``data.sources`` ids are ``<source name>/<id>`` (unique across sources) and each record carries ``source`` and
``task``; ``data.source`` (one file, as before issue #36) keeps its ids and writes ``{"id", "messages"}`` records, so
its selection and output are what they were.
"""

from __future__ import annotations

import collections
import json
import logging

from .atomic import atomic_path
from .leakage import Leak, LeakCheck, read_scored
from .prepare import DROP_REASONS, read_conversations, select_subset
from .sources import Source, read_source

log = logging.getLogger(__name__)

FATES = ("over_task_cap", "over_source_cap", "over_total_cap", "leaked", "selected")
ROWS = ("read", *DROP_REASONS, "valid", *FATES)
LEAK_COLUMNS = ("source", "conversation", "message", "benchmark", "prompt_id", "turn", "kind", "score",
                "training_text", "scored_text")


class LeakError(ValueError):
    """Training conversations that hold a prompt of a scored set (``data.leakage.action: fail``)."""


def _capped(records: list[dict], cap: int | None, seed: str, fate: dict, reason: str) -> list[dict]:
    chosen = select_subset(records, cap, seed)
    ids = {r["id"] for r in chosen}
    for record in records:
        if record["id"] not in ids:
            fate[record["id"]] = reason
    return chosen


def _per_task(records: list[dict], cap: int | None, seed: str, fate: dict) -> list[dict]:
    if cap is None:
        return records
    tasks = collections.defaultdict(list)
    for record in records:
        tasks[record["task"]].append(record)
    kept = {r["id"] for task, group in tasks.items() for r in _capped(group, cap, f"{seed}/{task}", fate,
                                                                      "over_task_cap")}
    return [r for r in records if r["id"] in kept]


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def describe(leak: Leak, record: dict) -> str:
    scored = leak.scored
    return (f"conversation {leak.conversation} message {leak.message} matches {scored.benchmark} prompt "
            f"{scored.prompt_id} turn {scored.turn} ({leak.kind} {leak.score:.3f}): "
            f"{_short(record['messages'][leak.message]['content'], 120)!r} ~ {_short(scored.text, 120)!r}")


def find_leaks(records: list[dict], scored: dict[str, str], settings: dict) -> list[tuple[Leak, dict]]:
    """Each record with a message that matches a prompt of the ``scored`` benchmark files, with its first match."""
    check = LeakCheck(read_scored(scored), jaccard=settings.get("jaccard", 0.75),
                      containment=settings.get("containment", 0.9))
    log.info("leakage check: %d conversations against %d scored prompt turns of %s", len(records), len(check.scored),
             ", ".join(scored))
    return [(leak, record) for record in records if (leak := check.check(record))]


def _write_tables(names: list[str], counts: dict[str, collections.Counter], tasks: collections.Counter,
                  leaks: list[tuple[str, Leak, dict]], out_counts, out_tasks, out_leaks) -> None:
    with atomic_path(out_counts) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("\t".join(["reason", *names, "all"]) + "\n")
        f.writelines("\t".join([row, *(str(counts[n][row]) for n in [*names, "all"])]) + "\n" for row in ROWS)
    if out_tasks:
        with atomic_path(out_tasks) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write("\t".join(["source", "task", "valid", *FATES]) + "\n")
            for source, task in sorted({(s, t) for s, t, _ in tasks}, key=lambda k: (names.index(k[0]), k[1])):
                row = [tasks[source, task, fate] for fate in FATES]
                f.write("\t".join([source, task, str(sum(row)), *map(str, row)]) + "\n")
    if out_leaks:
        with atomic_path(out_leaks) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write("\t".join(LEAK_COLUMNS) + "\n")
            for source, leak, record in leaks:
                s = leak.scored
                f.write("\t".join(map(str, [source, leak.conversation, leak.message, s.benchmark, s.prompt_id, s.turn,
                                            leak.kind, f"{leak.score:.3f}",
                                            _short(record["messages"][leak.message]["content"]), _short(s.text)]))
                        + "\n")


def prepare_mix(sources: list[Source], out_jsonl, out_counts, *, out_tasks=None, out_leaks=None,
                max_conversations: int | None = None, seed: int = 0, scored: dict[str, str] | None = None,
                leakage: dict | None = None, single: bool = False) -> dict[str, collections.Counter]:
    """Read, cap, check and write the conversations (module docstring); ``single``: the one source of
    ``data.source``, read and written as before issue #36. Returns the counts per source name and ``all``."""
    names = [source.name for source in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"data.sources: names must be unique, got {names}")
    counts: dict[str, collections.Counter] = {}
    fate: dict[str, str] = {}  # id -> the row of a valid record that is not selected
    valid: list[dict] = []
    pool: list[dict] = []
    for source in sources:
        if single:
            records, counts[source.name] = read_conversations(source.path)
            records = [{"id": r["id"], "source": source.name, "task": None, "messages": r["messages"]} for r in records]
        else:
            records, counts[source.name] = read_source(source)
            records = [{"id": f"{source.name}/{r['id']}", "source": source.name, "task": r["task"],
                        "messages": r["messages"]} for r in records]
        valid += records
        records = _per_task(records, source.max_per_task, f"{seed}/{source.name}", fate)
        pool += _capped(records, source.max_conversations, f"{seed}/{source.name}", fate, "over_source_cap")
    chosen = _capped(pool, max_conversations, seed, fate, "over_total_cap")
    leaks = find_leaks(chosen, scored, leakage or {}) if scored else []
    for leak, record in leaks:
        log.warning("leak: %s", describe(leak, record))
    if leaks and (leakage or {}).get("action", "fail") == "fail":
        shown = "\n  ".join(describe(leak, record) for leak, record in leaks[:10])
        more = f"\n  ... and {len(leaks) - 10} more (the job's log names them all)" if len(leaks) > 10 else ""
        raise LeakError(f"{len(leaks)} of the {len(chosen)} selected conversations hold a prompt of a scored set "
                        f"({', '.join(scored)}):\n  {shown}{more}\nRemove them from the source, or set "
                        f"data.leakage.action: drop to drop and count them.")
    for leak, _ in leaks:
        fate[leak.conversation] = "leaked"
    tasks: collections.Counter = collections.Counter()
    for record in valid:
        row = fate.get(record["id"], "selected")
        counts[record["source"]][row] += 1
        if record["task"] is not None:
            tasks[record["source"], record["task"], row] += 1
    counts["all"] = collections.Counter(dict.fromkeys(ROWS, 0))
    for name in names:
        counts["all"].update(counts[name])
    for name in names:
        assert counts[name]["read"] == counts[name]["valid"] + sum(counts[name][r] for r in DROP_REASONS), name
        assert counts[name]["valid"] == sum(counts[name][r] for r in FATES), name
    with atomic_path(out_jsonl) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for record in chosen:
            if record["id"] not in fate:
                kept = {"id": record["id"], "messages": record["messages"]} if single else record
                f.write(json.dumps(kept, ensure_ascii=False) + "\n")
    _write_tables(names, counts, tasks, [(r["source"], leak, r) for leak, r in leaks], out_counts, out_tasks,
                  out_leaks)
    log.info("prepare: %s", {name: dict(counts[name]) for name in [*names, "all"]})
    return counts


def prepare_file(source: str, out_jsonl, out_counts, max_conversations: int | None = None, seed: int = 0, *,
                 scored: dict[str, str] | None = None, leakage: dict | None = None) -> collections.Counter:
    """``data.source``: one conversations file, its ids and selection as before issue #36 -> its counts."""
    return prepare_mix([Source("source", str(source))], out_jsonl, out_counts, max_conversations=max_conversations,
                       seed=seed, scored=scored, leakage=leakage, single=True)["source"]
