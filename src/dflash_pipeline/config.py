"""The workflow's config as Snakemake builds it, for code that runs outside the workflow (benchmarks): the config
files merged in order (as ``--configfile`` merges them: a later file's keys win, nested sections merge), then
``overrides``, validated against config/schema.yaml and filled in from its defaults (the one source of them)."""

from __future__ import annotations

from pathlib import Path

import yaml

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"  # in a source checkout


def load_config(configfiles, overrides: dict | None = None, schema: str | Path = SCHEMA) -> dict:
    """The merged, validated config of ``configfiles`` (paths of YAML files) and ``overrides`` (a config dict)."""
    from snakemake.utils import update_config, validate

    config: dict = {}
    for part in [yaml.safe_load(Path(path).read_text()) for path in configfiles] + [overrides or {}]:
        update_config(config, part)
    validate(config, str(schema))
    return config
