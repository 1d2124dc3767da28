"""benchmarks/quality/compare_arms.py loaded as a module, and its first table read back: shared by
tests/test_compare_arms.py and tests/test_arms_turns.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_arms", ROOT / "benchmarks" / "quality" / "compare_arms.py")
compare_arms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare_arms)


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """Arm -> column -> cell of the first table compare_arms prints."""
    lines = text.split("\n\n")[0].splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row)) for row in rows}
