"""--speculative-token-map (FR-Spec): a full-vocabulary head (MTP, EAGLE-1) drafts only from a map's hot tokens.

Spec on equals spec off with a map (greedy, fp32; chains and trees); the map is really applied (a perfect drafter
accepts everything with a full map and never drafts a token left out of it); sampled MTP with a map keeps the
target's distribution; bad maps and algorithms that cannot take one are clear start-up errors."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.config import EngineArgs
from hyperdraft.models.mtp import MtpHead
from hyperdraft.speculative.config import resolve_spec_config
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import hybrid_models  # noqa: F401
from helpers.spec_fixtures import (VOCAB, _single_torch_thread, assert_same_position_distributions, gen, greedy,  # noqa: F401
                                   llm_factory, mixed_prompts, spec_state)
from tests.speculative.test_mtp import _bigram_with_passthrough_mtp

NEW_TOKENS = [18, 7, 25, 12, 3, 20, 9]


def _write_map(path, ids, fmt: str = "pt") -> str:
    path = str(path) + "." + fmt
    if fmt == "pt":
        torch.save(list(ids), path)
    else:
        with open(path, "w") as f:
            json.dump(list(ids), f)
    return path


def _half_vocab(vocab: int, seed: int) -> list[int]:
    return sorted(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: vocab // 2].tolist())


@pytest.mark.parametrize("extra", [
    dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
    dict(speculative_algorithm="MTP", speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6),
], ids=["MTP-chain", "MTP-tree"])
@pytest.mark.parametrize("fmt", ["pt", "json"])
def test_mtp_with_a_token_map_equals_spec_off(hybrid_models, llm_factory, tmp_path, extra, fmt):
    prompts = mixed_prompts(len(NEW_TOKENS), seed=41, max_len=40)
    params = [greedy(n) for n in NEW_TOKENS]
    ref = [o.token_ids for o in gen(llm_factory(hybrid_models["with_mtp"], max_running_requests=8), prompts, params)]
    token_map = _write_map(tmp_path / "map", _half_vocab(VOCAB, seed=1), fmt)
    llm = llm_factory(hybrid_models["with_mtp"], max_running_requests=8, page_size=4, speculative_token_map=token_map,
                      **extra)
    head = llm.engine.worker.proposer.head
    assert isinstance(head, MtpHead) and head.vocab_map is not None and head.vocab_map.draft_to_target.numel() == VOCAB // 2
    assert [o.token_ids for o in gen(llm, prompts, params)] == ref
    assert spec_state(llm)["spec_draft_tokens"] > 0


def test_eagle_head_with_a_token_map_equals_spec_off(llm_factory, tmp_path):
    target = make_tiny_model(str(tmp_path / "target"), "llama", num_hidden_layers=4)
    head = write_random_eagle_checkpoint(str(tmp_path / "e1"), target, kind="eagle")
    prompts = mixed_prompts(6, seed=5, max_len=50)
    params = [greedy(10 + 3 * i) for i in range(6)]
    ref = [o.token_ids for o in gen(llm_factory(target), prompts, params)]
    token_map = _write_map(tmp_path / "map", _half_vocab(VOCAB, seed=2))
    for shape in (dict(speculative_num_steps=3, speculative_eagle_topk=1),
                  dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)):
        llm = llm_factory(target, speculative_algorithm="EAGLE", speculative_draft_model_path=head,
                          speculative_token_map=token_map, **shape)
        assert llm.engine.worker.proposer.head.vocab_map is not None
        assert [o.token_ids for o in gen(llm, prompts, params)] == ref


def test_an_eagle3_head_ignores_a_token_map_as_sglang_does(llm_factory, tmp_path, caplog):
    """SGLang warns that an EAGLE3 head already has a draft vocabulary and goes on without the map; refusing the
    pair (as hyperdraft did) broke command lines that run on SGLang."""
    target = make_tiny_model(str(tmp_path / "target"), "llama", num_hidden_layers=4)
    head = write_random_eagle_checkpoint(str(tmp_path / "e3"), target, kind="eagle3", draft_vocab_size=VOCAB // 2)
    prompts, params = mixed_prompts(4, seed=7, max_len=40), [greedy(12)] * 4
    ref = [o.token_ids for o in gen(llm_factory(target), prompts, params)]
    token_map = _write_map(tmp_path / "map", range(10))
    with caplog.at_level("WARNING"):
        llm = llm_factory(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                          speculative_token_map=token_map, speculative_num_steps=3)
    assert "speculative_token_map" in caplog.text and "ignored" in caplog.text
    assert llm.engine.spec.token_map is None
    assert [o.token_ids for o in gen(llm, prompts, params)] == ref


def test_the_map_decides_which_tokens_are_drafted(llm_factory, tmp_path):
    """A pass-through MTP drafts a bigram target perfectly. With a map of every token it still does, and a tree
    accepts exactly what it accepts without a map (the same rows in the same order), so the copied lm_head rows and
    the id maps are right; with the target's output tokens left out of the map, none of them can be drafted, so
    nothing is accepted, and the output stays the target's."""
    path = _bigram_with_passthrough_mtp(str(tmp_path))
    prompts = mixed_prompts(4, seed=6, max_len=20)
    params = [greedy(24)] * 4
    ref = [o.token_ids for o in gen(llm_factory(path, max_running_requests=8), prompts, params)]
    full = _write_map(tmp_path / "full", range(VOCAB))
    emitted = {t for out in ref for t in out}
    without = _write_map(tmp_path / "without", sorted(set(range(VOCAB)) - emitted))
    states = {}
    for name, token_map in (("full", full), ("without", without)):
        llm = llm_factory(path, speculative_algorithm="NEXTN", speculative_num_steps=4, max_running_requests=8,
                          speculative_token_map=token_map)
        assert [o.token_ids for o in gen(llm, prompts, params)] == ref
        states[name] = spec_state(llm)
    assert states["full"]["spec_acceptance_rate"] > 0.95, states["full"]
    assert states["without"]["spec_accepted_tokens"] == 0 < states["without"]["spec_draft_tokens"], states["without"]
    tree = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2,
                speculative_num_draft_tokens=5, max_running_requests=8)
    accepted = []
    for token_map in (None, full):
        llm = llm_factory(path, speculative_token_map=token_map, **tree)
        assert [o.token_ids for o in gen(llm, prompts, params)] == ref
        accepted.append(spec_state(llm)["spec_accepted_tokens"])
    assert accepted[0] == accepted[1] > 0, accepted


