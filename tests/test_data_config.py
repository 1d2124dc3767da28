"""data.sources in the workflow: the varied recipe validates and plans its DAG, configs that cannot run stop before any
job, and the files benchmarks/device/device_data.py cuts for the GPU machine give its prepare the same conversations."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from snakemake.utils import update_config, validate

from dflash_pipeline.mix import prepare_mix
from dflash_pipeline.regenerate import turn_segments
from dflash_pipeline.sources import Source
from workflow_helpers import REPO, default_config, example_config, scheduled_jobs, snakemake, write_config

OVERLAYS = REPO / "benchmarks" / "overlays"
IFEVAL = "pkg:eval_framework/tasks/ifeval/data/input_data.jsonl"


def test_the_varied_recipe_validates_and_plans_every_stage(tmp_path):
    config = example_config("smollm2-varied.yaml")
    assert config["data"]["source"] is None and len(config["data"]["sources"]) >= 5
    assert config["regenerate"]["enabled"] and config["regenerate"]["max_turns"] > 1
    assert {"mt_bench", "arena_hard"} <= set(config["evaluate"]["benchmarks"])
    write_config(tmp_path, config)
    jobs = scheduled_jobs(tmp_path, "all")
    shards = config["tokenize"]["num_shards"]
    assert jobs["prepare"] == 1 and jobs["regenerate"] == jobs["extract"] == shards and jobs["evaluate"] == 2
    update_config(config, yaml.safe_load((REPO / "benchmarks" / "smoke" / "varied_smoke.yaml").read_text()))
    validate(config, str(REPO / "config" / "schema.yaml"))  # its few-minute smoke overlay
    assert config["data"]["max_conversations"] == 600 and config["evaluate"]["benchmarks"]["arena_hard"]["stride"] == 10
    stage_1b = example_config("smollm2-varied.yaml")  # MMLU's questions alone, answered for the recipe's stage 2
    update_config(stage_1b, yaml.safe_load((OVERLAYS / "regenerate_mmlu_only.yaml").read_text()))
    validate(stage_1b, str(REPO / "config" / "schema.yaml"))
    [mmlu] = stage_1b["data"]["sources"]
    assert stage_1b["data"]["source"] is None and Source.from_config(mmlu).prompt_template.startswith("{question}")
    stage_2 = example_config("smollm2-varied.yaml")  # stage 1's and 1b's answers as they are, then extract and train
    update_config(stage_2, yaml.safe_load((OVERLAYS / "stage2_from_stored_answers.yaml").read_text()))
    validate(stage_2, str(REPO / "config" / "schema.yaml"))
    assert [s["name"] for s in stage_2["data"]["sources"]] == ["varied", "mmlu"] and not stage_2["regenerate"]["enabled"]
    last = OVERLAYS / "stage2_from_stored_answers_5ep.yaml"
    update_config(stage_2, yaml.safe_load(last.read_text()))
    validate(stage_2, str(REPO / "config" / "schema.yaml"))  # session 25's run's last overlay
    assert stage_2["train"]["epochs"] == 5 and stage_2["evaluate"]["prompt_lookup"] is False


def test_the_equal_steps_arms_validate_and_differ_only_in_the_loop_policy():
    """Issue #50's keep and cut arms over stage 2 of the varied recipe: valid configs, 2,175 steps each, the rest of
    cut_1ep_streamed.yaml's settings, and nothing else between them but regenerate.loops."""
    from dflash_pipeline.plan import load_config  # over config/config.yaml, as snakemake --configfile

    recipe = [REPO / "config" / "examples" / "smollm2-varied.yaml", OVERLAYS / "stage2_from_stored_answers.yaml"]
    keep, cut, one_epoch = (load_config([*recipe, OVERLAYS / name], REPO)
                            for name in ("keep_equal_steps.yaml", "cut_equal_steps.yaml", "cut_1ep_streamed.yaml"))
    assert keep["regenerate"].pop("loops") == "keep" and cut["regenerate"].pop("loops") == "cut"
    assert keep == cut and cut["train"]["steps"] == 2175
    one_epoch["regenerate"].pop("loops")
    one_epoch["train"].update(steps=2175, epochs=cut["train"]["epochs"])
    assert cut == one_epoch


