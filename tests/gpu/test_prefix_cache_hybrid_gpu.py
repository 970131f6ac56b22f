"""Prefix caching on a hybrid (Qwen3.5) model on CUDA: the Triton state backend, CUDA graphs and decode-ahead (a
request's state may sit in scratch when it is cached) with state snapshots, fp32 greedy, cache on equals cache off
and the hits are real. Not part of CI: `python3 -m pytest tests/gpu/test_prefix_cache_hybrid_gpu.py -q`."""

from __future__ import annotations

import random

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import with_mtp_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
VOCAB = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("hybrid_cache")
    path = make_tiny_model(str(root / "t"), "qwen3_5", seed=0, vocab_size=VOCAB, with_tokenizer=False, eos_token_id=None)
    with_mtp_weights(path, str(root / "t_mtp"))
    return path


def _run(llm: LLM, prompts: list[list[int]], new: int) -> list[tuple[list[int], int]]:
    params = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
    return [(o.token_ids, o.meta_info["cached_tokens"])
            for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]


def _conversation(llm: LLM) -> list[tuple[list[int], int]]:
    rng = random.Random(1)
    firsts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(30, 90))] for _ in range(4)]
    turn1 = _run(llm, firsts, 20)
    seconds = [p + ids + [rng.randrange(VOCAB) for _ in range(7)] for p, (ids, _) in zip(firsts, turn1)]
    system = [rng.randrange(VOCAB) for _ in range(70)]
    burst = [system + [rng.randrange(VOCAB) for _ in range(6)] for _ in range(6)]
    return turn1 + _run(llm, seconds, 16) + _run(llm, burst, 8)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="NGRAM", speculative_num_steps=3),
                                  dict(speculative_algorithm="MTP", speculative_num_steps=3)], ids=["plain", "ngram", "mtp"])
def test_cache_on_equals_cache_off_with_graphs(target, page_size, spec):
    path = target + "_mtp" if spec.get("speculative_algorithm") == "MTP" else target
    base = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, page_size=page_size, max_running_requests=8,
                max_total_tokens=8192, **spec)
    off = _conversation(LLM(path, disable_radix_cache=True, **base))
    llm = LLM(path, **base)
    on = _conversation(llm)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_replays > 0
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    cached = [c for _, c in on]
    assert all(c == 0 for _, c in off) and sum(cached[4:8]) > 0 and min(cached[-4:]) >= 70 - page_size + 1
    head = spec.get("speculative_algorithm") == "MTP"
    if page_size == 1 and not head:
        assert all(c >= 30 + 19 for c in cached[4:8])  # turn 2 starts after turn 1's prompt and answer
    elif page_size == 1:  # a round's accepted drafts leave the head behind by more than one token: the snapshot at
        assert all(c >= 30 for c in cached[4:8])  # turn 1's prompt end is what a head drafter can count on
    assert llm.engine.flush_cache() and llm.engine.prefix_cache.snapshots.num_free == llm.engine.max_rows
