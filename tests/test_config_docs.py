"""Every key of config/schema.yaml, at every nesting level, is documented in config/README.md's key table: a row
that names it (``| `a.b`, `c` |`` names a.b and a.c), or, for the keys inside a list's items, a map's values or a
dict-valued key (``data.sources``' ``name``, ``evaluate.benchmarks``' ``prompts``, ``train.rope_scaling``'s
``factor``), its name in backquotes in the row of the key that holds them."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

CONFIG = Path(__file__).resolve().parents[1] / "config"


def schema_keys(node: dict, prefix: str = "") -> dict[str, list[str]]:
    """Key path -> the names of the keys inside it (its object's properties, its items', or its values')."""
    keys: dict[str, list[str]] = {}
    for name, sub in (node.get("properties") or {}).items():
        keys[prefix + name] = []
        inner = {}
        for part in [sub, sub.get("items"), sub.get("additionalProperties"), *sub.get("anyOf", []),
                     *sub.get("oneOf", [])]:
            if isinstance(part, dict):
                inner.update(part.get("properties") or {})
                if isinstance(part.get("items"), dict):
                    inner.update(part["items"].get("properties") or {})
                if isinstance(part.get("additionalProperties"), dict):
                    inner.update(part["additionalProperties"].get("properties") or {})
        if "properties" in sub:  # a section: its keys are paths of their own
            keys.update(schema_keys(sub, f"{prefix}{name}."))
        else:
            keys[prefix + name] = sorted(inner)
    return keys


def documented_rows() -> dict[str, str]:
    """Key path -> its row of the README's key table (the table under ``| key | meaning |``)."""
    text = (CONFIG / "README.md").read_text()
    table = text.split("| key | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", first)
        if not names:
            continue
        parent = names[0].rsplit(".", 1)[0]
        for name in names:
            rows[name if "." in name else f"{parent}.{name}"] = line
    return rows


def undocumented() -> list[str]:
    schema = yaml.safe_load((CONFIG / "schema.yaml").read_text())
    keys, rows = schema_keys(schema), documented_rows()
    sections = {path.rsplit(".", 1)[0] for path in keys if "." in path}
    missing = []
    for path, inner in sorted(keys.items()):
        if path in rows:
            missing += [f"{path}: {name}" for name in inner if f"`{name}`" not in rows[path]]
        elif path in sections:
            continue  # a section is its keys
        elif not (path.rsplit(".", 1)[0] in rows and f"`{path.rsplit('.', 1)[1]}`" in rows[path.rsplit(".", 1)[0]]):
            missing.append(path)
    return missing


def test_the_schema_walk_finds_keys_at_every_level():
    keys = schema_keys(yaml.safe_load((CONFIG / "schema.yaml").read_text()))
    assert {"data.leakage.jaccard", "extract.compact.rank", "regenerate.server.url", "train.lr"} <= set(keys)
    assert {"name", "path", "format"} <= set(keys["data.sources"])
    assert {"prompts", "limit", "max_new_tokens"} <= set(keys["evaluate.benchmarks"])
    assert "train.rope_scaling.factor" in keys


def test_every_schema_key_is_in_the_readme():
    missing = undocumented()
    assert not missing, "config/README.md does not document: " + ", ".join(missing)
