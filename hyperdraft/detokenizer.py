"""IncrementalDetokenizer: token ids in, stable text deltas out.

Speculative steps deliver several tokens at once and a character may be split
across tokens (and across steps), so text is emitted only once it is final:
  - a trailing U+FFFD (an incomplete UTF-8 sequence) is held back;
  - a trailing piece that could still grow into a stop string is held back;
  - the text ends before the first stop string, which is never emitted.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    @property
    def text(self) -> str:
        return self.emitted

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly final text."""
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            safe = full[:cut]
        elif final:
            safe = full
        else:
            safe = full.rstrip("\ufffd")
            safe = safe[: len(safe) - self._partial_stop_len(safe)]
        if not safe.startswith(self.emitted):  # a decode that rewrote earlier text: never un-emit, just wait
            return ""
        delta = safe[len(self.emitted):]
        self.emitted = safe
        return delta

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
