"""A GGUF file's header fields, read only as far as needed: the workflow asks a GGUF target's depth when it builds
the DAG (rules/common.smk), before any job runs. ``gguf.GGUFReader`` parses every field, the tokenizer's ~49k
strings included, into numpy views: 34 s for the default SmolLM2 file on the 2-core VM, against well under a
millisecond here."""

from __future__ import annotations

import struct
from pathlib import Path

# GGUF value types: 0..7 and 10..12 are scalars (struct codes below), 8 string, 9 array
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd"))
_STRING, _ARRAY = 8, 9


def gguf_block_count(path: str | Path) -> int | None:
    """``<architecture>.block_count`` (the decoder layers) from a GGUF file's header, read up to that key; no tensor
    is touched. None if the file is not GGUF (version 2 or later) or has no such key."""
    with open(path, "rb") as f:

        def read(fmt):
            return struct.unpack(f"<{fmt}", f.read(struct.calcsize(f"<{fmt}")))[0]

        def value(kind):
            if kind == _STRING:
                return f.read(read("Q")).decode("utf-8", "replace")
            if kind == _ARRAY:  # skipped
                item, count = read("I"), read("Q")
                if item in _SCALARS:
                    f.seek(count * struct.calcsize(f"<{_SCALARS[item]}"), 1)
                else:
                    for _ in range(count):
                        value(item)
                return None
            return read(_SCALARS[kind])

        if f.read(4) != b"GGUF" or read("I") < 2:
            return None
        read("Q")  # tensor count
        fields = {}
        for _ in range(read("Q")):
            key = value(_STRING)
            fields[key] = value(read("I"))
            architecture = fields.get("general.architecture")
            if architecture and f"{architecture}.block_count" in fields:
                return int(fields[f"{architecture}.block_count"])
    return None
