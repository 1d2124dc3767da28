"""The regenerate stage (src/dflash_pipeline/regenerate.py) and ``dflash-pipeline serve`` (chat_server.py), on the
real SmolLM2 target in float32 on CPU: assistant turns rewritten by the target equal plain unbatched greedy
``generate``; a real local server gives the in-process text; failures are counted by reason, never dropped
silently; a rerun after a kill redoes only the batches it had not finished, with the same result.
The workflow path (the rule, tokenize reading its output, a kill and resume): tests/test_workflow.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dflash_pipeline import greedy
from dflash_pipeline.config import check_batch_tokens
from dflash_pipeline.regenerate import (LocalBackend, Reply, ServerBackend, generate_batch,
                                        regenerate_shard, render_prompt, token_batches, turn_segments)

MAX_NEW_TOKENS = 20
SETTINGS = {"max_turns": 2, "max_new_tokens": MAX_NEW_TOKENS, "max_prompt_tokens": 400, "batch_size": 4,
            "thinking": None}
HAND_WRITTEN = [
    {"id": "multi", "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a primary colour."}, {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "And another one?"}, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "One more?"}, {"role": "assistant", "content": "Yellow."}]},
    {"id": "leading", "messages": [
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}]},
]


def sharegpt_conversations(n: int, max_chars: int = 300) -> list[dict]:
    """The first ``n`` real ShareGPT conversations whose first user message is short (from the file's first MiB)."""
    from dflash_pipeline.prepare import normalise_record
    from sharegpt_helpers import first_sharegpt_records

    found = []
    for raw in first_sharegpt_records(1 << 20):
        record, problem = normalise_record(raw, "x")
        first = record["messages"][0] if record else {"role": None}
        if not problem and first["role"] == "user" and len(first["content"]) < max_chars:
            found.append(record)
        if len(found) == n:
            return found
    raise AssertionError(f"fewer than {n} such conversations in the first MiB")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def read_counts(path: Path) -> dict[str, int]:
    lines = Path(path).read_text().splitlines()
    assert lines[0] == "item\tcount"
    return {key: int(value) for key, value in (line.split("\t") for line in lines[1:])}


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "conversations.jsonl",
                       sharegpt_conversations(4) + HAND_WRITTEN)


@pytest.fixture(scope="module")
def model(smollm2_dir):
    from dflash_pipeline.target import load_target

    return load_target(str(smollm2_dir))


class Killed(Exception):
    pass


class Recording:
    """A backend wrapper that records the prompts it generates for and can fail ("a kill") after n batches."""

    def __init__(self, backend, fail_after: int | None = None):
        self.backend, self.identity, self.fail_after, self.batches = backend, backend.identity, fail_after, []

    def generate(self, items):
        if self.fail_after is not None and len(self.batches) >= self.fail_after:
            raise Killed
        self.batches.append([item["messages"] for item in items])
        return self.backend.generate(items)


def run(conversations, backend, tokenizer, out_dir: Path, settings=SETTINGS):
    counts = regenerate_shard(conversations, backend, tokenizer, shard=0, num_shards=1, settings=settings,
                              out_jsonl=out_dir / "shard_00000.jsonl", out_counts=out_dir / "shard_00000.counts.tsv")
    return counts, read_jsonl(out_dir / "shard_00000.jsonl")


