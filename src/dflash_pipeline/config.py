"""The workflow's config: which keys change a job's result (``RUNTIME_KEYS``, ``result_settings``: what a rule's
``params:`` hold), and the config as Snakemake builds it, for code that runs outside the workflow (benchmarks): the
config files merged in order (as ``--configfile`` merges them: a later file's keys win, nested sections merge), then
``overrides``, validated against config/schema.yaml and filled in from its defaults (the one source of them)."""

from __future__ import annotations

from pathlib import Path

import yaml

SCHEMA = Path(__file__).resolve().parents[2] / "config" / "schema.yaml"  # in a source checkout

# Per section, the keys that change how a job runs (its threads, logging, progress, speed, the machine's GPUs), never
# what it computes ("a.b": key b of subsection a). A rule's params hold a section less these (``result_settings``),
# so that changing one reruns no job: Snakemake reruns a job whose params changed. The scripts read the whole
# section from ``snakemake.config``. train's are also outside the resume checkpoint's fingerprint.
RUNTIME_KEYS = {
    "extract": ("threads", "io_threads"),
    "train": ("gpus", "threads", "num_workers", "prefetch_factor", "checkpoint_every", "snapshots", "compile",
              "compile_layers", "flex_kernel_options", "preload", "compile_cache", "log_every"),
    "evaluate": ("threads", "processes"),
    "regenerate": ("enabled", "threads", "server.concurrency", "server.timeout_s", "server.retries"),
    "gpu": ("count",),
}


def result_settings(config: dict, section: str) -> dict:
    """``config[section]`` less its ``RUNTIME_KEYS``: what a job's result depends on (a rule's ``params:``)."""
    runtime = RUNTIME_KEYS.get(section, ())
    settings = {k: v for k, v in config[section].items() if k not in runtime}
    for key in runtime:
        outer, _, inner = key.partition(".")
        if inner and isinstance(settings.get(outer), dict):
            settings[outer] = {k: v for k, v in settings[outer].items() if k != inner}
    return settings


def check_batch_tokens(settings: dict) -> None:
    """regenerate's settings: a clear error where one prompt alone could outgrow ``batch_tokens`` (a batch
    holds at least one prompt)."""
    budget = settings.get("batch_tokens")
    if budget is None:
        return
    longest = settings["max_prompt_tokens"]
    if longest is None or longest + settings["max_new_tokens"] > budget:
        raise ValueError(f"regenerate.batch_tokens ({budget}) must hold one prompt of regenerate.max_prompt_tokens "
                         f"({longest}) plus regenerate.max_new_tokens ({settings['max_new_tokens']}); "
                         "set max_prompt_tokens, or raise batch_tokens")


def load_config(configfiles, overrides: dict | None = None, schema: str | Path = SCHEMA) -> dict:
    """The merged, validated config of ``configfiles`` (paths of YAML files) and ``overrides`` (a config dict)."""
    from snakemake.utils import update_config, validate

    config: dict = {}
    for part in [yaml.safe_load(Path(path).read_text()) for path in configfiles] + [overrides or {}]:
        update_config(config, part)
    validate(config, str(schema))
    return config
