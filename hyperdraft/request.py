"""Request: one generation's state as the scheduler sees it.

The request's sequence is prompt_ids + output_ids. num_computed counts the
leading tokens whose K/V sit in the cache. Every step feeds the next
uncomputed tokens; a step that reaches the end of the sequence samples. So
prefill, chunked prefill, decode and recompute-after-retraction are all the
same move, and retraction just resets num_computed to 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hyperdraft.sampling_params import SamplingParams


def first_invalid_token(ids: list, vocab_size: int):
    """The first entry of ids that is not a token id in [0, vocab_size), or None when all are."""
    # a bool is an int to Python, but True is no token id
    return next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size), None)


def check_prompt(ids: list, vocab_size: int, context_len: int, capacity_slots: int) -> None:
    """Raise ValueError, naming the field, for a prompt no engine of these sizes can serve."""
    if len(ids) == 0:
        raise ValueError("prompt is empty: input_ids/prompt must contain at least one token")
    if first_invalid_token(ids, vocab_size) is not None:
        raise ValueError(f"input_ids must be integers in [0, {vocab_size})")
    if len(ids) >= context_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the context length is {context_len}, "
                         "so the prompt must be shorter than context_length")
    if len(ids) + 1 > capacity_slots:
        raise ValueError(f"prompt has {len(ids)} tokens, more than the K/V cache's {capacity_slots} "
                         "(max_total_tokens or mem_fraction_static, less any recurrent state) can hold")


def same_requests(a: list["Request"], b: list["Request"]) -> bool:
    """The same request objects in the same order (a batch that did not change between two steps)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_computed: int = 0
    draft_num_computed: int = 0  # tokens with K/V in the draft model's pool (STANDALONE)
    row: int | None = None  # page-table row while running
    cache_node: object | None = None  # the prefix-cache node this request holds locked (kvcache/prefix_cache.py)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    prefill_cut: int = 0  # hybrid models: a prefill chunk ends here, where the prefix cache wants a state snapshot
    finish_reason: str | None = None
    stop_str_hit: str | None = None
    # the engine's incremental text of the output, for stop strings (engine/stop.py: a detokenizer.IncrementalDetokenizer)
    stop_text: object | None = field(default=None, repr=False, compare=False)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_retractions: int = 0
    spec_verify_ct: int = 0  # verify forwards this request took part in
    spec_draft_tokens: int = 0  # draft tokens proposed for this request
    spec_accepted_tokens: int = 0  # draft tokens accepted

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.seq_len - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Only the newest token lacks K/V: the next step is a decode (or a speculative verify)."""
        return self.num_computed > 0 and self.num_uncomputed == 1

    def text_ids(self, new_ids: list[int]) -> list[int]:
        """The ids of the newest output tokens whose text the user gets: as SGLang, a request ended by a stop token
        (EOS or a stop id) shows no text for it, unless no_stop_trim; the token itself stays in the output."""
        if self.finished and self.finish_reason == "stop" and self.stop_str_hit is None and new_ids \
                and not self.params.no_stop_trim:
            return new_ids[:-1]
        return new_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def last_tokens(self, k: int) -> list[int]:
        return self.token_ids(max(0, self.seq_len - k), self.seq_len)