@pytest.fixture(scope="module")
def local_run(conversations, model, smollm2_tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    backend = Recording(LocalBackend(model, smollm2_tokenizer, max_new_tokens=MAX_NEW_TOKENS))
    started = time.perf_counter()
    counts, records = run(conversations, backend, smollm2_tokenizer, out)
    print(f"local backend: {time.perf_counter() - started:.1f} s, {dict(counts)}")
    return {"counts": counts, "records": records, "out": out, "batches": backend.batches}


def test_regenerated_turns_equal_unbatched_greedy_generate(local_run, conversations, model, smollm2_tokenizer):
    originals = {r["id"]: r["messages"] for r in read_jsonl(conversations)}
    records = local_run["records"]
    assert [r["id"] for r in records] == list(originals)  # all succeeded, in input order
    assert [len(batch) for batch in local_run["batches"]] == [4, 2, 3]  # turn 1: 6 prompts; turn 2: 3 going on
    for record in records:
        messages, original = record["messages"], originals[record["id"]]
        if record["id"] == "leading":
            original = original[1:]  # an assistant message before any user message: nothing to answer
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert len(turns) == min(2, sum(m["role"] == "assistant" for m in original))
        assert messages[-1]["role"] == "assistant"  # cut after the last regenerated turn
        # the prompts are kept verbatim; only the assistant turns are the target's
        assert [m for m in messages if m["role"] != "assistant"] == [m for m in original[: len(messages)]
                                                                     if m["role"] != "assistant"]
        for turn in turns:  # reference: the rendered prompt alone, unpadded, plain greedy generate()
            text = smollm2_tokenizer.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_NEW_TOKENS)
            expected = smollm2_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
            assert messages[turn]["content"] == expected, (record["id"], turn)
            assert messages[turn]["content"] != original[turn]["content"]
    counts = read_counts(local_run["out"] / "shard_00000.counts.tsv")
    assert counts["input"] == counts["succeeded"] == 6 and counts["failed"] == counts["skipped"] == 0
    assert counts["turns"] == 9 and counts["leading_assistant_dropped"] == 1
    assert 0 < counts["hit_max_new_tokens"] <= 9 and 0 < counts["generated_tokens"] <= 9 * MAX_NEW_TOKENS
    assert not (local_run["out"] / "shard_00000.partial.jsonl").exists()



def test_a_later_turn_is_prompted_with_the_answers_regenerated_before_it(local_run, conversations, smollm2_tokenizer):
    """Turn 2's prompt holds the target's own turn-1 answer (generated first, in an earlier batch), never the data's:
    the context a drafter trains on is the one the target writes at inference."""
    originals = {r["id"]: r["messages"] for r in read_jsonl(conversations)}
    *first_turn, second_turn = local_run["batches"]
    assert len(second_turn) == 3 and sum(map(len, first_turn)) == 6
    for prompt in second_turn:
        record = next(r for r in local_run["records"] if r["messages"][: len(prompt)] == prompt)
        answer = next(m["content"] for m in prompt if m["role"] == "assistant")
        original = next(m["content"] for m in originals[record["id"]] if m["role"] == "assistant")
        assert answer == record["messages"][prompt.index({"role": "assistant", "content": answer})]["content"]
        assert answer != original and prompt[-1]["role"] == "user"
        ids = render_prompt(smollm2_tokenizer, prompt)  # the rendered turn-2 prompt holds the answer's tokens
        assert smollm2_tokenizer.decode(ids).count(answer) == 1


def test_prompt_records_get_every_answer_from_the_target(model, smollm2_tokenizer, tmp_path):
    """Prompt sources (sources.py: real HealthBench and IFEval prompts) carry null placeholders where the answers go:
    each is written by the target, turn by turn, and the texts around them are kept verbatim."""
    from dflash_pipeline.sources import Source, read_source

    health, _ = read_source(Source("h", "pkg:eval_framework/tasks/healthbench/data/healthbench_eval.jsonl",
                                   "prompts"))
    ifeval, _ = read_source(Source("i", "pkg:eval_framework/tasks/ifeval/data/input_data.jsonl", "prompts"))
    multi = next(r for r in health if sum(m["role"] == "assistant" for m in r["messages"]) == 2
                 and len(render_prompt(smollm2_tokenizer, r["messages"][:1])) < 120)
    records = [dict(multi, id="h/multi", source="h"), dict(ifeval[0], id="i/single", source="i")]
    backend = Recording(LocalBackend(model, smollm2_tokenizer, max_new_tokens=MAX_NEW_TOKENS))
    counts, written = run(write_jsonl(tmp_path / "prompts.jsonl", records), backend, smollm2_tokenizer, tmp_path,
                          settings={**SETTINGS, "max_prompt_tokens": 1000})
    assert [r["id"] for r in written] == ["h/multi", "i/single"] and counts["succeeded"] == 2
    table = read_counts(tmp_path / "shard_00000.counts.tsv")  # per source too
    assert (table["h:succeeded"], table["h:turns"], table["i:succeeded"], table["i:turns"]) == (1, 2, 1, 1)
    assert table["h:generated_tokens"] + table["i:generated_tokens"] == table["generated_tokens"]
    for record, source in zip(written, records):
        assert all(isinstance(m["content"], str) and m["content"] for m in record["messages"])
        assert [m for m in record["messages"] if m["role"] != "assistant"] == [
            m for m in source["messages"] if m["role"] != "assistant"]
    assert len(backend.batches) == 2 and backend.batches[1][0][1] == written[0]["messages"][1]  # turn 2 saw turn 1

