"""No prompt of a scored set in training (issue #36): each system and user message of each conversation prepare
selects is compared with each user turn of each benchmark file the config scores on (``evaluate.benchmarks.*.prompts``,
all of their records and turns, whatever ``limit`` says).

Texts are compared after :func:`normalise` (Unicode NFKC, case folded, every run of characters that are not letters
or digits one space): an **exact** match is two equal normalised texts. A **near** match compares the sets of
character n-grams (``ngram`` characters) of the two normalised texts, scored prompt A and training message B:

- Jaccard ``|A ∩ B| / |A ∪ B| >= jaccard`` (the same text lightly edited: a word changed, one added), or
- containment ``|A ∩ B| / |A| >= containment`` where A has at least ``min_contained`` n-grams (the scored prompt
  inside a longer message, e.g. pasted after an instruction). Shorter scored prompts (MT-Bench's "Now, explain it
  to a 5-year-old") are common phrases: for them only Jaccard counts.

The search is exact, not sampled (no MinHash false negatives): by the prefix filter of set-similarity joins, a scored
prompt whose n-grams are ordered by rarity among the scored prompts can only reach containment t of a message that
holds one of its first ``|A| - ceil(t |A|) + 1`` n-grams, so only those are indexed, and a message is scored against
the prompts that one of its n-grams points to.
"""

from __future__ import annotations

import collections
import heapq
import json
import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from .resources import resolve_path

_NOT_WORD = re.compile(r"[\W_]+")


def normalise(text: str) -> str:
    """NFKC, case folded, every run of non-alphanumeric characters (whitespace, punctuation) one space, stripped."""
    return _NOT_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def char_ngrams(normalised: str, n: int) -> frozenset[str]:
    """The character n-grams of a normalised text (a shorter text: itself)."""
    if len(normalised) <= n:
        return frozenset([normalised]) if normalised else frozenset()
    return frozenset(normalised[i: i + n] for i in range(len(normalised) - n + 1))


def word_ngrams(normalised: str, n: int) -> frozenset[str]:
    """The runs of n words of a normalised text (a shorter text: itself)."""
    words = normalised.split()
    return frozenset(" ".join(words[i: i + n]) for i in range(max(1, len(words) - n + 1))) if words else frozenset()


@dataclass(frozen=True)
class ScoredPrompt:
    benchmark: str
    prompt_id: str
    turn: int  # 1-based user turn of the benchmark record
    text: str


@dataclass(frozen=True)
class Leak:
    conversation: str
    message: int  # index in the conversation's messages
    scored: ScoredPrompt
    kind: str  # exact | jaccard | containment
    score: float


def _record_turns(record) -> list[str]:
    """The user texts of a benchmark record: MT-Bench's ``turns``, a ``prompt`` string or message list, or the user
    messages of ``messages``/``conversations``."""
    if not isinstance(record, dict):
        return []
    turns = record.get("turns")
    if isinstance(turns, list):
        return [t if isinstance(t, str) else t.get("content") for t in turns if isinstance(t, (str, dict))]
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    messages = prompt if isinstance(prompt, list) else record.get("messages") or record.get("conversations") or []
    return [m.get("content", m.get("value")) for m in messages if isinstance(m, dict)
            and str(m.get("role", m.get("from"))).lower() in ("user", "human")]


def read_scored(benchmarks: dict[str, str]) -> list[ScoredPrompt]:
    """Every user turn of every record of each benchmark's prompt file (``{name: path or pkg: spec}``); a record
    without a user text stops the check, naming the file and line (an unread prompt cannot be checked)."""
    scored = []
    for name, source in benchmarks.items():
        path = resolve_path(source)
        text = path.read_text(encoding="utf-8")
        records = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.split("\n")
                                                                    if line.strip()]
        for index, record in enumerate(records):
            turns = [t for t in _record_turns(record) if isinstance(t, str) and t.strip()]
            if not turns:
                raise ValueError(f"{path} record {index + 1}: no user text to check training data against")
            prompt_id = str(record.get("question_id", record.get("uid", record.get("id", index))))
            scored += [ScoredPrompt(name, prompt_id, turn, t) for turn, t in enumerate(turns, 1)]
    return scored