def test_the_equal_minutes_arms_differ_from_the_equal_steps_arms_in_their_steps_only():
    """Issue #53's equal-GPU-minutes arms: session 28's seed-1 arms (cut answers, 2,175 steps) with train.steps scaled
    by the step ratio of the current code measured alone on the card that trained them (1.644 on an H100, read from
    its log by benchmarks/quality/equal_minutes_overlays.py): DFlash2 down to DFlash's minutes, DFlash up to DFlash2's."""
    from dflash_pipeline.plan import load_config

    base = [REPO / "config" / "examples" / "smollm2-varied.yaml", OVERLAYS / "stage2_from_stored_answers.yaml",
            OVERLAYS / "cut_equal_steps.yaml", OVERLAYS / "seed_1.yaml"]
    dflash2 = load_config([*base, OVERLAYS / "dflash2.yaml"], REPO)
    dflash2_eqmin = load_config([*base, OVERLAYS / "dflash2.yaml", OVERLAYS / "equal_minutes_dflash2.yaml"], REPO)
    dflash = load_config(base, REPO)
    dflash_eqmin = load_config([*base, OVERLAYS / "equal_minutes_dflash.yaml"], REPO)
    speed = REPO / "benchmarks" / "logs" / "arms_2026-12-06_s31" / "step_speed_h100_after.txt"
    ratio = float(re.search(r"dflash2 / dflash: s/step ([0-9.]+)", speed.read_text()).group(1))
    assert dflash2_eqmin["train"].pop("steps") == round(2175 / ratio)
    assert dflash_eqmin["train"].pop("steps") == round(2175 * ratio)
    for arm in (dflash2, dflash):
        arm["train"].pop("steps")
    assert dflash2_eqmin == dflash2 and dflash_eqmin == dflash
    assert dflash2["train"]["architecture"] == "dflash2" and dflash["train"]["seed"] == 1


def test_the_equal_minutes_overlays_are_what_equal_minutes_overlays_py_writes_from_the_step_log(tmp_path):
    log = "benchmarks/logs/arms_2026-12-06_s31/step_speed_h100_after.txt"
    subprocess.run([sys.executable, "benchmarks/quality/equal_minutes_overlays.py", log, "--out", str(tmp_path)],
                   cwd=REPO, check=True, capture_output=True)
    for name in ("equal_minutes_dflash2.yaml", "equal_minutes_dflash.yaml"):
        assert (tmp_path / name).read_text() == (OVERLAYS / name).read_text()
    cut_short = tmp_path / "cut_short.txt"
    cut_short.write_text((REPO / log).read_text().split("dflash2 / dflash")[0])
    result = subprocess.run([sys.executable, "benchmarks/quality/equal_minutes_overlays.py", str(cut_short), "--out",
                             str(tmp_path / "none")], cwd=REPO, capture_output=True, text=True)
    assert result.returncode and "ran to its end" in result.stderr and not (tmp_path / "none").exists()


def test_a_config_with_both_or_neither_source_and_prompts_without_regeneration_stops_before_any_job(tmp_path):
    config = default_config()
    config["data"]["sources"] = [{"name": "ifeval", "path": IFEVAL, "format": "prompts"}]
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "-n", check=False)
    assert result.returncode and "set data.source (one conversations file) or data.sources" in result.stdout + result.stderr
    config["data"]["source"] = None
    config["regenerate"]["enabled"] = False
    write_config(tmp_path, config)
    result = snakemake(tmp_path, "-n", check=False)
    assert result.returncode and "data.sources ['ifeval'] hold prompts without answers" in result.stdout + result.stderr
    config["regenerate"]["enabled"] = True
    write_config(tmp_path, config)
    assert scheduled_jobs(tmp_path)["prepare"] == 1