# ---- the decode loop (greedy.py) against generate ----
def test_the_decode_loop_equals_unbatched_generate_and_the_generate_path(model, smollm2_tokenizer, monkeypatch):
    chats = [[{"role": "user", "content": q}] for q in ("What is 2+2? Answer with one number.", "Say hi.",
                                                         "Name a primary colour.", "Write a haiku about autumn.")]
    chats += [turn_segments(r["messages"])[0][0] for r in sharegpt_conversations(2)]  # their first prompts
    prompts = sorted((render_prompt(smollm2_tokenizer, chat) for chat in chats), key=len)
    kept = []  # the batch's rows after each drop of finished rows
    select = greedy.SlotLayer.batch_select_indices
    monkeypatch.setattr(greedy.SlotLayer, "batch_select_indices",
                        lambda layer, indices: kept.append(len(indices)) or select(layer, indices))
    n = 32
    assert greedy.unsupported(model) is None
    loop = generate_batch(model, prompts, n)
    assert model.config._attn_implementation == "sdpa"  # set back after the loop
    assert loop == generate_batch(model, prompts, n, method="generate")
    for prompt, (tokens, hit_cap) in zip(prompts, loop):  # reference: one prompt, no padding, plain generate
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
        assert (tokens, hit_cap) == greedy.answer(out[0, len(prompt):].tolist(), {2})
    ended = sorted(len(tokens) for tokens, hit_cap in loop if not hit_cap)
    assert ended[0] < ended[-1] < n and any(hit_cap for _, hit_cap in loop), loop  # EOS at two steps, and the cap
    layers = model.config.num_hidden_layers
    assert len(kept) == 2 * layers and kept[0] > kept[-1] > 0  # the rows still going, after each of both ends


def test_targets_the_decode_loop_does_not_fit_use_generate(qwen3_5_text_dir, smollm2_tokenizer):
    from dflash_pipeline.target import load_target

    hybrid = load_target(str(qwen3_5_text_dir))
    assert "LinearAttention" in greedy.unsupported(hybrid)  # Gated-DeltaNet layers: no KV cache to preallocate
    assert LocalBackend(hybrid, smollm2_tokenizer, max_new_tokens=4).identity["decode"] == "generate"
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    assert generate_batch(hybrid, prompts, 4) == generate_batch(hybrid, prompts, 4, method="generate")


def test_turn_segments():
    user, bot, system = ({"role": r, "content": r} for r in ("user", "assistant", "system"))
    assert turn_segments([system, user, bot, user, bot]) == ([[system, user], [user]], 0)
    assert turn_segments([bot, system, bot, user, bot, user]) == ([[system, user]], 2)
    assert turn_segments([user, bot, bot, user, bot]) == ([[user]], 0)  # two answers in a row end it
    assert turn_segments([bot]) == ([], 1)


# ---- the server backend against a real local server ----
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chat_server(smollm2_dir):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "dflash_pipeline.cli", "serve", "--target", str(smollm2_dir),
                                "--port", str(port), "--threads", "1"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 180
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                break
            except OSError:
                if process.poll() is not None or time.time() > deadline:
                    pytest.fail(f"the server did not come up:\n{process.stdout.read().decode()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_server_backend_gives_the_in_process_text(chat_server, local_run, conversations, smollm2_tokenizer, tmp_path):
    backend = ServerBackend(chat_server, None, max_new_tokens=MAX_NEW_TOKENS, concurrency=3, timeout_s=120)
    assert backend.model == "target"  # the first model the server lists
    counts, records = run(conversations, backend, smollm2_tokenizer, tmp_path)
    assert records == local_run["records"]
    assert dict(counts) == dict(local_run["counts"])  # hit_max and generated tokens included


# ---- accounting: a stub server that fails some requests ----
LOOPING_ANSWER = "Here are the steps to follow." + " Repeat the step again." * 12  # as stripped replies are
class Stub(BaseHTTPRequestHandler):
    """Answers ``echo: <last user message>``; a last user message starting with ``503``, ``empty`` or ``slow``
    gets HTTP 503, an empty answer, or no answer within the client's timeout; one starting with ``loop`` gets
    ``LOOPING_ANSWER``."""

    requests: list[str] = []
    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        last = body["messages"][-1]["content"]
        Stub.requests.append(last)
        Stub.bodies.append(body)
        if last.startswith("503"):
            self.send_error(503)
            return
        if last.startswith("slow"):
            time.sleep(1.0)
        content = "" if last.startswith("empty") else LOOPING_ANSWER if last.startswith("loop") else f"echo: {last}"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                        "finish_reason": "length" if last.startswith("long") else "stop"}],
                           "usage": {"completion_tokens": 3}}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timeout)
            pass

    def log_message(self, *args):
        pass


