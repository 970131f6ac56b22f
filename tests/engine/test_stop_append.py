"""StopChecker.append (a run of accepted tokens at once) stops exactly where appending them one at a time and calling
check() after each would: the same tokens, logprobs, finish reason, for EOS, stop ids, max_new_tokens and the context
length, with and without ignore_eos."""

from __future__ import annotations

import copy
import random

from hyperdraft import SamplingParams
from hyperdraft.engine.stop import StopChecker
from hyperdraft.request import Request


def _one_by_one(stop: StopChecker, req: Request, tokens, logprobs):
    for i, tok in enumerate(tokens):
        req.output_ids.append(tok)
        if req.params.return_logprob:
            req.output_logprobs.append(logprobs[i])
        reason = stop.check(req)
        if reason is not None:
            return tokens[: i + 1], reason
    return list(tokens), None


def test_append_equals_check_after_each_token():
    rng = random.Random(0)
    seen = set()
    for case in range(3000):
        vocab = rng.choice([3, 6, 20])
        stop = StopChecker(None, tuple(rng.sample(range(vocab), rng.randint(0, 2))), context_len=rng.randint(8, 30))
        params = SamplingParams(max_new_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(vocab), rng.randint(0, 2)) or None,
                                return_logprob=rng.random() < 0.5)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
        req = Request("r", prompt, params, 0, output_ids=[rng.randrange(vocab) for _ in range(rng.randint(0, 4))])
        if len(req.output_ids) >= params.max_new_tokens or req.seq_len >= stop.context_len:
            continue  # a finished request is never appended to
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 7))]
        logprobs = [-rng.random() for _ in tokens]
        ref = copy.deepcopy(req)
        expect = _one_by_one(stop, ref, tokens, logprobs)
        got = stop.append(req, tokens, logprobs)
        assert got == expect, (case, tokens, params, req)
        assert req.output_ids == ref.output_ids and req.output_logprobs == ref.output_logprobs
        seen.add(expect[1])
    assert seen == {None, "stop", "length"}
