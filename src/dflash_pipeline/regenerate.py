"""Target-aligned training data: every assistant turn rewritten by the target itself (issue #7).

A DFlash drafter learns the target's continuations; trained on another model's answers it accepts far less.
``regenerate_shard`` reads one shard's conversations (``shard_of(id) == shard``) and replaces each assistant
turn with the target's greedy response to the conversation so far, rendered with the target's chat template:

- Turns. Turn 1's prompt is the messages before the first assistant turn; turn t's prompt is the regenerated
  history plus the next non-assistant messages. At most ``max_turns`` turns; the conversation ends after the
  last regenerated turn. Assistant messages before the first user message have nothing to answer: they are
  dropped (counted); a second assistant message in a row ends the conversation.
- Batching. Turn by turn: all turn-1 prompts of the shard, sorted by length and cut into batches, then the
  turn-2 prompts of the conversations still going, and so on. A batch holds at most ``batch_size`` prompts and,
  with ``batch_tokens``, at most that many tokens counted as rows × (its longest prompt + ``max_new_tokens``): the
  KV cache a batch of short prompts needs is smaller, so more of them fit the same memory (``token_batches``).
- Backends. ``LocalBackend``: batched, left-padded greedy decoding, by ``greedy.greedy_batch`` (``decode: loop``)
  or one ``model.generate`` call (``decode: generate``, static KV cache on CUDA; also where the loop does not fit).
  ``ServerBackend``: an OpenAI-compatible ``/v1/chat/completions`` URL (vLLM, SGLang, ``dflash-pipeline serve``).
- Accounting. Every conversation ends succeeded, failed or skipped, with a reason; failed and skipped ones
  are not written (no training on a non-target answer) and are listed in the log; the counts must add up. The
  written answers that loop (``loops.answer_loop``, n = ``settings["loop_ngram"]``) are counted, with their tokens
  after the onset; what training does with them (``regenerate.loops``) is tokenize's to apply.
- Resuming. Each batch's replies are appended to ``<out>.partial.jsonl`` (first line: a fingerprint of the
  settings, the target and the shard's inputs); a rerun reuses every batch whose replies are all there, so
  a killed job redoes only the batches it had not finished, with the same batch composition as before.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from . import greedy
from .atomic import atomic_path
from .config import check_batch_tokens
from .loops import answer_loop
from .speculative import eos_token_ids
from .store import config_hash
from .tokenization import RenderError, render_prompt, shard_of

log = logging.getLogger(__name__)


@dataclass
class Reply:
    text: str | None = None  # the stripped response; None when it failed
    tokens: int = 0  # tokens the target generated (through its end-of-turn token)
    hit_max: bool = False  # stopped by the max_new_tokens cap
    failure: str | None = None  # reason, when text is None


def reply(text: str | None, tokens: int, hit_max: bool) -> Reply:
    text = (text or "").strip()
    return Reply(text, tokens, hit_max) if text else Reply(tokens=tokens, failure="empty_response")


def turn_segments(messages: list[dict]) -> tuple[list[list[dict]], int]:
    """Per assistant turn, the non-assistant messages since the previous one; and how many leading assistant
    messages (before any user message) were dropped."""
    segments, pending, leading = [], [], 0
    for message in messages:
        if message["role"] != "assistant":
            pending.append(message)
        elif any(m["role"] == "user" for m in pending):
            segments.append(pending)
            pending = []
        elif segments:
            break  # two assistant messages in a row
        else:
            leading += 1
    return segments, leading


def template_kwargs(thinking: bool | None) -> dict:
    return {} if thinking is None else {"enable_thinking": thinking}


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, max_cache_len: int | None = None,
                   method: str = "loop", graphs: bool | None = None,
                   drop_share: float = greedy.DROP_SHARE) -> list[tuple[list[int], bool]]:
    """Greedy continuations of token-id prompts, left-padded into one batch: per prompt the new tokens through the
    first end-of-sequence token, and whether the cap came first.

    ``method="loop"``: ``greedy.greedy_batch`` (its own decode loop over the model's forward: KV cache written in
    place, decode attention without repeated KV heads, each decode step a CUDA graph on CUDA (``graphs``), finished
    rows dropped once ``drop_share`` of the batch has finished), for every model ``greedy.unsupported`` passes; the
    others, and ``method="generate"``: one
    ``model.generate`` call, with a static KV cache on CUDA sized to this batch (its widest prompt +
    ``max_new_tokens``, or ``max_cache_len`` if larger; every decode step attends over the whole static cache), the
    dynamic cache elsewhere."""
    if method not in ("loop", "generate"):
        raise ValueError(f"generate_batch: method {method!r}, not loop or generate")
    eos = sorted(eos_token_ids(model))
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else (eos or [0])[0]
    if method == "loop" and greedy.unsupported(model) is None:
        return greedy.greedy_batch(model, prompts, max_new_tokens, eos=eos, pad=pad, graphs=graphs,
                                   drop_share=drop_share)
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids, mask = greedy.left_pad(prompts, pad)
    width = ids.shape[1]
    cache = {}
    if device.type == "cuda":  # eager: transformers would torch.compile the step for a static cache (minutes)
        cache = {"cache_implementation": "static", "max_cache_len": max(max_cache_len or 0, width + max_new_tokens),
                 "disable_compile": True}
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or None,
                              pad_token_id=pad, repetition_penalty=1.0, **cache)
    out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
    return [greedy.answer(row, set(eos)) for row in out[:, width:].tolist()]


class LocalBackend:
    """The target in this process: ``generate_batch`` on each batch of prompts, by ``decode`` (``loop``, where
    ``greedy.unsupported`` lets it, else ``generate``)."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int, decode: str = "loop"):
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        if decode == "loop" and (reason := greedy.unsupported(model)):
            log.info("regenerate.decode loop does not fit this target (%s): generate instead", reason)
            decode = "generate"
        self.decode = decode
        self.identity = {"backend": "local", "target": target_identity(model.name_or_path), "dtype": str(model.dtype),
                         "device": next(model.parameters()).device.type, "decode": decode}

    def generate(self, items: list[dict]) -> list[Reply]:
        outputs = generate_batch(self.model, [item["ids"] for item in items], self.max_new_tokens, method=self.decode)
        return [reply(self.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens), hit)
                for tokens, hit in outputs]