def test_failures_are_counted_by_reason_and_never_dropped_silently(smollm2_tokenizer, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    chat = lambda cid, *users: {"id": cid, "messages": [  # noqa: E731
        m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "old"})]}
    records = [chat("ok", "hello"), chat("busy", "503 please"), chat("later-busy", "fine", "503 now"),
               chat("empty", "empty please"), chat("slow", "slow please"), chat("long", "long please"),
               chat("too-long", "word " * 500), {"id": "no-user", "messages": [{"role": "assistant", "content": "x"}]},
               chat("two", "first", "second")]
    conversations = write_jsonl(tmp_path / "in.jsonl", records)
    Stub.requests, Stub.bodies = [], []
    backend = ServerBackend(url, "stub", max_new_tokens=8, concurrency=4, timeout_s=0.3, retries=1, backoff_s=0.01)
    try:
        counts, output = run(conversations, backend, smollm2_tokenizer, tmp_path / "out")
    finally:
        server.shutdown()
        server.server_close()
    assert [r["id"] for r in output] == ["ok", "long", "two"]
    assert [m["content"] for m in output[2]["messages"]] == ["first", "echo: first", "second", "echo: second"]
    table = read_counts(tmp_path / "out" / "shard_00000.counts.tsv")
    answers = [m["content"] for r in output for m in r["messages"] if m["role"] == "assistant"]
    assert table.pop("answer_tokens") == sum(len(smollm2_tokenizer(a, add_special_tokens=False)["input_ids"])
                                             for a in answers)
    assert table.pop("looping_answers") == table.pop("loop_tokens") == 0
    assert table == {"input": 9, "succeeded": 3, "failed": 4, "skipped": 2, "failed:empty_response": 1,
                     "failed:http_503": 2, "failed:timeout": 1, "skipped:no_user_turn": 1,
                     "skipped:prompt_too_long": 1, "turns": 4, "hit_max_new_tokens": 1, "generated_tokens": 12,
                     "leading_assistant_dropped": 1, "stopped_early:prompt_too_long": 0}
    assert all(counts[key] == value for key, value in table.items())
    assert sorted(Stub.requests).count("503 please") == 2  # one retry
    assert sorted(Stub.requests).count("slow please") == 2
    assert "word word" not in " ".join(Stub.requests)  # the too-long prompt was never sent
    assert {json.dumps({k: v for k, v in body.items() if k != "messages"}) for body in Stub.bodies} == {
        '{"model": "stub", "max_tokens": 8, "temperature": 0.0}'}  # greedy; no template switch unless set

    # nothing listens: every request fails with connection_error, still counted, and the sums hold
    backend = ServerBackend(url, "stub", max_new_tokens=8, timeout_s=0.3, retries=0)
    counts, output = run(conversations, backend, smollm2_tokenizer, tmp_path / "down")
    assert output == [] and counts["failed:connection_error"] == counts["failed"] == 7 and counts["skipped"] == 2


def test_the_thinking_switch_reaches_the_chat_template_only_when_set(tmp_path):
    seen = []

    class Tokenizer:
        added_tokens_decoder, unk_token_id = {}, None  # no special tokens, no unknown token

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            assert not tokenize and add_generation_prompt
            seen.append(kwargs)
            return "prompt"

        def __call__(self, text, add_special_tokens, return_offsets_mapping):
            return {"input_ids": [1, 2, 3], "offset_mapping": [(0, 2), (2, 4), (4, 6)]}

    class Echo:
        identity = {"backend": "echo"}

        def generate(self, items):
            return [Reply("answer", 1, False) for _ in items]

    conversations = write_jsonl(tmp_path / "in.jsonl", [HAND_WRITTEN[0]])
    for thinking in (None, False, True):
        seen.clear()
        run(conversations, Echo(), Tokenizer(), tmp_path / str(thinking), settings={**SETTINGS, "thinking": thinking})
        assert seen == [{} if thinking is None else {"enable_thinking": thinking}] * 2  # both turns
    body = {}
    backend = ServerBackend("http://127.0.0.1:9", "m", max_new_tokens=4, thinking=False, retries=0)
    backend._call = lambda path, payload: body.update(payload) or {"choices": [{"message": {"content": "hi"}}]}
    assert backend.generate([{"messages": []}]) == [Reply("hi", 0, False)]
    assert body["chat_template_kwargs"] == {"enable_thinking": False}


