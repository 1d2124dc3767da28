"""The evaluation's report files: the plots and table of one result, and the tau-vs-training-tokens curve."""

from __future__ import annotations

import json
from pathlib import Path

from .atomic import atomic_path


def _fmt(value) -> str:
    return "" if value is None else f"{value:.3f}"


# the loop-aware tau first (issue #50: the tau a target that does not loop would see), tau on all steps beside it
TAU_COLUMNS = ("tau_loop_aware_mean", "tau_loop_aware_pooled", "tau_mean", "tau_pooled", "loop_output_share",
               "loop_token_share")


def write_report_files(result: dict | str | Path, out_dir) -> dict[str, Path]:
    """acceptance_per_position.png, accepted_length_histogram.png and tau_table.tsv from a result, and
    tau_by_category.tsv where its prompts have categories (else a header only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not isinstance(result, dict):
        result = json.loads(Path(result).read_text())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    acceptance = [a or 0.0 for a in result["acceptance_per_position"]]
    charts = (("acceptance_per_position", range(1, len(acceptance) + 1), acceptance, "draft position k",
               "fraction of verify steps accepting k",
               f"Per-position acceptance (tau {result['tau_pooled'] or 0:.2f})"),
              ("accepted_length_histogram", range(len(result["accepted_length_histogram"])),
               result["accepted_length_histogram"], "accepted drafts a", "verify steps", "Accepted lengths"))
    loop_aware = result.get("acceptance_per_position_loop_aware")  # results written before it lack it
    for name, xs, ys, xlabel, ylabel, title in charts:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if name == "acceptance_per_position" and loop_aware:
            xs = list(xs)
            ax.bar([x - 0.2 for x in xs], [a or 0.0 for a in loop_aware], width=0.4, color="tab:blue",
                   label=f"steps before the loop (tau {result.get('tau_loop_aware_pooled') or 0:.2f})")
            ax.bar([x + 0.2 for x in xs], list(ys), width=0.4, color="tab:gray", label="all steps")
            ax.legend(fontsize="small")
            title = "Per-position acceptance"
        else:
            ax.bar(list(xs), list(ys), color="tab:blue")
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xticks=list(xs))
        ax.set_ylim(0, 1 if name == "acceptance_per_position" else max(1, max(ys, default=0)) * 1.05)
        fig.tight_layout()
        paths[name] = out_dir / f"{name}.png"
        fig.savefig(paths[name], dpi=100)
        plt.close(fig)
    speed = result["tokens_per_s"]
    ar = speed.get("autoregressive")
    lines = ["method\t" + "\t".join(TAU_COLUMNS) + "\ttokens_per_s\tspeedup_vs_ar"]
    baseline = result.get("baseline_drafter")
    if baseline:
        speed = {**speed, "baseline_drafter": baseline["tokens_per_s"]}
    autoregressive = dict.fromkeys(TAU_COLUMNS[:4], 1.0)
    for method, figures, key in (("dflash", result, "speculative"),
                                 *((("dflash_untrained", baseline, "baseline_drafter"),) if baseline else ()),
                                 ("prompt_lookup", _prefixed(result, "prompt_lookup_"), "prompt_lookup"),
                                 ("autoregressive", autoregressive, "autoregressive")):
        rate = speed.get(key)
        lines.append("\t".join([method, *(_fmt(figures.get(c)) for c in TAU_COLUMNS), _fmt(rate),
                                _fmt(rate / ar if rate and ar else None)]))
    backbone = result.get("backbone_drafts")
    if backbone:
        rate = backbone["tokens_per_s"]
        lines.append("\t".join(["dflash2_backbone", *(_fmt(backbone.get(c)) for c in TAU_COLUMNS), _fmt(rate),
                                _fmt(rate / ar if rate and ar else None)]))
    for budget, tree in result.get("trees", {}).items():
        rate = tree["tokens_per_s"]["speculative"]
        lines.append("\t".join([f"ddtree_{budget}", *(_fmt(tree.get(c)) for c in TAU_COLUMNS), _fmt(rate),
                                _fmt(rate / ar if rate and ar else None)]))
    paths["tau_table"] = out_dir / "tau_table.tsv"
    paths["tau_table"].write_text("\n".join(lines) + "\n")
    columns = [*TAU_COLUMNS, *(f"prompt_lookup_{c}" for c in TAU_COLUMNS)]
    lines = ["category\tprompts\t" + "\t".join(columns)]
    for name, figures in (result.get("by_category") or {}).items():
        lines.append("\t".join([name, str(figures["prompts"]), *(_fmt(figures.get(c)) for c in columns)]))
    paths["tau_by_category"] = out_dir / "tau_by_category.tsv"
    paths["tau_by_category"].write_text("\n".join(lines) + "\n")
    if result.get("trees"):
        paths["tau_vs_tree_budget"] = out_dir / "tau_vs_tree_budget.png"
        plot_tree_budgets(result, paths["tau_vs_tree_budget"])
    return paths


def _prefixed(result: dict, prefix: str) -> dict:
    """The figures of a method whose keys carry ``prefix`` in the result, without it."""
    return {key[len(prefix):]: value for key, value in result.items() if key.startswith(prefix)}


def plot_tree_budgets(result: dict, path) -> None:
    """Tau (mean and pooled) and tokens/s of tree verification against the budget, the chain's and
    autoregressive decoding's (same drafter, same prompts, same run) as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trees = sorted(result["trees"].values(), key=lambda tree: tree["budget"])
    budgets = [tree["budget"] for tree in trees]
    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style, label in (("tau_loop_aware_mean", "^-", "loop-aware mean"), ("tau_mean", "o-", "mean of responses"),
                              ("tau_pooled", "s--", "pooled")):
        line, = ax_tau.plot(budgets, [tree.get(key) for tree in trees], style, label=f"tree, {label}")
        if result.get(key) is not None:
            ax_tau.axhline(result[key], color=line.get_color(), ls=":", label=f"chain, {label}")
    ax_tau.set(xlabel="tree budget (nodes)", ylabel="tau (tokens per verify step)", title="Acceptance length")
    speeds = result["tokens_per_s"]
    ax_speed.plot(budgets, [tree["tokens_per_s"]["speculative"] for tree in trees], "o-", label="tree")
    for key, color, label in (("speculative", "C1", "chain"), ("autoregressive", "C2", "autoregressive")):
        if speeds.get(key):
            ax_speed.axhline(speeds[key], color=color, ls=":", label=label)
    ax_speed.set(xlabel="tree budget (nodes)", ylabel="tokens/s", ylim=(0, None),
                 title=f"Speed on {result.get('device') or 'the device'} (no CUDA graphs)")
    for ax in (ax_tau, ax_speed):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def write_tau_curve(results: dict[str, dict], out_tsv, out_png) -> None:
    """tau (mean and pooled; loop-aware, where the result has it, first in the plot) of each evaluated drafter
    (name -> combined result, e.g. "25pct", "final") against the tokens it was trained on
    (``training.trained_tokens``), as a TSV and a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(({"drafter": name, "steps": r.get("training", {}).get("steps"),
                    "trained_tokens": r.get("training", {}).get("trained_tokens"),
                    "tau_mean": r["tau_mean"], "tau_pooled": r["tau_pooled"],
                    "tau_loop_aware_mean": r.get("tau_loop_aware_mean"),
                    "tau_loop_aware_pooled": r.get("tau_loop_aware_pooled")} for name, r in results.items()),
                  key=lambda row: row["trained_tokens"] or 0)
    with atomic_path(out_tsv) as tmp:
        lines = ["drafter\tsteps\ttrained_tokens\ttau_mean\ttau_pooled\ttau_loop_aware_mean\ttau_loop_aware_pooled"]
        lines += [f"{r['drafter']}\t{r['steps']}\t{r['trained_tokens']}\t{r['tau_mean']:.4f}\t{r['tau_pooled']:.4f}\t"
                  + "\t".join("" if r[k] is None else f"{r[k]:.4f}" for k in ("tau_loop_aware_mean",
                                                                           "tau_loop_aware_pooled"))
                  for r in rows]
        Path(tmp).write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    tokens = [(r["trained_tokens"] or 0) / 1e6 for r in rows]
    if all(r["tau_loop_aware_mean"] is not None for r in rows):
        ax.plot(tokens, [r["tau_loop_aware_mean"] for r in rows], "D-", label="loop-aware tau (mean of responses)")
    ax.plot(tokens, [r["tau_mean"] for r in rows], "o-", label="tau (mean of responses)")
    ax.plot(tokens, [r["tau_pooled"] for r in rows], "s--", label="tau (pooled)")
    ax.set(xlabel="training tokens (millions)", ylabel="tau", title="Acceptance length vs training tokens")
    ax.legend()
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
