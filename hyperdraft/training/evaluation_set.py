"""The evaluation set train-draft must never train on: MT-bench's questions, every turn, kept inside the package as
hashes (not their text), so the refusal holds wherever the command runs, with or without the questions file.

A text's words: NFKC-normalised, case-folded, zero-width characters and quote marks dropped (a curly and a straight
apostrophe alike), every other non-word character a separator. Two kinds of hash (scripts/mt_bench_fingerprints.py
writes both into mt_bench_hashes.py):
  fingerprint   the first 16 hex digits of the SHA-256 of the words joined by spaces: a prompt that is a question,
                however spaced, capitalised or punctuated
  shingles      the first 8 hex digits of the SHA-256 of each run of SHINGLE_WORDS words: a prompt holding
                LEAK_SHARE of a question's runs holds the question, with text before or after it, a word changed or
                a sentence dropped (exact fingerprints let through a question without its final period, with a curly
                apostrophe, or after "Please help:"). A question shorter than one run is matched by its fingerprint.
Paraphrases are not caught; nothing short of the questions themselves would.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

SHINGLE_WORDS = 5
LEAK_SHARE = 0.6
_DROPPED = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff'\"`\u00b4\u2018\u2019\u201c\u201d\u00ab\u00bb"))
_SEPARATORS = re.compile(r"[\W_]+")


def folded(text: str) -> str:
    """text case-folded, its whitespace runs one space each: what the questions file's containment check compares."""
    return " ".join(text.casefold().split())


def words(text: str) -> list[str]:
    return _SEPARATORS.sub(" ", unicodedata.normalize("NFKC", text).casefold().translate(_DROPPED)).split()


def fingerprint(text: str) -> str:
    return hashlib.sha256(" ".join(words(text)).encode()).hexdigest()[:16]


def shingles(text: str) -> set[str]:
    """The hashes of text's runs of SHINGLE_WORDS words (none when it has fewer)."""
    w = words(text)
    return {hashlib.sha256(" ".join(w[i:i + SHINGLE_WORDS]).encode()).hexdigest()[:8]
            for i in range(len(w) - SHINGLE_WORDS + 1)}


@dataclass(frozen=True)
class EvaluationSet:
    fingerprints: frozenset[str]  # every question's
    questions: tuple[frozenset[str], ...]  # each question's shingles (the ones with at least one run)

    @classmethod
    def of(cls, texts: list[str]) -> "EvaluationSet":
        return cls(frozenset(map(fingerprint, texts)), tuple(frozenset(s) for s in map(shingles, texts) if s))

    def holds(self, prompt: str) -> bool:
        """Whether the prompt is a question, or holds LEAK_SHARE of one's runs of words."""
        if fingerprint(prompt) in self.fingerprints:
            return True
        own = shingles(prompt)
        return bool(own) and any(q and len(q & own) >= LEAK_SHARE * len(q) for q in self.questions)


def mt_bench() -> EvaluationSet:
    from hyperdraft.training.mt_bench_hashes import FINGERPRINTS, SHINGLES

    return EvaluationSet(frozenset(FINGERPRINTS.split()), tuple(frozenset(q.split()) for q in SHINGLES if q))