# ---- batches sized by tokens ----
@given(st.lists(st.integers(1, 60), max_size=40), st.integers(1, 8), st.none() | st.integers(70, 400))
def test_token_batches_keep_the_order_and_fill_each_batch_within_its_rows_and_tokens(lengths, size, budget):
    items = [{"ids": [0] * n, "index": i} for i, n in enumerate(sorted(lengths))]
    batches = token_batches(items, size, budget, 10)
    assert [item for batch in batches for item in batch] == items and all(batches)
    fits = [lambda b: len(b) <= size, lambda b: budget is None or len(b) * (len(b[-1]["ids"]) + 10) <= budget]
    assert all(fit(batch) for batch in batches for fit in fits)
    # each batch took every prompt it could: with the next one it would break a limit
    assert all(not all(fit(batch + [after[0]]) for fit in fits) for batch, after in zip(batches, batches[1:]))


def test_batch_tokens_size_the_batches_and_leave_the_answers_as_they_are(local_run, conversations, model,
                                                                        smollm2_tokenizer, tmp_path):
    """A budget of 560 tokens and up to 8 rows: turn 1's five prompts of at most 63 tokens share a batch (5 × 83),
    its 92-token one goes alone; every answer is the one fixed batches of 4 gave (each is plain greedy's)."""
    settings = {**SETTINGS, "batch_size": 8, "batch_tokens": 4 * (120 + MAX_NEW_TOKENS)}
    backend = Recording(LocalBackend(model, smollm2_tokenizer, max_new_tokens=MAX_NEW_TOKENS))
    counts, records = run(conversations, backend, smollm2_tokenizer, tmp_path, settings)
    assert records == local_run["records"] and dict(counts) == dict(local_run["counts"])
    assert [len(batch) for batch in backend.batches] == [5, 1, 3]  # fixed batches of 4: [4, 2, 3]
    for batch in backend.batches:
        longest = max(len(render_prompt(smollm2_tokenizer, messages)) for messages in batch)
        assert len(batch) * (longest + MAX_NEW_TOKENS) <= settings["batch_tokens"]
    with pytest.raises(ValueError, match="batch_tokens .* must hold one prompt"):
        check_batch_tokens({**settings, "batch_tokens": 400 + MAX_NEW_TOKENS - 1})
    with pytest.raises(ValueError, match="set max_prompt_tokens"):
        check_batch_tokens({**settings, "max_prompt_tokens": None})


# ---- rerun: only what is missing ----
def test_a_rerun_after_a_kill_generates_only_the_unfinished_batches(local_run, conversations, model,
                                                                    smollm2_tokenizer, tmp_path):
    local = LocalBackend(model, smollm2_tokenizer, max_new_tokens=MAX_NEW_TOKENS)
    killed = Recording(local, fail_after=2)  # dies before its third batch (the first of turn 2)
    with pytest.raises(Killed):
        run(conversations, killed, smollm2_tokenizer, tmp_path)
    partial = tmp_path / "shard_00000.partial.jsonl"
    assert not (tmp_path / "shard_00000.jsonl").exists()
    lines = partial.read_text().splitlines()
    assert len(lines) == 1 + 6  # the header and the six turn-1 replies
    partial.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])  # as if killed while writing the last one

    resumed = Recording(local)
    counts, records = run(conversations, resumed, smollm2_tokenizer, tmp_path)
    # batch 1 (4 replies) reused; batch 2 (its last reply cut off) and turn 2 generated again
    assert resumed.batches == local_run["batches"][1:]
    assert records == local_run["records"] and dict(counts) == dict(local_run["counts"])
    assert not partial.exists()

    # a partial file of other settings is not reused
    killed = Recording(local, fail_after=1)
    with pytest.raises(Killed):
        run(conversations, killed, smollm2_tokenizer, tmp_path)
    other = Recording(LocalBackend(model, smollm2_tokenizer, max_new_tokens=4))
    run(conversations, other, smollm2_tokenizer, tmp_path, settings={**SETTINGS, "max_new_tokens": 4})
    assert other.batches[:2] == local_run["batches"][:2] and sum(map(len, other.batches)) == 9