class PrefixIndex:
    """Sets of n-grams indexed by their prefix filter for a threshold t: each set's ``|A| - ceil(t |A|) + 1`` first
    n-grams in one global order, its rank (n-grams in no set first, then the rarest among the sets)."""

    def __init__(self, sets: list[frozenset[str]], threshold: float):
        self.sets, self.threshold = sets, threshold
        frequency = collections.Counter(g for grams in sets for g in grams)
        self.rank = {gram: rank for rank, gram in enumerate(sorted(frequency, key=lambda g: (frequency[g], g)), 1)}
        self.sizes = [len(grams) for grams in sets]
        self.largest = max(self.sizes, default=0)
        self.postings: dict[int, list[int]] = collections.defaultdict(list)
        for index, grams in enumerate(sets):
            for rank in sorted(map(self.rank.__getitem__, grams))[: self._prefix_length(len(grams))]:
                self.postings[rank].append(index)

    def _prefix_length(self, size: int) -> int:
        return size - math.ceil(self.threshold * size) + 1

    def contained(self, grams: frozenset[str]) -> dict[int, float]:
        """Sets of which at least ``threshold`` of the n-grams are in ``grams`` -> that share."""
        found = {}
        for index in {i for rank in map(self.rank.__getitem__, grams & self.rank.keys()) for i in self.postings.get(rank, ())}:
            share = len(self.sets[index] & grams) / self.sizes[index]
            if share >= self.threshold:
                found[index] = share
        return found

    def similar(self, grams: frozenset[str]) -> dict[int, float]:
        """Sets of Jaccard similarity at least ``threshold`` with ``grams`` -> that similarity: probed with the
        prefix of ``grams`` itself (both prefixes must meet), and only sets of a size it can reach."""
        if len(grams) * self.threshold > self.largest:
            return {}
        ranks = list(map(self.rank.__getitem__, grams & self.rank.keys()))
        length = self._prefix_length(len(grams)) - (len(grams) - len(ranks))  # n-grams in no set come first
        if length <= 0:
            return {}
        low, high = self.threshold * len(grams), len(grams) / self.threshold
        found = {}
        for index in {i for rank in heapq.nsmallest(length, ranks) for i in self.postings.get(rank, ())}:
            if low <= self.sizes[index] <= high:
                shared = len(self.sets[index] & grams)
                similarity = shared / (self.sizes[index] + len(grams) - shared)
                if similarity >= self.threshold:
                    found[index] = similarity
        return found


class LeakCheck:
    """The index of the scored prompts; :meth:`find` names the scored prompt a text matches best."""

    def __init__(self, scored: list[ScoredPrompt], *, jaccard: float = 0.75, containment: float = 0.9,
                 ngram: int = 5, word_ngram: int = 3, min_words: int = 8):
        self.scored, self.ngram, self.word_ngram = scored, ngram, word_ngram
        normalised = [normalise(p.text) for p in scored]
        self.exact: dict[str, int] = {}
        for index, text in enumerate(normalised):
            self.exact.setdefault(text, index)
        self.chars = PrefixIndex([char_ngrams(text, ngram) for text in normalised], jaccard)
        self.words = PrefixIndex([word_ngrams(text, word_ngram) if len(text.split()) >= min_words else frozenset()
                                  for text in normalised], containment)

    def find(self, text: str) -> tuple[ScoredPrompt, str, float] | None:
        """``(scored prompt, kind, score)`` of the best match of ``text`` (exact, else the highest score); None if
        it matches none."""
        normalised = normalise(text)
        if normalised in self.exact:
            return self.scored[self.exact[normalised]], "exact", 1.0
        found = [(score, "jaccard", i) for i, score in self.chars.similar(char_ngrams(normalised, self.ngram)).items()]
        found += [(score, "containment", i)
                  for i, score in self.words.contained(word_ngrams(normalised, self.word_ngram)).items()]
        if not found:
            return None
        score, kind, index = max(found, key=lambda f: (f[0], f[1] == "jaccard", -f[2]))
        return self.scored[index], kind, score

    def check(self, record: dict) -> Leak | None:
        """The first system or user message of a prepared conversation that matches a scored prompt."""
        for position, message in enumerate(record["messages"]):
            if message["role"] != "assistant" and (found := self.find(message["content"])):
                return Leak(record["id"], position, *found)
        return None
