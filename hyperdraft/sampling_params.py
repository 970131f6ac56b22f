"""SamplingParams with SGLang's field names; validate() names the offending field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

# Temperatures this small would scale logits past float32's range (inf - inf = NaN in the softmax); like vLLM,
# they mean greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5
REPETITION_PENALTY_RANGE = (0.01, 2.0)  # SGLang's upper bound; the lower one keeps logits / penalty finite
# Every accepted token of a request with stop strings looks for each of them in the text's tail, on the engine's
# path and the server's event loop, so their count and length bound a step's cost for everyone in it: one request
# with 110,000 stop strings held a server's event loop for 45 s. OpenAI allows 4; these leave room for real use.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    return_logprob: bool = False
    skip_special_tokens: bool = True
    # SGLang's: keep the matched stop string, or the stop token's text (EOS, a stop id), at the end of the text
    no_stop_trim: bool = False
    max_tokens: int | None = field(default=None, repr=False)  # OpenAI/vLLM alias of max_new_tokens

    def __post_init__(self):
        if self.max_tokens is not None:
            self.max_new_tokens = self.max_tokens
            self.max_tokens = None
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @classmethod
    def from_dict(cls, values: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int | None = None) -> None:
        def check(ok: bool, name: str, allowed: str):
            if not ok:
                got = repr(getattr(self, name))
                raise ValueError(f"{name} must be {allowed}, got {got if len(got) <= 80 else got[:80] + '...'}")

        check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", "an integer >= 1")
        check(_is_num(self.temperature) and self.temperature >= 0, "temperature",
              f"a finite number >= 0 (below {GREEDY_BELOW_TEMPERATURE} means greedy)")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        # seed and top_k become int64 tensors inside a step: a larger value would fail the whole batch there
        check(_is_int(self.top_k) and (self.top_k == -1 or 0 <= self.top_k < 2**63), "top_k",
              "-1 (disabled) or an integer in [0, 2**63)")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        check(_is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]")
        check(_is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]")
        # Bounded so that logits / penalty stays finite in float32 (a penalty of 5e-324 made every logit inf).
        check(_is_num(self.repetition_penalty) and REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty
              <= REPETITION_PENALTY_RANGE[1], "repetition_penalty", "in [%g, %g]" % REPETITION_PENALTY_RANGE)
        check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63), "seed",
              "an integer in [-2**63, 2**63) or None")
        check(self.stop is None or (isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS and all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)), "stop",
              f"a non-empty string or a list of at most {MAX_STOP_STRINGS} of them, each at most "
              f"{MAX_STOP_STRING_CHARS} characters")
        ids_ok = self.stop_token_ids is None or (isinstance(self.stop_token_ids, (list, tuple)) and len(
            self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
            _is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size) for t in self.stop_token_ids))
        check(ids_ok, "stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} token ids "
              + (f"in [0, {vocab_size})" if vocab_size else ">= 0"))
        for name in ("ignore_eos", "return_logprob", "skip_special_tokens", "no_stop_trim"):
            check(isinstance(getattr(self, name), bool), name, "true or false")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