class ServerBackend:
    """An OpenAI-compatible chat-completions server: ``concurrency`` requests at once, each with a timeout and
    ``retries`` retries (exponential backoff) on connection errors, timeouts, HTTP 429 and 5xx."""

    def __init__(self, url: str, model: str | None, *, max_new_tokens: int, thinking: bool | None = None,
                 concurrency: int = 8, timeout_s: float = 300, retries: int = 3, backoff_s: float = 1.0):
        self.url = url.rstrip("/")
        self.max_new_tokens, self.thinking = max_new_tokens, thinking
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.model = model or self._served_model()
        self.identity = {"backend": "server", "url": self.url, "model": self.model}
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency)

    def _call(self, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get("OPENAI_API_KEY"):
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return json.loads(response.read())

    def _served_model(self) -> str:
        models = self._call("/v1/models")["data"]
        log.info("%s serves %s; using the first", self.url, [m["id"] for m in models])
        return models[0]["id"]

    def _request(self, item: dict) -> Reply:
        body = {"model": self.model, "messages": item["messages"], "max_tokens": self.max_new_tokens,
                "temperature": 0.0}
        if self.thinking is not None:
            body["chat_template_kwargs"] = template_kwargs(self.thinking)
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                payload = self._call("/v1/chat/completions", body)
                choice = payload["choices"][0]
                return reply(choice["message"]["content"], int((payload.get("usage") or {}).get("completion_tokens")
                                                               or 0), choice.get("finish_reason") == "length")
            except urllib.error.HTTPError as error:
                reason = f"http_{error.code}"
                if error.code < 500 and error.code != 429:
                    break  # refused: the same request gets the same answer
            except (OSError, http.client.HTTPException) as error:  # URLError, timeouts, resets
                timeout = isinstance(error, TimeoutError) or isinstance(getattr(error, "reason", None), TimeoutError)
                reason = "timeout" if timeout else "connection_error"
            except (ValueError, KeyError, IndexError, TypeError):  # not JSON, or not a chat completion
                return Reply(failure="bad_response")
        return Reply(failure=reason)

    def generate(self, items: list[dict]) -> list[Reply]:
        return list(self.pool.map(self._request, items))


def target_identity(path: str) -> dict:
    """What tells one local target from another without hashing its weights: a digest of its config and
    conversion record and of the names, sizes and times of its weight files."""
    directory = Path(path)
    if not directory.is_dir():
        return {"path": str(path)}
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] if p.suffix == ".safetensors" else p.read_text()
             for p in sorted(directory.iterdir()) if p.suffix == ".safetensors" or p.name in ("config.json",
                                                                                             "conversion.json")}
    return {"path": str(path), "files": config_hash(files)}


