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

push_all serves every request of a step with one batched decode of all their windows: through transformers' decode
each window cost ~8 us of Python around ~1.5 us of Rust (a profile of 64 running SmolLM2 requests on an H100 spent
0.67 s of 2.6 s in pushes), so windows go straight to the Rust tokenizer where that is what decode would do (a fast
tokenizer that cleans up no spaces), a step's many as one decode_batch (benchmarks/probes/detok_batch.py).
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerFast


# Prompt tokens decoded before the output's and never emitted, as SGLang and vLLM do (5 there too): a SentencePiece
# decoder drops the leading space of a window's first piece, so without them an answer's first word lost its space
# ("▁Paris" after "is" gave "isParis" with echo) and a stop string starting with a space could not match there.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True, keep_stop: bool = False,
                 prompt_ids: list[int] | None = None):
        """keep_stop: the text ends after the stop string instead of before it (SGLang's no_stop_trim).
        prompt_ids: the request's prompt, whose last CONTEXT_TOKENS give the output's first token its context."""
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.keep_stop = keep_stop
        # stop string -> {character: the n where s[n - 1] is that character, longest first}, for n < len(s): a suffix
        # of the text that is a proper prefix s[:n] ends with s[n - 1], so only those n are worth testing
        self._prefix_ends = [(s, _ends_by_char(s)) for s in dict.fromkeys(self.stop)]
        self.skip_special_tokens = skip_special_tokens
        context = _context(tokenizer, prompt_ids, skip_special_tokens)
        self.ids: list[int] = list(context)  # the context, then the output's ids
        self._context_len = len(context)
        # Text positions count characters from the output's start. The settled text (that of ids[:read]) is kept
        # from held_from = min(emitted, settled) on only, as `held` (so it ends at held_from + len(held)): the whole
        # text, rebuilt at every push, was a copy of the output a push (an audit: 9 us a push at 32k tokens, 18 us
        # at 128k, per request and detokenizer). Emitted text can run past the settled text (whole characters
        # before a half one).
        self.emitted: list[str] = []  # the emitted text, in the pieces emitted
        self.held = ""
        self._held_from = self._emitted_len = 0
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the text
        self._prefix, self._read = 0, len(context)  # the decode window: ids[prefix:read] gave the end of the held text

    @property
    def num_output_ids(self) -> int:
        """The output tokens pushed so far."""
        return len(self.ids) - self._context_len

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self.emitted)

    def push(self, new_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the newly final text."""
        return push_all([(self, new_ids, final)])[0]

    @property
    def settled(self) -> bool:
        """Every pushed token's text is final: the last push did not end inside a character (or in a token that
        decodes to nothing). A byte-fallback decoder turns a whole run of byte tokens into U+FFFD while its last
        character is incomplete, so text visible after one token of a run can vanish after the next."""
        return self._read == len(self.ids)

    def mark(self) -> tuple:
        """The state as it stands, for rewind: a push of several tokens that stopped can be replayed a token at a
        time to find the token it stopped at."""
        return (len(self.ids), len(self.emitted), self.held, self._held_from, self._emitted_len, self.stopped,
                self.stop_hit, self._prefix, self._read)

    def rewind(self, mark: tuple) -> None:
        n, pieces, self.held, self._held_from, self._emitted_len, self.stopped, self.stop_hit, self._prefix, \
            self._read = mark
        del self.ids[n:]
        del self.emitted[pieces:]

    def windows(self) -> list[list[int]]:
        """The two windows this push decodes (none when there is nothing to decode): what gave `decoded`'s end last
        time, and the same start up to the newest token."""
        if self.tokenizer is None or self.stopped:
            return []
        return [self.ids[self._prefix:self._read], self.ids[self._prefix:]]

    def take(self, before: str, now: str, final: bool) -> str:
        """The push's newly final text, from its windows' decoded texts. Stop strings and their starts are looked
        for in the text not yet emitted only: emitted text never ends with the start of a stop string (that much
        is held back), so none begins inside it."""
        text = self._advance(now[len(before):], final)[self._emitted_len - self._held_from:]  # not yet emitted
        found = [(at, k) for k, at in enumerate(text.find(s) for s in self.stop) if at >= 0]
        cut = min(found, default=(-1, -1))[0]  # at one place, the first string of the list is the one hit
        if cut >= 0:
            self.stopped, self.stop_hit = True, self.stop[min(found)[1]]
            safe = text[:cut + len(self.stop_hit)] if self.keep_stop else text[:cut]
        elif final:
            safe = text
        else:
            safe = text[: len(text) - self._partial_stop_len(text)]
        if not safe:
            return ""
        self.emitted.append(safe)
        self._emitted_len += len(safe)
        start = min(self._emitted_len, self._held_from + len(self.held))
        self.held, self._held_from = self.held[start - self._held_from:], start
        return safe

    def _advance(self, new: str, final: bool) -> str:
        """new: the window's text past what it gave last time -> the text from held_from on: `held`, plus new up to
        a trailing half character (all of it when final). The window moves on only when new ends in a whole
        character."""
        if new and not new.endswith("\ufffd"):
            self.held += new
            self._prefix, self._read = self._read, len(self.ids)
            return self.held
        return self.held + (new if final else new.rstrip("\ufffd"))

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        if not text:
            return best
        for s, ends in self._prefix_ends:
            for n in ends.get(text[-1], ()):
                if n <= best:
                    break
                if n <= len(text) and text.endswith(s[:n]):
                    best = n
                    break
        return best


def _context(tokenizer, prompt_ids: list[int] | None, skip_special_tokens: bool) -> list[int]:
    """The prompt's last CONTEXT_TOKENS ids, or none where they end inside a character (the output's first token
    could complete it, and its text would then start inside the context's)."""
    if tokenizer is None or not prompt_ids:
        return []
    context = list(prompt_ids[-CONTEXT_TOKENS:])
    return [] if decode_many(tokenizer, [context], skip_special_tokens)[0].endswith("\ufffd") else context


