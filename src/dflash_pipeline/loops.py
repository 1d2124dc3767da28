"""Repetition loops in generated text (issue #50): where an output starts repeating itself, whether it ends in a
loop, the τ of the verify steps before the repetition, and what training does with answers that loop.

A small target decoded greedily falls into loops, and a drafter predicts a loop almost perfectly, so τ over whole
outputs mixes the text a real target writes with loop text. The definitions:

- **onset** (``loop_onset``): the index of the first token of the output's first repeated n-token run — the first
  position i whose n tokens ``tokens[i:i+n]`` already occurred starting at some j < i (the runs may overlap: a
  period-1 loop ``x x x …`` has onset 1). The tokens before it hold the loop's first cycle once; the onset is where
  the second occurrence starts. None when no n-token run repeats (or the output is shorter than n + 1 tokens).
- **ends in a loop** (``ends_in_loop``): the output's last ``window`` (64) tokens are periodic with a period of at
  most ``max_period`` (48). An output shorter than the window does not.
- **loop-aware τ** (``loop_aware_figures``): τ over the verify steps that start before the onset. A step starts at
  the output position of the first token it commits: the tokens committed by the steps before it, plus
  ``first_step_start`` (1 for speculative decoding, whose prefill commits the output's first token; 0 for prompt
  lookup, whose first target forward both prefills and verifies).
"""

from __future__ import annotations

import math

LOOP_POLICIES = ("keep", "cut", "drop")


def loop_onset(tokens: list[int], n: int = 16) -> int | None:
    """Index of the first token of the first repeated ``n``-token run (module docstring); None if none repeats."""
    if n < 1:
        raise ValueError(f"loop_onset: n must be >= 1, not {n}")
    seen = set()
    for i in range(len(tokens) - n + 1):
        run = tuple(tokens[i: i + n])
        if run in seen:
            return i
        seen.add(run)
    return None


def ends_in_loop(tokens: list[int], window: int = 64, max_period: int = 48) -> bool:
    """Whether the last ``window`` tokens repeat with some period p <= ``max_period`` (tail[k] == tail[k + p] for
    every k); False for an output shorter than ``window``."""
    if len(tokens) < window:
        return False
    tail = list(tokens[-window:])
    return any(tail[:-p] == tail[p:] for p in range(1, min(max_period, window - 1) + 1))


def steps_before_onset(committed: list[int], onset: int | None, first_step_start: int = 1) -> list[int]:
    """The committed counts of the verify steps that start before ``onset`` (all of them when it is None)."""
    if onset is None:
        return list(committed)
    kept, start = [], first_step_start
    for count in committed:
        if start >= onset:
            break
        kept.append(count)
        start += count
    return kept


def accepted_before_onset(accepted: list[list[int]], committed: list[list[int]], outputs: list[list[int]],
                          n: int = 16, first_step_start: int = 1) -> list[list[int]]:
    """Per response the accepted-draft counts of its verify steps that start before its onset (the steps the
    loop-aware τ counts): the per-position acceptance a target that does not loop would see."""
    return [a[: len(steps_before_onset(c, loop_onset(o, n), first_step_start))]
            for a, c, o in zip(accepted, committed, outputs)]


def loop_aware_figures(committed: list[list[int]], outputs: list[list[int]], n: int = 16,
                       first_step_start: int = 1) -> dict:
    """Per response its verify steps' committed counts and its output ids -> the loop-aware figures of them all:

    tau_loop_aware_mean / tau_loop_aware_pooled: τ over the steps that start before the response's onset, mean over
    responses with such a step / all their committed tokens over all such steps; loop_aware_steps: those steps;
    loop_output_share: share of the outputs that end in a loop; loop_token_share: share of all output tokens at or
    after their output's onset. Any decoding with a per-step record of committed tokens can use it (speculative,
    prompt lookup, tree verification)."""
    if len(committed) != len(outputs):
        raise ValueError(f"loop_aware_figures: {len(committed)} step records for {len(outputs)} outputs")
    onsets = [loop_onset(o, n) for o in outputs]
    kept = [steps_before_onset(c, onset, first_step_start) for c, onset in zip(committed, onsets)]
    steps = sum(len(k) for k in kept)
    tokens = sum(len(o) for o in outputs)
    means = [sum(k) / len(k) for k in kept if k]
    return {
        "tau_loop_aware_mean": math.fsum(means) / len(means) if means else None,
        "tau_loop_aware_pooled": sum(map(sum, kept)) / steps if steps else None,
        "loop_aware_steps": steps,
        "loop_output_share": sum(map(ends_in_loop, outputs)) / len(outputs) if outputs else None,
        "loop_token_share": (sum(len(o) - s for o, s in zip(outputs, onsets) if s is not None) / tokens
                             if tokens else None),
    }


# ---- training data ----
def answer_loop(tokenizer, text: str, n: int = 16) -> tuple[int | None, int | None, int]:
    """An answer's text encoded with the target's tokenizer (as text, no special tokens) -> (its onset token, the
    character where that token starts — both None when it does not loop — and its token count)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    onset = loop_onset(encoded["input_ids"], n)
    if onset is None:
        return None, None, len(encoded["input_ids"])
    return onset, encoded["offset_mapping"][onset][0], len(encoded["input_ids"])


def apply_loop_policy(messages: list[dict], tokenizer, policy: str, n: int = 16) -> tuple[list[dict] | None, str]:
    """What training sees of a conversation whose assistant answers may loop -> (messages or None, outcome).

    outcome ``clean``: no answer loops (the messages as they are). Otherwise, by ``policy``: ``keep`` (as they are,
    outcome ``kept``); ``drop`` (None, ``dropped``); ``cut`` (``cut``): the first looping answer ends at its onset
    (the text before the onset token's first character) and is marked ``"truncated": true`` — tokenize then teaches
    no end-of-turn token after it — and every later message is left out (they were written after the whole loop).
    A cut answer with no text left before its onset leaves the conversation up to the answer before it (None,
    ``dropped``, when that was the first answer)."""
    if policy not in LOOP_POLICIES:
        raise ValueError(f"loop policy {policy!r}: not one of {LOOP_POLICIES}")
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        _, onset, _ = answer_loop(tokenizer, message["content"], n)
        if onset is None:
            continue
        if policy == "keep":
            return messages, "kept"
        if policy == "drop":
            return None, "dropped"
        text = message["content"][:onset]
        if text.strip():
            return messages[:index] + [{**message, "content": text, "truncated": True}], "cut"
        earlier = [i for i in range(index) if messages[i]["role"] == "assistant"]
        return (messages[: earlier[-1] + 1], "cut") if earlier else (None, "dropped")
    return messages, "clean"
