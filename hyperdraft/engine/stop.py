"""StopChecker: decides, token by token, whether a request is finished.

Called once per appended token, also for the several tokens one speculative
step accepts, so a stop inside an accepted run truncates exactly where plain
decoding would have stopped.
"""

from __future__ import annotations

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

    def _hit_stop_string(self, req: Request) -> bool:
        # A stop string of L characters spans at most 4L bytes, hence at most 4L byte-level tokens.
        window = 4 * max(len(s) for s in req.params.stop) + 2
        tail = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=req.params.skip_special_tokens)
        for s in req.params.stop:
            if s in tail:
                req.stop_str_hit = s
                return True
        return False
