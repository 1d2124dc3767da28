"""Command-line entry point: ``dflash-pipeline evaluate --drafter DIR --target PATH --out result.json``,
``dflash-pipeline verify STORE``, ``dflash-pipeline lease s3://bucket/prefix [--break]``,
``dflash-pipeline serve --target DIR --port N``,
``dflash-pipeline plan --configfile my.yaml [--conversations N --tokens-per-conversation M]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _evaluate(args) -> int:
    import torch

    from .evaluate import MT_BENCH, evaluate_drafter
    from .evaluate_report import write_report_files

    if args.require_lossless and args.no_baselines:
        raise SystemExit("--require-lossless needs the autoregressive output: leave --no-baselines out")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = evaluate_drafter(args.drafter, args.target, args.prompts, args.max_new_tokens, args.limit,
                              args.temperature, args.device, args.out, stride=args.stride, dtype=args.dtype,
                              seed=args.seed,
                              with_prompt_lookup=not args.no_prompt_lookup, tree_budgets=args.tree_budgets,
                              processes=args.processes, backbone_drafts=args.backbone_drafts,
                              baselines=not args.no_baselines)
    if args.plots:
        write_report_files(result, args.plots)
    summary = {k: result[k] for k in ("tau_mean", "tau_pooled", "tokens_per_s", "prompt_lookup_tau_pooled",
                                      "lossless", "num_prompts")}
    summary["trees"] = {budget: {k: tree[k] for k in ("tau_mean", "tau_pooled", "tokens_per_s", "verified_per_step",
                                                      "lossless")} for budget, tree in result.get("trees", {}).items()}
    print(json.dumps(summary, indent=1))
    log = logging.getLogger(__name__)
    if args.prompts is None:
        log.info("prompts: %s", MT_BENCH)
    if False in (result["lossless"], *(tree["lossless"] for tree in result.get("trees", {}).values())):
        log.warning("speculative output (of the chain or a tree budget) differs from autoregressive output (rows: "
                    "first_mismatch, and under trees); exact "
                    "equality is expected in float32 on CPU, low-precision GPU numerics may differ")
        return 3 if args.require_lossless else 0
    return 0


def _missing_store(path: str) -> str | None:
    """Why there is no store (or shard) at ``path`` to verify, or None when there is one."""
    from .bucket import Bucket, is_bucket_url, read_bytes
    from .store.remote import record_location

    if is_bucket_url(path):
        try:
            read_bytes(record_location(path), Bucket())
        except FileNotFoundError:
            return f"no completion record {record_location(path)}"
        return None
    return None if Path(path).exists() else "no such file or directory"


def _verify(args) -> int:
    import zarr

    from .store import verify
    from .store.remote import BucketSource, is_bucket_store

    missing = _missing_store(args.store)
    if missing:
        print(f"verify: no store at {args.store} ({missing})", file=sys.stderr)
        return 1
    problems = verify(args.store, jobs=args.jobs)
    for problem in problems:
        print(problem)
    try:
        root = BucketSource(args.store).root() if is_bucket_store(args.store) else zarr.open_group(args.store, mode="r")
        attrs = dict(root.attrs)
    except Exception:  # what cannot be read is among the problems
        attrs = {}
    what = f"{attrs.get('num_shards', 1)} shard(s), {attrs['num_tokens']} tokens" if "num_tokens" in attrs else \
        "a store whose attributes cannot be read"
    if problems:
        print(f"verify: {args.store}: {len(problems)} problem(s) in {what}; rebuild the named shard(s) (delete "
              "them and rerun the workflow)", file=sys.stderr)
        return 1
    print(f"verify: {args.store}: {what}: every chunk matches its checksum")
    return 0


def _lease(args) -> int:
    from .bucket import Bucket
    from .store.lease import break_lease, read_holder

    found = read_holder(args.url, Bucket())
    if found is None:
        print(f"lease: nobody holds {args.url}")
        return 0
    print(f"lease: {args.url} is held by {found[0].describe()}")
    if args.breaks:
        break_lease(args.url, Bucket(), found)
        print(f"lease: deleted {args.url.rstrip('/')}/lease.json: the next run takes the prefix")
    return 0


def _serve(args) -> int:
    import torch

    from .chat_server import serve

    if args.threads:
        torch.set_num_threads(args.threads)
    serve(args.target, host=args.host, port=args.port, dtype=args.dtype, device=args.device, name=args.name)
    return 0


def _plan(args) -> int:
    from transformers import AutoConfig

    from .plan import Rate, Workload, format_plan, load_config, make_plan, workload_from_file
    from .resources import resolve_path
    from .target import _gguf_args, load_tokenizer

    config = load_config(args.configfile, args.workflow_dir)
    target = args.target_config or str(resolve_path(config["target"]["path"]))
    location, extra = _gguf_args(target)
    if Path(location).is_file():  # a config.json
        location = str(Path(location).parent)
    target_config = AutoConfig.from_pretrained(location, trust_remote_code=config["target"]["trust_remote_code"],
                                               **extra)
    if args.conversations is not None:
        if args.tokens_per_conversation is None:
            raise SystemExit("plan: --conversations needs --tokens-per-conversation")
        workload = Workload(args.conversations, args.tokens_per_conversation, args.response_share,
                            "given on the command line")
    else:
        source = args.conversations_file or config["data"]["source"]
        tokenizer = load_tokenizer(args.tokenizer or str(resolve_path(config["target"]["path"])))
        workload = workload_from_file(source, config, tokenizer, sample=args.sample)
    rate = Rate(args.extract_rate, "given on the command line") if args.extract_rate else None
    text = format_plan(make_plan(config, workload, target_config, compact_ranks=args.compact_ranks,
                                 extract_rate=rate, gpus=args.gpus))
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-pipeline", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    ev = commands.add_parser("evaluate", help="speculative decoding with a DFlash drafter vs autoregressive and "
                                              "prompt-lookup decoding: tau, acceptance, tokens/s, lossless check")
    ev.add_argument("--drafter", required=True, help="DFlash checkpoint directory (config.json, model.safetensors)")
    ev.add_argument("--target", required=True, help="target: converted checkpoint directory, .gguf or hub id")
    ev.add_argument("--prompts", default=None,
                    help="a .jsonl of prompts/turns/messages/conversations, or pkg:<package>/<file> "
                         "(default: MT-Bench first turns)")
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    ev.add_argument("--stride", type=_positive_int, default=1,
                    help="every N-th record of the prompt file, before --limit (a recipe's benchmarks.*.stride: "
                         "Arena-Hard's 75 of 750 is --stride 10)")
    ev.add_argument("--temperature", type=float, default=0.0, help="0: greedy (lossless check)")
    ev.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ev.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ev.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    ev.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ev.add_argument("--processes", type=_positive_int, default=1,
                    help="decoding processes, each with its own target and drafter and the threads split among them "
                         "(the workflow's evaluate.processes)")
    ev.add_argument("--backbone-drafts", action="store_true",
                    help="a DFlash2 drafter's backbone drafts decoded too (result's backbone_drafts: the selector's "
                         "share of the gain; the workflow's evaluate.backbone_drafts)")
    ev.add_argument("--require-lossless", action="store_true",
                    help="exit with status 3 when a greedy speculative output differs from the autoregressive one")
    ev.add_argument("--no-prompt-lookup", action="store_true",
                    help="leave prompt-lookup decoding out (autoregressive and the lossless check stay)")
    ev.add_argument("--no-baselines", action="store_true",
                    help="leave autoregressive and prompt-lookup decoding out: the drafter's figures only, no "
                         "lossless check (for temperature > 0, where none is made: the baselines' decoding time saved)")
    ev.add_argument("--tree-budgets", type=int, nargs="+", default=[], metavar="B",
                    help="also decode with tree verification (DDTree) at each of these budgets (nodes per tree)")
    ev.add_argument("--plots", default=None, help="also write the PNG charts and the tau TSV into this directory")
    ev.add_argument("--out", required=True, help="result JSON path")
    ev.set_defaults(func=_evaluate)
    ve = commands.add_parser("verify", help="re-read a hidden-state store (or one extract shard) and check every "
                                            "chunk against its checksum; exit status 1 naming each damaged shard")
    ve.add_argument("store", help="a merged store (results/store.zarr) or one shard (results/extract/shard_*.zarr); in "
                                  "a bucket, its store.url (s3://bucket/prefix) or a completion record "
                                  "(s3://bucket/prefix/complete/store.json)")
    ve.add_argument("--jobs", type=int, default=1, help="shards read at once (threads)")
    ve.set_defaults(func=_verify)
    le = commands.add_parser("lease", help="who holds the lease of a store.url (one run writes a prefix at a time; "
                                           "docs/storage.md, \"One run per prefix\")")
    le.add_argument("url", help="the store.url, s3://bucket/prefix")
    le.add_argument("--break", dest="breaks", action="store_true",
                    help="delete the lease of a run you know is dead (refused while its process runs on this host)")
    le.set_defaults(func=_lease)
    se = commands.add_parser("serve", help="serve a target over an OpenAI-compatible chat API (greedy, one request "
                                           "at a time): the regenerate rule's server backend without vLLM")
    se.add_argument("--target", required=True, help="target: converted checkpoint directory, .gguf or hub id")
    se.add_argument("--host", default="127.0.0.1")
    se.add_argument("--port", type=int, default=8000, help="0: any free port (the log line names it)")
    se.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    se.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    se.add_argument("--name", default=None, help="the model id it serves (default: the target's directory name)")
    se.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    se.set_defaults(func=_serve)
    pl = commands.add_parser("plan", help="capacity plan before the GPUs start: tokens, store size per store setting, "
                                          "extraction and training GPU-hours, peak memory, where the store fits")
    pl.add_argument("--configfile", nargs="*", default=[],
                    help="config files merged over config/config.yaml in this order, as snakemake --configfile")
    pl.add_argument("--workflow-dir", help="the workflow directory (its config/config.yaml and schema; default: this "
                                           "package's checkout)")
    pl.add_argument("--conversations-file", help="the conversations (default: data.source); a seeded sample of them is "
                                                 "tokenised with the target's tokenizer")
    pl.add_argument("--sample", type=int, default=1000, help="conversations tokenised from the file")
    pl.add_argument("--tokenizer", help="where the tokenizer is (default: target.path)")
    pl.add_argument("--conversations", type=int, help="a count instead of a file (with --tokens-per-conversation)")
    pl.add_argument("--tokens-per-conversation", type=float)
    pl.add_argument("--response-share", type=float, default=0.6,
                    help="with --conversations: the share of tokens that can anchor a block (response tokens "
                         "followed by one); a file's sample measures it")
    pl.add_argument("--target-config", help="the target's config.json or its directory (default: target.path)")
    pl.add_argument("--compact-ranks", type=int, nargs="*", help="compact settings (default: 1/3 and 1/5 of K*D)")
    pl.add_argument("--extract-rate", type=float, help="measured extraction tokens/s of one GPU for this target")
    pl.add_argument("--gpus", type=int, default=8, help="GPUs extraction runs on at once")
    pl.add_argument("--out", help="also write the plan (Markdown) here")
    pl.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