def _ends_by_char(s: str) -> dict[str, list[int]]:
    ends: dict[str, list[int]] = {}
    for n in range(len(s) - 1, 0, -1):
        ends.setdefault(s[n - 1], []).append(n)
    return ends


def push_all(pushes: list[tuple[IncrementalDetokenizer, list[int], bool]]) -> list[str]:
    """(detokenizer, new ids, final) per request -> each push's newly final text, with one batched decode per
    (tokenizer, skip_special_tokens) for all of them."""
    for detok, new_ids, _ in pushes:
        detok.ids.extend(new_ids)
    windows = [detok.windows() for detok, _, _ in pushes]
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, (detok, _, _) in enumerate(pushes):
        if windows[i]:
            groups.setdefault((id(detok.tokenizer), detok.skip_special_tokens), []).append(i)
    texts: dict[int, list[str]] = {}
    for members in groups.values():
        first = pushes[members[0]][0]
        decoded = decode_many(first.tokenizer, [w for i in members for w in windows[i]], first.skip_special_tokens)
        texts.update((i, decoded[2 * j: 2 * j + 2]) for j, i in enumerate(members))
    return [detok.take(*texts[i], final) if i in texts else "" for i, (detok, _, final) in enumerate(pushes)]


# Measured on this CPU (2 cores), short windows: the Rust decode 1.6 us a sequence, its decode_batch 1.1 us a sequence
# plus 8 us a call, transformers' decode 7.7 us a sequence.
BATCH_DECODE_MIN = 16


def decode_many(tokenizer, sequences: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """tokenizer.decode of each sequence, through the Rust tokenizer where that is what decode does."""
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or tokenizer.clean_up_tokenization_spaces:
        return [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]
    backend = tokenizer.backend_tokenizer
    if len(sequences) >= BATCH_DECODE_MIN:
        return backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)
    return [backend.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]


def token_texts(tokenizer, ids: list[int], before: int | None) -> list[str]:
    """Each token's text as it reads in the output (OpenAI's logprob tokens), special tokens included: decoded after
    the token before it (before: the one ahead of ids[0], the prompt's last for an answer's first), so a
    SentencePiece piece keeps the leading space its decode alone strips. A token after part of a character, or with
    no token before it, is decoded alone."""
    pairs = [[p, t] if p is not None else [t] for p, t in zip([before, *ids[:-1]], ids)]
    heads = [pair[:-1] for pair in pairs]
    decoded = decode_many(tokenizer, [seq for pair, head in zip(pairs, heads) for seq in (head, pair)], False)
    texts = []
    for k, t in enumerate(ids):
        head, both = decoded[2 * k], decoded[2 * k + 1]
        whole = not head.endswith("\ufffd") and both.startswith(head)
        texts.append(both[len(head):] if whole else tokenizer.decode([t], skip_special_tokens=False))
    return texts


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) stand-in character for each byte -> the byte: printable Latin-1 bytes stand for
    themselves, the others (controls, space, 127-160, the soft hyphen) for 256, 257, ... in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def token_bytes(tokenizer, token_id: int, text: str) -> list[int] | None:
    """A token's UTF-8 bytes, as OpenAI's logprobs give them (text: the token decoded alone), also for a token holding
    part of a character (its text is U+FFFD): its raw bytes from a byte-level BPE piece or a SentencePiece
    byte-fallback piece; None where neither says."""
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    fallback = _BYTE_TOKEN.fullmatch(piece)
    if fallback:
        return [int(fallback.group(1), 16)]
    return [_BYTE_LEVEL[c] for c in piece] if all(c in _BYTE_LEVEL for c in piece) else None