def test_answers_that_loop_are_counted_per_source_and_tokenize_keeps_cuts_or_drops_them(smollm2_tokenizer,
                                                                                       tmp_path):
    """Regenerate counts the answers that loop per source; tokenize's ``loops`` (regenerate.loops) keeps them, cuts
    them at the onset (the cut answer's end-of-turn token unsupervised, an uncut answer's supervised) or drops their
    conversations, counted."""
    from dflash_pipeline.loops import loop_onset
    from dflash_pipeline.tokenization import read_tokenized, tokenize_shard

    tokenizer = smollm2_tokenizer
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    chat = lambda cid, *users: {"id": cid, "source": cid.split("/")[0], "messages": [  # noqa: E731
        m for u in users for m in ({"role": "user", "content": u}, {"role": "assistant", "content": "old"})]}
    records = [chat("a/loop", "loop please"), chat("b/plain", "hello"), chat("a/second", "hi", "loop again")]
    backend = ServerBackend(f"http://127.0.0.1:{server.server_address[1]}", "stub", max_new_tokens=8, retries=0)
    try:
        run(write_jsonl(tmp_path / "in.jsonl", records), backend, tokenizer, tmp_path / "out")
    finally:
        server.shutdown()
        server.server_close()
    table = read_counts(tmp_path / "out" / "shard_00000.counts.tsv")
    ids = tokenizer(LOOPING_ANSWER, add_special_tokens=False)["input_ids"]
    onset = loop_onset(ids, 16)
    assert 0 < onset < len(ids) - 16  # the answer as built loops
    assert table["looping_answers"] == table["a:looping_answers"] == 2 and table["b:looping_answers"] == 0
    assert table["loop_tokens"] == table["a:loop_tokens"] == 2 * (len(ids) - onset) and table["b:loop_tokens"] == 0

    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples, counts = {}, {}
    for policy in ("keep", "cut", "drop"):
        out = tmp_path / policy
        counts[policy] = tokenize_shard(tmp_path / "out" / "shard_00000.jsonl", tokenizer, shard=0, num_shards=1,
                                        max_length=4096, out_parquet=out / "tokens.parquet",
                                        out_counts=out / "counts.tsv", loops=policy)
        frame = read_tokenized(out / "tokens.parquet")
        samples[policy] = {row.id: (row.input_ids, row.loss_mask) for row in frame.itertuples()}
        assert counts[policy]["loop_conversations"] == 2

    def supervised(policy, cid):
        ids, mask = samples[policy][cid]
        return tokenizer.decode(ids[mask == 1]), [int(mask[i]) for i in range(len(ids)) if ids[i] == im_end]

    assert counts["keep"]["samples"] == 3 and counts["keep"]["loop_cut"] == counts["keep"]["loop_dropped"] == 0
    text, end_masks = supervised("keep", "a/loop")
    assert text == LOOPING_ANSWER + "<|im_end|>\n" and end_masks[-1] == 1  # the loop and its end-of-turn taught
    assert counts["cut"]["samples"] == 3 and counts["cut"]["loop_cut"] == 2 and counts["cut"]["loop_dropped"] == 0
    cut_text = LOOPING_ANSWER[: tokenizer(LOOPING_ANSWER, add_special_tokens=False,
                                          return_offsets_mapping=True)["offset_mapping"][onset][0]]
    text, end_masks = supervised("cut", "a/loop")
    assert text == cut_text and end_masks[-1] == 0  # up to the onset, no end-of-turn token taught
    # end-of-turn tokens of the template's system message, the user's, answer 1, the user's, answer 2: the clean first
    # answer keeps its end-of-turn supervised, the cut one not
    assert supervised("keep", "a/second")[1] == [0, 0, 1, 0, 1]
    text, end_masks = supervised("cut", "a/second")
    assert text == "echo: hi<|im_end|>\n" + cut_text and end_masks == [0, 0, 1, 0, 0]
    assert supervised("cut", "b/plain") == supervised("keep", "b/plain")
    assert counts["drop"]["samples"] == 1 and counts["drop"]["loop_dropped"] == 2 and list(samples["drop"]) == [
        "b/plain"]
