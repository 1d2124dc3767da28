"""The learning-efficiency study (issue #20): training arms on one store, one after another in this process (the
store preloaded by each arm's trainer, train.preload), each scored by its exact teacher-forced τ on fixed MT-Bench
responses.

    python benchmarks/quality/recipe_study.py --configfile config/config.yaml config/examples/smollm2-quality.yaml \\
        --store results/store.zarr --target results/target --prompts question.jsonl \\
        --responses benchmarks/logs/quality_2026-11-29_gpu_eval/result.json --arms benchmarks/quality/study_arms.yaml \\
        --out study/ [--only NAME ...] [--isolated-steps 20]

- Arms (``--arms``, YAML): a list of ``{name, set: {train key: value}}`` applied over the merged configs' ``train``
  section (validated against config/schema.yaml); ``gpus: 1``, no snapshots.
- Each arm trains with the workflow's own ``Trainer`` (``torch._dynamo.reset()`` before it: every arm compiles
  anew, from the on-disk caches) and is then scored on the responses of ``--responses`` (an evaluation's
  result.json: its rows' ``output_ids`` are the target's greedy answers; the prompts come from ``--prompts``):
  ``teacher_forced_matches`` over one target forward per response, replayed as the greedy speculative loop
  (``replayed_tau``) — the τ that speculative decoding measures on those prompts (benchmarks/journal/2026-11-29_s04.md
  shows the two equal, 20 of 20) — for the first 20 and for all responses, with the drafter in fp32 as the evaluation
  loads it.
- ``--isolated-steps N``: after an arm (its learning rate is 0 by then), the trainer's own ``train_step`` on N prepared batches of the first epoch,
  back to back with one sync at the end (no data path, no logging): the isolated step, against the loop's mean
  step time in the same arm.
- ``--score-drafter DIR``: only score an exported drafter (e.g. the workflow's ``results/drafter``).
- Output, written after every arm (a run stopped midway keeps what ran): ``study.tsv`` (one row per arm: steps,
  trained tokens, seconds of the loop, step time, validation proxy and slot-1 accuracy, τ first 20 and all,
  mean and pooled), ``<arm>_log.csv``, ``study.log``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import yaml
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import replayed_tau, teacher_forced_matches  # noqa: E402

from dflash_pipeline.config import load_config
from dflash_pipeline.drafter import load_dflash, save_dflash
from dflash_pipeline.evaluate import load_prompts
from dflash_pipeline.speculative import TargetSession
from dflash_pipeline.store import HiddenStateStore
from dflash_pipeline.target import load_target, load_tokenizer
from dflash_pipeline.train import TrainConfig, Trainer, set_up_process, write_log

log = logging.getLogger("recipe_study")


class Responses:
    """The fixed responses with their fp32 target features, and the fp32 target's embedding and LM head (the
    drafter is scored as the evaluation loads it: fp32, with the fp32 target's)."""

    def __init__(self, target: str, prompts_file: str, responses_file: str, layer_ids: list[int], device):
        model = load_target(target, dtype="float32", device=device)
        prompts = load_prompts(prompts_file, load_tokenizer(target))
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        self.items = []
        for row in json.loads(Path(responses_file).read_text())["rows"]:
            prompt = prompts[row["index"]]["prompt_ids"]
            session = TargetSession(model, layer_ids)
            try:
                features = session.forward(prompt + row["output_ids"])[1][None]
            finally:
                session.close()
            self.items.append({"ids": torch.tensor(prompt + row["output_ids"], device=device), "features": features,
                               "prompt_len": len(prompt)})

    def score(self, drafter) -> dict:
        """τ (mean of per-response τ, and pooled) of the greedy loop replayed over the teacher-forced blocks, on the
        first 20 responses and on all."""
        drafter = drafter.float().eval()
        drafter.attach_target(self.embed, self.lm_head)
        taus, committed, steps = [], [], []
        for r in self.items:
            c, s = replayed_tau(teacher_forced_matches(drafter, r["features"], r["ids"], r["prompt_len"]))
            taus.append(c / s)
            committed.append(c)
            steps.append(s)
        out = {}
        for name, n in (("20", min(20, len(taus))), ("all", len(taus))):
            out[f"tau_mean_{name}"] = sum(taus[:n]) / n
            out[f"tau_pooled_{name}"] = sum(committed[:n]) / sum(steps[:n])
        return out


