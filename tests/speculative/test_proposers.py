"""The proposer contract: every algorithm name has one registered Proposer class whose capabilities say what the
worker may ask of it, and a new drafter is one class plus one registry line."""

from __future__ import annotations

import torch

from hyperdraft.config import SPECULATIVE_ALGORITHMS, EngineArgs, fields
from hyperdraft.models.eagle import target_capture_layers
from hyperdraft.options import RuntimeOptions
from hyperdraft.speculative.proposal import Proposal
from hyperdraft.speculative.proposer import Proposer, ProposerCapabilities
from hyperdraft.speculative.proposers import PROPOSERS
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.spec_fixtures import (_single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_models,  # noqa: F401
                                   spec_state)


def test_every_algorithm_has_one_proposer_class():
    assert set(PROPOSERS) == set(SPECULATIVE_ALGORITHMS)
    assert all(Proposer in cls.__mro__ for cls in PROPOSERS.values())  # explicit subclasses: the defaults apply


def test_help_texts_come_from_the_supported_sets():
    help_of = {f.name: f.metadata["help"] for f in fields(EngineArgs)}
    assert all(name in help_of["speculative_algorithm"] for name in SPECULATIVE_ALGORITHMS)
    assert "not yet supported" not in help_of["speculative_algorithm"]
    tree_algorithms = [n for n, t in SPECULATIVE_ALGORITHMS.items() if t.trees]
    assert all(name in help_of["speculative_eagle_topk"] for name in tree_algorithms)
    assert "only 1" not in help_of["speculative_eagle_topk"]


def test_capabilities_of_each_drafter(spec_models, llm_factory, tmp_path):
    target6 = make_tiny_model(str(tmp_path / "t6"), "llama", num_hidden_layers=6)
    eagle3 = write_random_eagle_checkpoint(str(tmp_path / "e3"), target6, kind="eagle3")
    ngram = llm_factory(spec_models["target"], speculative_algorithm="NGRAM").engine.worker.proposer
    assert ngram.capabilities == ProposerCapabilities(idle_at_step_zero=True, may_draft_nothing=True)
    assert ngram.pool is None
    draft = llm_factory(spec_models["target"], speculative_algorithm="STANDALONE",
                        speculative_draft_model_path=spec_models["draft_small"]).engine.worker.proposer
    assert draft.capabilities == ProposerCapabilities(compacts_draft_pool=True, runs_as_graph=True,
                                                      idle_at_step_zero=True)
    assert draft.pool is draft.runner.pool and draft.draft_loop is None  # no graphs: no whole-round graphs
    head = llm_factory(target6, speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3).engine.worker.proposer
    assert head.capabilities == ProposerCapabilities(target_capture_layers(head.head), feeds_hidden=True,
                                                     runs_as_graph=True)
    assert len(head.capabilities.capture_layers) == 3
    with_graphs = llm_factory(target6, speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3,
                              runtime_options=RuntimeOptions(emulate_cuda_graphs=True), cuda_graph_max_bs=4)
    assert with_graphs.engine.worker.proposer.capabilities.drafts_ahead  # whole-round graphs exist: it drafts ahead
    no_ahead = llm_factory(target6, speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3,
                           runtime_options=RuntimeOptions(emulate_cuda_graphs=True, draft_ahead=False), cuda_graph_max_bs=4)
    assert not no_ahead.engine.worker.proposer.capabilities.drafts_ahead


class RepeatLastToken(Proposer):
    """A drafter in a dozen lines: it guesses that the last token repeats. Only propose() is its own."""

    def __init__(self, ctx, draft):
        self.capabilities, self.pool, self.device = ProposerCapabilities(), None, ctx.target.device
        self.calls = 0

    def propose(self, reqs, tier, sampling) -> Proposal:
        self.calls += 1
        last = torch.tensor([(r.output_ids or r.prompt_ids)[-1] for r in reqs], device=self.device)
        return Proposal(last[:, None].repeat(1, tier.steps), [tier.steps] * len(reqs))


def test_a_new_drafter_is_one_class_and_one_registry_line(spec_models, llm_factory, monkeypatch):
    monkeypatch.setitem(PROPOSERS, "NGRAM", RepeatLastToken)  # registered under a name the options accept
    prompts = [[5] * 12, [7, 8] * 6] + mixed_prompts(4, seed=17, max_len=30)
    params = [greedy(10)] * len(prompts)
    ref = gen(llm_factory(spec_models["target"]), prompts, params)
    llm = llm_factory(spec_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=3)
    outs = gen(llm, prompts, params)
    assert isinstance(llm.engine.worker.proposer, RepeatLastToken) and llm.engine.worker.proposer.calls > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert spec_state(llm)["spec_draft_tokens"] > 0