def test_the_files_cut_for_the_gpu_machine_give_its_prepare_the_same_conversations(tmp_path):
    """device_data.py --config on a recipe of three sources: per source a parquet of what prepare selected, cut to the
    turns regeneration reads; prepare on those files (overlay.yaml) selects the same ids, tasks and prompts."""
    from sharegpt_helpers import first_sharegpt_records

    sample = tmp_path / "sharegpt.jsonl"  # real ShareGPT records, some of them opening with an answer
    records = list(first_sharegpt_records(1 << 20))
    for record in records[5::40]:  # no user turn: nothing for regeneration to answer
        record["conversations"] = [m for m in record["conversations"] if m["from"] == "gpt"]
    sample.write_text("".join(json.dumps(r) + "\n" for r in records))
    recipe = {
        "data": {"source": None, "max_conversations": 150, "sources": [
            {"name": "sharegpt", "path": str(sample)},
            {"name": "ifeval", "path": IFEVAL, "format": "prompts", "max_conversations": 40},
            {"name": "bfcl", "path": "pkg:bfcl/data", "format": "bfcl", "files": "BFCL_v3_*.json", "max_per_task": 3},
        ]},
        "regenerate": {"max_turns": 2},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    out = tmp_path / "carried"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "device" / "device_data.py"), "--config",
                    str(tmp_path / "recipe.yaml"), "--out", str(out)], check=True, capture_output=True, text=True)
    assert sorted(p.name for p in out.iterdir()) == ["bfcl.parquet", "ifeval.parquet", "mt_bench.jsonl",
                                                     "overlay.yaml", "prepare_counts.tsv", "scored.yaml",
                                                     "sharegpt.parquet"]
    overlay = yaml.safe_load((out / "overlay.yaml").read_text().replace("@DATA@", str(out)))
    assert overlay["evaluate"]["benchmarks"]["mt_bench"]["prompts"] == str(out / "mt_bench.jsonl")
    scored = {"mt_bench": default_config()["evaluate"]["benchmarks"]["mt_bench"]["prompts"]}
    local = prepare_mix([Source.from_config(s) for s in recipe["data"]["sources"]], tmp_path / "local.jsonl",
                        tmp_path / "local.tsv", max_conversations=150, scored=scored)
    machine = prepare_mix([Source.from_config(s) for s in overlay["data"]["sources"]], tmp_path / "machine.jsonl",
                          tmp_path / "machine.tsv", scored={"mt_bench": str(out / "mt_bench.jsonl")})
    mine = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (tmp_path / "machine.jsonl").read_text().splitlines()]
    unanswerable = sum(not turn_segments(r["messages"])[0] for r in mine)  # regenerate skips them: no_user_turn
    assert local["all"]["selected"] == 150 and machine["all"]["no_prompt"] == unanswerable >= 1
    mine = [r for r in mine if turn_segments(r["messages"])[0]]
    assert [(r["id"], r["source"], r["task"]) for r in mine] == [(r["id"], r["source"], r["task"]) for r in theirs]
    for a, b in zip(mine, theirs):  # the prompts of the turns regeneration reads, the same
        assert turn_segments(a["messages"])[0][:2] == turn_segments(b["messages"])[0]
        assert all(m["content"] is None for m in b["messages"] if m["role"] == "assistant")


def test_the_quality_recipe_trains_from_its_stored_answers(tmp_path):
    """Issue #50's retraining of the quality recipe from the answers regenerated for it in session 32: the overlay
    validates over the recipe, the workflow plans no regeneration, and prepare keeps all 16,098 answered
    conversations of the stored file, each ending in the target's answer."""
    import gzip
    import shutil

    from dflash_pipeline.mix import prepare_file
    from dflash_pipeline.plan import load_config

    answers = tmp_path / "answers.jsonl"
    with gzip.open(REPO / "benchmarks" / "logs" / "quality_2026-12-06_regenerated" / "regenerated.jsonl.gz") as src:
        with open(answers, "wb") as dst:
            shutil.copyfileobj(src, dst)
    config = load_config([REPO / "config" / "examples" / "smollm2-quality.yaml",
                          OVERLAYS / "quality_from_stored_answers.yaml"], REPO)
    assert not config["regenerate"]["enabled"] and config["regenerate"]["batch_tokens"] == 512 * (768 + 256)
    assert config["regenerate"]["loops"] == "keep"  # as the recipe's figures were measured
    config["data"]["source"] = str(answers)
    write_config(tmp_path, config)
    jobs = scheduled_jobs(tmp_path, "results/drafter")
    assert "regenerate" not in jobs and jobs["extract"] == config["tokenize"]["num_shards"] and jobs["train"] == 1
    counts = prepare_file(str(answers), tmp_path / "prepared.jsonl", tmp_path / "counts.tsv",
                          scored={"mt_bench": config["evaluate"]["benchmarks"]["mt_bench"]["prompts"]})
    with open(tmp_path / "prepared.jsonl", encoding="utf-8") as lines:  # not splitlines(): answers hold U+2028
        records = [json.loads(line) for line in lines]
    assert counts["selected"] == len(records) == 16098
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in records)
