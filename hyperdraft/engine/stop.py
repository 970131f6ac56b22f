"""StopChecker: decides where a request's newly accepted tokens end.

A speculative step may accept several tokens; a stop inside the run truncates exactly where plain decoding, one
token per step, would have stopped. append() gives the same answer as appending the tokens one at a time and calling
check() after each, without the per-token loop unless a stop string ends inside the run.

Stop strings are looked for in the output's text as the user gets it: an IncrementalDetokenizer per request
(Request.stop_text), which decodes from character boundaries. A window of the last tokens decoded on its own missed
stops: with byte-fallback tokenizers (Llama 2, Mistral) a window starting inside a character turns the whole run of
byte tokens to U+FFFD, and skipped special tokens decode to nothing, so a stop can span more tokens than any window
(found by an audit: the user's text was cut at the stop while the engine generated on to max_new_tokens). The
detokenizer's settled text is the same however its tokens are pushed, so a run is pushed at once; only a run that
stops, or ends inside a character (where a byte-fallback decoder can hide text an earlier token of the run showed),
is replayed a token at a time.
"""

from __future__ import annotations

from hyperdraft.detokenizer import IncrementalDetokenizer
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
        if len(tokens) == 1 or (p.stop and self.tokenizer is not None and self._stops_inside(req, tokens)):
            # a plain decode's token (the common case: check() is the shortest test), or a stop string that ends at
            # one of the tokens, which needs the text after each
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

    def _stops_inside(self, req: Request, tokens: list[int]) -> bool:
        """Push the run to the request's text at once (one decode); True, with the text rewound to before the run,
        when a stop string may end inside it. A run that does not stop stays pushed: append() keeps all of it
        unless an EOS, stop id or length limit ends the request, whose text is then never read again."""
        text = self._text(req)
        before = text.mark()
        text.push(list(tokens))
        if not text.stopped and text.settled:
            return False
        # A stop, or text held back at the run's end: a stop string visible after an earlier token of the run may
        # be hidden there (byte-fallback decoders, detokenizer.IncrementalDetokenizer.settled), so look token by token.
        text.rewind(before)
        return True

    def _hit_stop_string(self, req: Request) -> bool:
        text = self._text(req)
        if text.stopped:
            req.stop_str_hit = text.stop_hit
        return text.stopped

    def _text(self, req: Request) -> IncrementalDetokenizer:
        """req's stop-string text, holding every output token appended so far."""
        if req.stop_text is None:
            req.stop_text = IncrementalDetokenizer(self.tokenizer, req.params.stop, req.params.skip_special_tokens,
                                                   prompt_ids=req.prompt_ids)
        text = req.stop_text
        if text.num_output_ids < len(req.output_ids):
            text.push(req.output_ids[text.num_output_ids:])
        return text