def read_partial(path: Path, fingerprint: str) -> dict[tuple[str, int], dict]:
    """Replies recorded by an earlier run of the same job: ``{(id, turn): record}``. A missing file or another
    fingerprint starts over; a line cut off by a kill is cut off the file too."""
    lines = path.read_bytes().split(b"\n") if path.exists() else [b""]
    if lines[0] != json.dumps({"fingerprint": fingerprint}).encode():
        if path.exists():
            log.info("%s: recorded by other settings, target or inputs; starting over", path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
        return {}
    done, good = {}, len(lines[0]) + 1
    for line in lines[1:-1]:  # the last element follows the last newline: empty or cut off
        try:
            record = json.loads(line)
        except ValueError:
            break
        done[record["id"], record["turn"]], good = record, good + len(line) + 1
    os.truncate(path, good)
    log.info("%s: resuming with %d recorded replies", path, len(done))
    return done


@dataclass
class Conversation:
    id: str
    segments: list[list[dict]]  # per turn to regenerate: the messages before its answer (turn_segments)
    history: list[dict] = field(default_factory=list)  # the conversation so far, answers regenerated
    tokens: int = 0
    hit_max: int = 0
    outcome: tuple[str, str | None] | None = None  # (succeeded | failed | skipped, reason)


def turn_prompts(conversations: list[Conversation], turn: int, tokenizer, settings: dict,
                  counts: collections.Counter) -> list[dict]:
    """The rendered turn-``turn`` prompts of the conversations still going, sorted by length; too-long ones
    and those the template cannot render end their conversation (skipped at turn 0, else with the turns before it)."""
    items = []
    for index, conv in enumerate(conversations):
        if conv.outcome or turn >= len(conv.segments):
            continue
        messages = conv.history + conv.segments[turn]
        try:
            ids = render_prompt(tokenizer, messages, **template_kwargs(settings["thinking"]))
            too_long = settings["max_prompt_tokens"] is not None and len(ids) > settings["max_prompt_tokens"]
            reason = "prompt_too_long" if too_long else None
        except RenderError as error:
            reason = error.reason
        if reason:
            conv.outcome = ("skipped", reason) if turn == 0 else ("succeeded", None)
            counts[f"stopped_early:{reason}"] += turn > 0
            continue
        items.append({"index": index, "messages": messages, "ids": ids, "prompt": config_hash(ids)})
    return sorted(items, key=lambda item: (len(item["ids"]), item["index"]))


def token_batches(items: list[dict], size: int, budget: int | None, max_new_tokens: int) -> list[list[dict]]:
    """``items`` (sorted by prompt length) cut in order into batches of at most ``size`` rows and, with ``budget``,
    at most ``budget`` tokens as rows × (the batch's longest prompt + ``max_new_tokens``)."""
    batches: list[list[dict]] = []
    for item in items:
        batch = batches[-1] if batches else None
        if batch is None or len(batch) == size or (
                budget is not None and (len(batch) + 1) * (len(item["ids"]) + max_new_tokens) > budget):
            batches.append([item])
        else:
            batch.append(item)
    return batches


def regenerate_shard(conversations_jsonl, backend, tokenizer, *, shard: int, num_shards: int, settings: dict,
                     out_jsonl, out_counts) -> collections.Counter:
    """Regenerate the assistant turns of one shard (module docstring); write the succeeded conversations in
    input order to ``out_jsonl`` and the counts to ``out_counts`` (both atomically)."""
    with open(conversations_jsonl, encoding="utf-8") as handle:
        records = [r for r in map(json.loads, handle) if shard_of(r["id"], num_shards) == shard]
    counts = collections.Counter(input=len(records), succeeded=0, failed=0, skipped=0)
    conversations = []
    for record in records:
        segments, leading = turn_segments(record["messages"])
        counts["leading_assistant_dropped"] += leading
        conversations.append(Conversation(record["id"], segments[: settings["max_turns"]],
                                          outcome=None if segments else ("skipped", "no_user_turn")))
    check_batch_tokens(settings)
    keys = ("max_turns", "max_new_tokens", "max_prompt_tokens", "batch_size", "thinking")
    batching, budget = {k: settings[k] for k in keys}, settings.get("batch_tokens")
    if budget is not None:  # without it, a fingerprint from before batch_tokens still matches
        batching["batch_tokens"] = budget
    fingerprint = config_hash({"settings": batching, "backend": backend.identity, "inputs": records})
    partial = Path(str(out_jsonl).removesuffix(".jsonl") + ".partial.jsonl")
    done = read_partial(partial, fingerprint)
    started, generated, size = time.perf_counter(), 0, settings["batch_size"]
    with open(partial, "a", encoding="utf-8") as sink:
        for turn in range(settings["max_turns"]):
            items = turn_prompts(conversations, turn, tokenizer, settings, counts)
            batches = token_batches(items, size, budget, settings["max_new_tokens"])
            progress = tqdm(total=len(items), desc=f"regenerate shard {shard} turn {turn + 1}", unit="prompt",
                            mininterval=10)
            for number, batch in enumerate(batches, 1):
                recorded = [done.get((conversations[item["index"]].id, turn)) for item in batch]
                if all(r and r["prompt"] == item["prompt"] for r, item in zip(recorded, batch)):
                    replies = [Reply(r["text"], r["tokens"], r["hit_max"], r["failure"]) for r in recorded]
                else:
                    replies = backend.generate(batch)
                    sink.writelines(json.dumps({"id": conversations[item["index"]].id, "turn": turn,
                                                "prompt": item["prompt"], **asdict(r)}, ensure_ascii=False) + "\n"
                                    for item, r in zip(batch, replies))
                    sink.flush()
                    os.fsync(sink.fileno())
                    generated += sum(r.tokens for r in replies)
                    log.info("turn %d batch %d/%d: %d prompts of %d-%d tokens; %d new tokens so far, %.1f tok/s",
                             turn + 1, number, len(batches), len(batch), len(batch[0]["ids"]), len(batch[-1]["ids"]),
                             generated, generated / (time.perf_counter() - started))
                progress.set_postfix_str(f"{generated / (time.perf_counter() - started):.0f} new tok/s", refresh=False)
                progress.update(len(batch))
                for item, r in zip(batch, replies):
                    conv = conversations[item["index"]]
                    if r.failure:  # at a later turn too: the conversation keeps nothing
                        conv.outcome = ("failed", r.failure)
                        continue
                    conv.history = item["messages"] + [{"role": "assistant", "content": r.text}]
                    conv.tokens, conv.hit_max = conv.tokens + r.tokens, conv.hit_max + r.hit_max
                    if turn + 1 == len(conv.segments):
                        conv.outcome = ("succeeded", None)
            progress.close()
    _write(records, conversations, counts, out_jsonl, out_counts, tokenizer, settings.get("loop_ngram", 16))
    partial.unlink()
    seconds = time.perf_counter() - started
    log.info("shard %d: %s; %d tokens generated in this run, %.1f s (%.1f tok/s)", shard, dict(counts), generated,
             seconds, generated / max(seconds, 1e-9))
    return counts


def _write(records: list[dict], conversations: list[Conversation], counts: collections.Counter, out_jsonl,
           out_counts, tokenizer, loop_ngram: int) -> None:
    """Count every outcome (failed and skipped ones named in the log; per ``data.sources`` source too, as
    ``<source>:<item>``) and the written answers that loop, check the sum, write both outputs."""
    by_source: collections.Counter = collections.Counter()
    for record, conv in zip(records, conversations):
        outcome, reason = conv.outcome
        counts[outcome] += 1
        source = record.get("source")
        if source:
            by_source[f"{source}:{outcome}"] += 1
        if reason:
            counts[f"{outcome}:{reason}"] += 1
            log.warning("%s %s: %s", outcome, conv.id, reason)
        else:
            turns = sum(m["role"] == "assistant" for m in conv.history)
            counts["turns"] += turns
            counts["hit_max_new_tokens"] += conv.hit_max
            counts["generated_tokens"] += conv.tokens
            loops = _loop_counts(conv.history, tokenizer, loop_ngram)
            counts.update(loops)
            if source:
                by_source[f"{source}:turns"] += turns
                by_source[f"{source}:generated_tokens"] += conv.tokens
                by_source.update({f"{source}:{key}": value for key, value in loops.items()})
    assert counts["succeeded"] + counts["failed"] + counts["skipped"] == counts["input"], counts
    with atomic_path(out_jsonl) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for record, conv in zip(records, conversations):
            if conv.outcome[0] == "succeeded":
                handle.write(json.dumps({"id": record["id"], "messages": conv.history}, ensure_ascii=False) + "\n")
    order = ["input", "succeeded", "failed", "skipped", *sorted(k for k in counts if k.startswith(("failed:",
             "skipped:"))), "turns", "hit_max_new_tokens", "generated_tokens", *LOOP_COUNTS,
             "leading_assistant_dropped",
             *sorted({"stopped_early:prompt_too_long", *(k for k in counts if k.startswith("stopped_early:"))})]
    sources = sorted({key.split(":")[0] for key in by_source})
    order += [f"{source}:{item}" for source in sources for item in ("succeeded", "failed", "skipped", "turns",
                                                                     "generated_tokens", *LOOP_COUNTS)]
    counts.update(by_source)
    with atomic_path(out_counts) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        handle.write("item\tcount\n" + "".join(f"{key}\t{counts[key]}\n" for key in order))


# answers written that loop, the written answers' tokens (the answer text encoded again) and those at or after the onset
LOOP_COUNTS = ("looping_answers", "answer_tokens", "loop_tokens")


def _loop_counts(messages: list[dict], tokenizer, n: int) -> collections.Counter:
    counts = collections.Counter(dict.fromkeys(LOOP_COUNTS, 0))
    for message in messages:
        if message["role"] == "assistant":
            onset, _, tokens = answer_loop(tokenizer, message["content"], n)
            counts.update(looping_answers=int(onset is not None), answer_tokens=tokens,
                          loop_tokens=0 if onset is None else tokens - onset)
    return counts


def run_regenerate(conversations_jsonl, out_jsonl, out_counts, *, target: str, settings: dict, shard: int,
                   num_shards: int, dtype: str = "float32", revision: str | None = None,
                   trust_remote_code: bool = False, device: str | None = None) -> collections.Counter:
    """The workflow job: the tokenizer (prompt lengths), the backend of ``settings``, then ``regenerate_shard``."""
    from .target import load_target, load_tokenizer

    tokenizer = load_tokenizer(target, revision=revision, trust_remote_code=trust_remote_code)
    server = settings.get("server") or {}
    if settings["backend"] == "server":
        if not server.get("url"):
            raise ValueError("regenerate.backend is server but regenerate.server.url is not set")
        backend = ServerBackend(server["url"], server.get("model"), max_new_tokens=settings["max_new_tokens"],
                                thinking=settings["thinking"], concurrency=server.get("concurrency", 8),
                                timeout_s=server.get("timeout_s", 300), retries=server.get("retries", 3))
    else:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model = load_target(target, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code)
        backend = LocalBackend(model, tokenizer, max_new_tokens=settings["max_new_tokens"],
                               decode=settings.get("decode", "loop"))
    log.info("shard %d on %s (leased GPUs: %s): %s, settings %s", shard, device or "a server",
             os.environ.get("CUDA_VISIBLE_DEVICES"), backend.identity, settings)
    return regenerate_shard(conversations_jsonl, backend, tokenizer, shard=shard, num_shards=num_shards,
                            settings=settings, out_jsonl=out_jsonl, out_counts=out_counts)
