"""StopChecker: decides where a request's newly accepted tokens end.

A speculative step may accept several tokens; a stop inside the run truncates exactly where plain decoding, one
token per step, would have stopped. scan() gives the same answer as appending the tokens one at a time and calling
check() after each, without the per-token loop unless stop strings need the decoded text.
"""

from __future__ import annotations

from hyperdraft.detokenizer import decode_many
from hyperdraft.request import Request


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], context_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_len = context_len

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
        if len(tokens) == 1 or (p.stop and self.tokenizer is not None):  # a plain decode's token (the common case:
            # check() is the shortest test), or stop strings, which need the text after every token
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

    def _hit_stop_string(self, req: Request) -> bool:
        # A stop string of L characters spans at most 4L bytes, hence at most 4L byte-level tokens.
        window = 4 * max(len(s) for s in req.params.stop) + 2
        tail = decode_many(self.tokenizer, [req.output_ids[-window:]], req.params.skip_special_tokens)[0]
        for s in req.params.stop:
            if s in tail:
                req.stop_str_hit = s
                return True
        return False
