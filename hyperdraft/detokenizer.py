"""IncrementalDetokenizer: token ids in, stable text deltas out.

Speculative steps deliver several tokens at once and a character may be split
across tokens (and across steps), so text is emitted only once it is final:
  - a trailing U+FFFD (an incomplete UTF-8 sequence) is held back;
  - a trailing piece that could still grow into a stop string is held back;
  - the text ends before the first stop string, which is never emitted.

Each push costs the same however long the output is. Only a window of the ids is decoded: ids[prefix:read] were
decoded last time, and decoding ids[prefix:] now, the text past what that window gave is new (the window's first
tokens give the new ones their context: a leading space, a merge). The window moves on once the new text does not
end in U+FFFD. Stop strings are looked for only in the text not yet emitted: emitted text never ends with the start
of a stop string (that much is held back), so no stop string can begin inside it. Decoding the whole output at
every push cost O(length) each, ~100 us a token at 128 tokens on a CPU, on the engine's path.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.decoded = ""  # the text of ids[:read]
        self.emitted = ""  # a prefix of decoded
        self.stopped = False
        self._prefix = self._read = 0  # the decode window: ids[prefix:read] gave the end of `decoded`

    @property
    def text(self) -> str:
        return self.emitted

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly final text."""
        self.ids.extend(new_ids)
        if self.tokenizer is None or self.stopped:
            return ""
        text = self._decode_window(final)
        start = len(self.emitted)
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            safe, self.stopped = text[:cut], True
        elif final:
            safe = text
        else:
            safe = text[: len(text) - self._partial_stop_len(text)]
        if len(safe) <= start:
            return ""
        delta = safe[start:]
        self.emitted = safe
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, final: bool) -> str:
        """-> the text so far: `decoded`, plus the window's new text up to a trailing half character (all of it
        when final). The window moves on only when its new text ends in a whole character."""
        before = self._decode(self.ids[self._prefix:self._read])
        new = self._decode(self.ids[self._prefix:])[len(before):]
        if new and not new.endswith("\ufffd"):
            self.decoded += new
            self._prefix, self._read = self._read, len(self.ids)
            return self.decoded
        return self.decoded + (new if final else new.rstrip("\ufffd"))

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
