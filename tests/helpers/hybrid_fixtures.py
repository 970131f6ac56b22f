"""Tiny random Qwen3.5 hybrid checkpoints (3 Gated DeltaNet layers, then gated full attention; every parameter
noised) and the proposers the hybrid tests drive speculation with."""

from __future__ import annotations

import random

import pytest
import torch

from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.proposer import Proposer, ProposerCapabilities
from hyperdraft.testing.tiny import make_tiny_model

_MODELS: dict[str, str] = {}


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory) -> dict[str, str]:
    if not _MODELS:
        root = tmp_path_factory.mktemp("hybrid")
        _MODELS.update(target=make_tiny_model(str(root / "target"), "qwen3_5", seed=0),
                       target8=make_tiny_model(str(root / "target8"), "qwen3_5", seed=1, num_hidden_layers=8),
                       dense_draft=make_tiny_model(str(root / "dense"), "qwen3", seed=2, with_tokenizer=False))
    return dict(_MODELS)


class Oracle:
    """The continuation each prompt must get (spec-off greedy outputs), keyed by prompt; the oracle proposers draft
    it, cut at a seeded random depth after which they draft wrong tokens, so every accept length occurs."""

    reference: dict[tuple[int, ...], list[int]] = {}
    rng = random.Random(0)
    phases: list[tuple[int, str]] = []  # (drafts, "right" | "wrong"): the first drafts all right, then all wrong, ...

    @classmethod
    def reset(cls, reference: dict, seed: int, phases: list[tuple[int, str]] = ()) -> None:
        cls.reference, cls.rng, cls.phases = reference, random.Random(seed), list(phases)

    @classmethod
    def truth(cls, req, depth: int, vocab: int) -> list[int]:
        ref = cls.reference[tuple(req.prompt_ids)]
        done = len(req.output_ids)
        true = (ref[done:] + [0] * depth)[:depth]
        cut = cls.rng.randint(0, depth)
        if cls.phases:
            count, kind = cls.phases[0]
            cut = depth if kind == "right" else 0
            cls.phases[0] = (count - 1, kind)
            if count <= 1:
                cls.phases.pop(0)
        return true[:cut] + [(t + 1) % vocab for t in true[cut:]]


class OracleChain(Proposer):
    def __init__(self, ctx, draft):
        self.capabilities, self.pool, self.device = ProposerCapabilities(), None, ctx.target.device
        self.vocab = ctx.target.config.vocab_size

    def propose(self, reqs, tier, sampling) -> Proposal:
        drafts = [Oracle.truth(r, tier.steps, self.vocab) for r in reqs]
        return Proposal(torch.tensor(drafts, dtype=torch.int64, device=self.device).view(len(reqs), tier.steps),
                        [tier.steps] * len(reqs))


class OracleTree(OracleChain):
    """A tree of topk = 2: at each depth the node on the drafted path and a decoy sibling, in a random order, so the
    accepted path is not always the first child. Nodes are numbered in depth order (parents before children)."""

    def propose(self, reqs, tier, sampling) -> TreeProposal:
        n = tier.num_draft_tokens
        tokens, parents = [], []
        for r in reqs:
            path = Oracle.truth(r, tier.steps, self.vocab)
            last = r.output_ids[-1] if r.output_ids else r.prompt_ids[-1]
            toks, pars, parent = [last], [-1], 0
            for token in path:
                pair = [token, (token + 7) % self.vocab]
                if Oracle.rng.random() < 0.5:
                    pair.reverse()
                for t in pair:
                    toks.append(t)
                    pars.append(parent)
                parent = len(toks) - 2 + pair.index(token)
            tokens.append((toks + [0] * n)[:n])
            pars = (pars + [-1] * n)[:n]
            parents.append([p if p < n else -1 for p in pars])
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return TreeProposal(as_tensor(tokens), as_tensor(parents), torch.full((len(reqs), n), -1, device=self.device))
