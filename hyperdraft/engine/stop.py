"""StopChecker: decides where a request's newly accepted tokens end.

A speculative step may accept several tokens; a stop inside the run truncates exactly where plain decoding, one
token per step, would have stopped. scan() gives the same answer as appending the tokens one at a time and calling
check() after each, without the per-token loop unless stop strings need the decoded text.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from hyperdraft.detokenizer import decode_many
from hyperdraft.request import Request

REPLACEMENT = "\ufffd"  # what a decode ending inside a UTF-8 character reads there


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], context_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_len = context_len
        # Whether a decode of a run of tokens contains the decode of every piece of it (edges aside): the Rust
        # decoders map tokens to text one by one; clean_up_tokenization_spaces rewrites " ." and the like, which can
        # move text across a piece's end.
        self.pieces_are_substrings = isinstance(tokenizer, PreTrainedTokenizerFast) and \
            not tokenizer.clean_up_tokenization_spaces

    def check(self, req: Request) -> str | None:
        """-> "stop", "length" or None, for the state after the newest token was appended."""
        p, last = req.params, req.output_ids[-1]
        if not p.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if p.stop_token_ids and last in p.stop_token_ids:
            return "stop"
        if p.stop and self.tokenizer is not None and self._hit_stop_string(req):
            return "stop"
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_len:
            return "length"
        return None

    def append(self, req: Request, tokens: list[int], logprobs: list[float]) -> tuple[list[int], str | None]:
        """Append the leading tokens up to and including the first that finishes the request (logprobs too, when
        the request returns them) -> (the appended tokens, the finish reason or None)."""
        p = req.params
        if not tokens:
            return [], None
        if len(tokens) == 1 or (p.stop and self.tokenizer is not None and self._may_stop_inside(req, tokens)):
            # a plain decode's token (the common case: check() is the shortest test), or a stop string that may end
            # at one of the tokens, which needs the text after each
            return self._append_one_by_one(req, tokens, logprobs)
        # check() fires at the first token that reaches a length limit, or earlier at a stop id (at the same token
        # the stop id wins: check() tests it first).
        room = min(p.max_new_tokens - len(req.output_ids), self.context_len - req.seq_len)
        end = min(len(tokens), max(room, 1))  # tokens[end - 1] is the last one appended unless a stop id comes first
        reason = "length" if room <= len(tokens) else None
        window = tokens[:end]
        eos = () if p.ignore_eos else self.eos_token_ids
        if (eos and not eos.isdisjoint(window)) or (p.stop_token_ids and any(t in p.stop_token_ids for t in window)):
            end = next(i for i, t in enumerate(window) if t in eos or (p.stop_token_ids and t in p.stop_token_ids)) + 1
            reason = "stop"
        appended = tokens[:end]
        req.output_ids.extend(appended)
        if p.return_logprob:
            req.output_logprobs.extend(logprobs[:end])
        return appended, reason

    def _append_one_by_one(self, req: Request, tokens: list[int], logprobs: list[float]) -> tuple[list[int], str | None]:
        for i, tok in enumerate(tokens):
            req.output_ids.append(tok)
            if req.params.return_logprob:
                req.output_logprobs.append(logprobs[i])
            reason = self.check(req)
            if reason is not None:
                return tokens[: i + 1], reason
        return list(tokens), None

    def _may_stop_inside(self, req: Request, tokens: list[int]) -> bool:
        """Whether check() after some token of this run could find a stop string, from one decode of everything
        those checks read (the last `window` tokens before each: the window less one, then the run). Each check's
        text is a piece of that text, edges aside: a piece's first token may lose its leading space (Metaspace,
        Strip), which only shortens it, and its last may end inside a character and read U+FFFD. So where the
        tokenizer keeps pieces as substrings and no stop string holds U+FFFD, no hit in the whole means no hit in
        any check. A hit means only "look closer": the run is checked token by token, as plain decoding would."""
        stops = req.params.stop
        if not self.pieces_are_substrings or any(REPLACEMENT in s for s in stops):
            return True
        ids = req.output_ids[-(_window(stops) - 1):] + list(tokens)
        text = decode_many(self.tokenizer, [ids], req.params.skip_special_tokens)[0]
        return any(s in text for s in stops)

    def _hit_stop_string(self, req: Request) -> bool:
        window = _window(req.params.stop)
        tail = decode_many(self.tokenizer, [req.output_ids[-window:]], req.params.skip_special_tokens)[0]
        for s in req.params.stop:
            if s in tail:
                req.stop_str_hit = s
                return True
        return False


def _window(stops: list[str]) -> int:
    """Tokens a stop check decodes: a stop string of L characters spans at most 4L bytes, so at most 4L byte-level
    tokens, and one more on each side may hold part of a character."""
    return 4 * max(len(s) for s in stops) + 2
