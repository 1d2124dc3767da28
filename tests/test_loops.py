"""Repetition loops (src/dflash_pipeline/loops.py) and the loop-aware figures of an evaluation's result."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_pipeline.evaluate import summarize
from dflash_pipeline.loops import (accepted_before_onset, ends_in_loop, loop_aware_figures, loop_onset,
                                   steps_before_onset)

# 40 distinct tokens, then 80 tokens of the period-5 loop 1 2 3 4 5: the 16 tokens at 45 repeat those at 40, and no
# earlier run of 16 repeats (one starting at 41..44 would need its copy 5 back, which holds distinct tokens)
LOOPING = list(range(100, 140)) + [1, 2, 3, 4, 5] * 16
ONSET = 45
# its speculative steps (the prefill committed token 0): ten steps over tokens 1-39, one from 40 (committing 4) and
# one from 44 (8): the 12 steps that start before 45 commit 39 + 4 + 8 = 51; nine more from 52 on commit 68
LOOPING_COMMITTED = [3, 2, 4, 1, 5, 6, 2, 7, 5, 4] + [4, 8] + [8] * 8 + [4]
# 30 distinct tokens, no loop, 29 steps of 1
PLAIN = list(range(200, 230))
PLAIN_COMMITTED = [1] * 29


def test_the_hand_made_loop_as_built():
    assert len(LOOPING) == 120 and sum(LOOPING_COMMITTED) == 119 and sum(PLAIN_COMMITTED) == 29
    assert loop_onset(LOOPING) == ONSET and loop_onset(PLAIN) is None
    assert ends_in_loop(LOOPING) and not ends_in_loop(PLAIN)
    assert steps_before_onset(LOOPING_COMMITTED, ONSET) == LOOPING_COMMITTED[:12]
    accepted = [c - 1 for c in LOOPING_COMMITTED]
    assert accepted_before_onset([accepted, [0] * 29], [LOOPING_COMMITTED, PLAIN_COMMITTED], [LOOPING, PLAIN]) == \
        [accepted[:12], [0] * 29]


def test_loop_aware_figures_by_hand():
    figures = loop_aware_figures([LOOPING_COMMITTED, PLAIN_COMMITTED], [LOOPING, PLAIN])
    assert figures["tau_loop_aware_mean"] == pytest.approx((51 / 12 + 29 / 29) / 2)
    assert figures["tau_loop_aware_pooled"] == pytest.approx((51 + 29) / (12 + 29))
    assert figures["loop_aware_steps"] == 12 + 29
    assert figures["loop_output_share"] == 1 / 2
    assert figures["loop_token_share"] == pytest.approx((120 - 45) / (120 + 30))
    # with n = 30 the repeated run starts later: 30 tokens at 45 equal those at 40 still, nothing earlier repeats
    assert loop_onset(LOOPING, 30) == ONSET and loop_onset(LOOPING, 80) is None
    assert loop_aware_figures([LOOPING_COMMITTED], [LOOPING], n=80)["tau_loop_aware_pooled"] == 119 / 21
    empty = loop_aware_figures([], [])
    assert empty["tau_loop_aware_mean"] is None and empty["loop_output_share"] is None


def test_the_result_holds_the_figures_for_the_drafter_and_prompt_lookup_overall_and_per_category():
    # prompt lookup's first forward starts at output position 0: 40 steps of 1 (positions 0-39), one of 5 from 40, then
    # 15 of 5 from 45 on (not counted); on the plain output 15 steps of 2, all counted
    lookup_looping, lookup_plain = [1] * 40 + [5] * 16, [2] * 15
    rows = []
    for index, (category, output, committed, lookup) in enumerate(
            [("writing", LOOPING, LOOPING_COMMITTED, lookup_looping), ("math", PLAIN, PLAIN_COMMITTED, lookup_plain)]):
        rows.append({"id": index, "index": index, "category": category, "output_ids": output, "tokens": len(output),
                     "committed": committed, "accepted": [c - 1 for c in committed], "seconds": 1.0,
                     "ar_tokens": len(output), "ar_seconds": 2.0, "pld_tokens": len(output), "pld_seconds": 1.5,
                     "pld_forwards": len(lookup), "pld_tau": len(output) / len(lookup), "pld_committed": lookup,
                     "pld_output_ids": output, "pld_skipped": None, "matches_ar": True})
    result = summarize(rows, block_size=16, max_new_tokens=120)
    assert result["tau_pooled"] == (119 + 29) / (21 + 29)  # all steps, as before
    assert result["tau_loop_aware_pooled"] == pytest.approx(80 / 41)
    assert result["tau_loop_aware_mean"] == pytest.approx((51 / 12 + 1) / 2)
    assert result["loop_output_share"] == 0.5 and result["loop_token_share"] == pytest.approx(75 / 150)
    assert result["prompt_lookup_tau_pooled"] == 150 / 71
    assert result["prompt_lookup_tau_loop_aware_pooled"] == pytest.approx((45 + 30) / (41 + 15))
    assert result["prompt_lookup_tau_loop_aware_mean"] == pytest.approx((45 / 41 + 2) / 2)
    assert result["prompt_lookup_loop_token_share"] == pytest.approx(75 / 150)
    # per position over the 41 steps before the onsets: the looping output's first 12 steps accepted 2 1 3 0 4 5 1 6
    # 4 3 3 7, the plain output's 29 none; over all 50 steps the loop's 8 steps of 7 and one of 3 count too
    assert result["acceptance_per_position_loop_aware"] == [n / 41 for n in (11, 9, 8, 5, 3, 2, 1)] + [0.0] * 8
    assert result["acceptance_per_position"] == [n / 50 for n in (20, 18, 17, 13, 11, 10, 9)] + [0.0] * 8
    assert result["loop_ngram"] == 16 and sorted(result["by_category"]) == ["math", "writing"]
    writing, math = result["by_category"]["writing"], result["by_category"]["math"]
    assert writing["prompts"] == 1 and writing["tau_loop_aware_pooled"] == 51 / 12 and writing["tau_pooled"] == 119 / 21
    assert writing["prompt_lookup_tau_loop_aware_pooled"] == 45 / 41 and writing["loop_output_share"] == 1.0
    assert math["tau_loop_aware_mean"] == 1.0 and math["prompt_lookup_tau_loop_aware_mean"] == 2.0
    assert math["loop_token_share"] == 0.0
    # rows without prompt lookup's per-step record (results written before it): its loop-aware figures are None
    old = [{k: v for k, v in row.items() if k not in ("pld_committed", "pld_output_ids")} for row in rows]
    old_result = summarize(old, block_size=16, max_new_tokens=120, loop_ngram=80)
    assert old_result["prompt_lookup_tau_loop_aware_pooled"] is None and old_result["prompt_lookup_tau_pooled"] == 150 / 71
    assert old_result["tau_loop_aware_pooled"] == (119 + 29) / (21 + 29) and old_result["loop_ngram"] == 80


def test_loop_onset_edge_cases():
    assert loop_onset([]) is None and loop_onset([5] * 16) is None  # one 16-token run only
    assert loop_onset([5] * 17) == 1  # a loop from the start: the run at 1 repeats the one at 0
    assert loop_onset([1, 2] * 20) == 2
    assert loop_onset(list(range(10)), n=16) is None  # n larger than the output
    assert loop_onset([1, 2, 3, 1, 2, 3], n=3) == 3 and loop_onset([1, 2, 3, 1, 2, 4], n=3) is None
    with pytest.raises(ValueError):
        loop_onset([1, 2], n=0)


def test_ends_in_loop_edge_cases():
    assert ends_in_loop([7] * 64) and not ends_in_loop([7] * 63)  # shorter than the window: no
    assert not ends_in_loop(list(range(64)))
    body48, body49 = list(range(48)), list(range(49))
    assert ends_in_loop(list(range(500, 600)) + (body48 * 2)[:64])  # period 48: the longest counted
    assert not ends_in_loop(list(range(500, 600)) + (body49 * 2)[:64])
    assert not ends_in_loop([1, 2, 3] * 30 + [9])  # an end (EOS) after the loop breaks it


def test_steps_before_onset():
    assert steps_before_onset([3, 3, 3], None) == [3, 3, 3]
    assert steps_before_onset([3, 3, 3], 1) == []  # the first step starts at the onset
    assert steps_before_onset([3, 3, 3], 2) == [3]  # starts at 1, the next at 4
    assert steps_before_onset([3, 3, 3], 1, first_step_start=0) == [3]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 6))
def test_loop_onset_is_the_first_repeated_run(tokens, n):
    runs = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    onset = loop_onset(tokens, n)
    repeats = [i for i, run in enumerate(runs) if run in runs[:i]]
    assert onset == (repeats[0] if repeats else None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=40), st.integers(0, 200))
def test_steps_before_onset_start_before_it(committed, onset):
    kept = steps_before_onset(committed, onset)
    starts = [1 + sum(committed[:k]) for k in range(len(committed))]
    assert kept == [c for c, start in zip(committed, starts) if start < onset]