# A 12-token target continues one prompt by 4 tokens 3000 times, spec off (seeds 0..2999) and with sampled MTP
# drafting from a 6-token map (seeds 10^6 + i: independent samples); per position a two-sample chi-square test at
# 1e-6 / 4 (Bonferroni): each test's false-failure probability is at most 1e-6, and the seeds are fixed.
SV_VOCAB, N_REQ, STEPS_OUT, ALPHA = 12, 3000, 4, 1e-6
PROMPT = [5, 2, 9, 0, 11, 3, 7, 4]


def test_sampled_mtp_with_a_token_map_keeps_the_target_distribution(llm_factory, tmp_path):
    from helpers.hybrid_fixtures import with_mtp_weights

    target = make_tiny_model(str(tmp_path / "t"), "qwen3_5", seed=9, vocab_size=SV_VOCAB, eos_token_id=None,
                             with_tokenizer=False)
    path = with_mtp_weights(target, str(tmp_path / "m"), seed=10)
    token_map = _write_map(tmp_path / "map", [0, 2, 3, 5, 8, 11])
    base = dict(skip_tokenizer_init=True, max_running_requests=256)

    def sample(llm, offset):
        params = [SamplingParams(temperature=1.0, max_new_tokens=STEPS_OUT, ignore_eos=True, seed=offset + i)
                  for i in range(N_REQ)]
        return np.array([o.token_ids for o in gen(llm, [PROMPT] * N_REQ, params)])

    ref = sample(llm_factory(path, **base), 0)
    llm = llm_factory(path, speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_token_map=token_map,
                      speculative_use_rejection_sampling=True, **base)
    got = sample(llm, 10**6)
    state = spec_state(llm)
    assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state
    assert_same_position_distributions(ref, got, SV_VOCAB, ALPHA)


@pytest.mark.parametrize("ids,match", [
    ([1, 2, 2], "more than once"),
    ([0, VOCAB], r"must lie in \[0, vocab_size=384\)"),
    ([-1, 3], r"must lie in \[0, vocab_size=384\)"),
    ([], "non-empty 1-D list of integer token ids"),
    ([[1, 2], [3, 4]], "non-empty 1-D list of integer token ids"),
    ([0.5, 1.5], "non-empty 1-D list of integer token ids"),
])
def test_a_bad_token_map_is_a_clear_error(hybrid_models, tmp_path, ids, match):
    token_map = _write_map(tmp_path / "bad", ids, "json")
    with pytest.raises(ValueError, match="speculative_token_map.*" + match):
        LLM(hybrid_models["with_mtp"], device="cpu", speculative_algorithm="NEXTN", speculative_token_map=token_map)


def test_token_map_errors_name_the_field(hybrid_models, tmp_path):
    with pytest.raises(ValueError, match="speculative_token_map.*no such file"):
        LLM(hybrid_models["with_mtp"], device="cpu", speculative_algorithm="NEXTN",
            speculative_token_map=str(tmp_path / "missing.pt"))
    token_map = _write_map(tmp_path / "ok", range(10))
    with pytest.raises(ValueError, match="speculative_token_map is for EAGLE, NEXTN and MTP.*STANDALONE"):
        resolve_spec_config(EngineArgs(speculative_algorithm="STANDALONE", speculative_draft_model_path="/x",
                                       speculative_token_map=token_map))


def test_ngram_ignores_a_token_map(tmp_path, caplog):
    """SGLang's NGRAM worker never reads the map: a warning, not a refusal."""
    token_map = _write_map(tmp_path / "ok", range(10))
    with caplog.at_level(logging.WARNING, logger="hyperdraft"):
        spec = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_token_map=token_map))
    assert spec.token_map is None and "speculative_token_map=" in caplog.text and "is ignored" in caplog.text