def isolated_step_s(trainer: Trainer, batches: int) -> float:
    """Mean seconds of ``train_step`` over ``batches`` prepared batches of epoch 0, back to back."""
    prepared = [packs for packs, _ in zip(trainer.epoch_steps(0, 0), range(batches))]
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    for packs in prepared:  # shapes not compiled yet
        trainer.train_step(packs)
    sync()
    began = time.perf_counter()
    for packs in prepared:
        trainer.train_step(packs)
    sync()
    return (time.perf_counter() - began) / len(prepared)


def pending_arms(path: Path, done: set[str], only: list[str] | None) -> list[dict]:
    spec = yaml.safe_load(path.read_text())
    arms = [{**arm, "set": {**(spec.get("base") or {}), **(arm.get("set") or {})}} for arm in spec["arms"]]
    return [arm for arm in arms if arm["name"] not in done and (not only or arm["name"] in only)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--responses", required=True)
    parser.add_argument("--arms", help="the arms YAML (required unless --score-drafter)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", help="arm names to run (default: all)")
    parser.add_argument("--isolated-steps", type=int, default=0)
    parser.add_argument("--follow", action="store_true",
                        help="when every arm of --arms ran, wait for more to be added to it (until <out>/STOP exists)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--score-drafter", help="only score this exported drafter (score.json in --out)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(out / "study.log")])
    config = load_config(args.configfile)
    store = HiddenStateStore(args.store)
    responses = Responses(args.target, args.prompts, args.responses, store.attrs["layer_ids"], args.device)
    log.info("%d responses, %d tokens scored", len(responses.items),
             sum(len(r["ids"]) - r["prompt_len"] for r in responses.items))
    if args.score_drafter:
        result = responses.score(load_dflash(args.score_drafter, dtype=torch.float32).to(args.device))
        (out / "score.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
        return
    table = out / "study.tsv"
    rows = pd.read_csv(table, sep="\t").to_dict("records") if table.exists() else []
    while True:
        todo = pending_arms(Path(args.arms), {r["arm"] for r in rows}, args.only)
        if not todo:
            if not args.follow or (out / "STOP").exists():
                break
            time.sleep(5)
            continue
        arm = todo[0]
        overrides = {"gpus": 1 if args.device == "cuda" else 0, "snapshots": None, **arm["set"]}
        cfg = TrainConfig(**load_config(args.configfile, {"train": overrides})["train"])
        torch._dynamo.reset()
        began = time.perf_counter()
        try:
            trainer = Trainer(cfg, args.store, args.target, str(out / arm["name"] / "state"),
                              placement=set_up_process(cfg))
            history = trainer.run()
        except Exception as error:  # noqa: BLE001 - one arm's failure is its row; the others still run
            log.exception("arm %s failed", arm["name"])
            rows.append({"arm": arm["name"], "set": json.dumps(arm["set"], sort_keys=True), "error": repr(error)[:200]})
            pd.DataFrame(rows).to_csv(table, sep="\t", index=False, float_format="%.4g")
            trainer = None
            if args.device == "cuda":
                torch.cuda.empty_cache()
            continue
        wall = time.perf_counter() - began
        write_log(history, str(out / f"{arm['name']}_log.csv"), str(out / f"{arm['name']}_curves.png"),
                  trainer.cfg.block_size)
        final = history[-1]
        row = {"arm": arm["name"], "set": json.dumps(arm.get("note") or arm["set"], sort_keys=True),
               "steps": trainer.step, "tokens": trainer.tokens, "wall_s": round(wall, 1),
               **{k: round(v, 4) if isinstance(v, float) else v for k, v in trainer.timing.items()},
               "val_loss": final["val_loss"], "val_proxy": final["val_proxy"], "val_acc_1": final["val_acc_1"]}
        if args.isolated_steps:  # at the schedule's end: lr 0, the weights stay
            row["isolated_step_s"] = isolated_step_s(trainer, args.isolated_steps)
        row.update(responses.score(trainer.drafter))
        log.info("arm %s: %s", arm["name"], row)
        rows.append(row)
        pd.DataFrame(rows).to_csv(table, sep="\t", index=False, float_format="%.4g")
        if arm.get("keep"):
            save_dflash(trainer.drafter, out / arm["name"] / "drafter", dtype=torch.bfloat16)
        del trainer
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
