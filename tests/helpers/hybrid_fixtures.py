"""Tiny random Qwen3.5 hybrid checkpoints (3 Gated DeltaNet layers, then gated full attention; every parameter
noised) and the proposers the hybrid tests drive speculation with. A random MTP module (with_mtp) almost never has a
draft accepted; a near-bigram target with a pass-through one (near_bigram_with_mtp: accepting_mtp,
next_accepting_mtp) has drafts accepted often but not always, so the accepted path of a hybrid target is exercised."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.proposer import Proposer, ProposerCapabilities
from hyperdraft.testing.tiny import make_tiny_model

_MODELS: dict[str, str] = {}


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory) -> dict[str, str]:
    if not _MODELS:
        root = tmp_path_factory.mktemp("hybrid")
        target = make_tiny_model(str(root / "target"), "qwen3_5", seed=0)
        _MODELS.update(target=target,
                       target8=make_tiny_model(str(root / "target8"), "qwen3_5", seed=1, num_hidden_layers=8),
                       dense_draft=make_tiny_model(str(root / "dense"), "qwen3", seed=2, with_tokenizer=False),
                       with_mtp=with_mtp_weights(target, str(root / "with_mtp")))
        nxt = make_tiny_model(str(root / "next"), "qwen3_next", seed=5)
        _MODELS.update(next=nxt, next_with_mtp=with_mtp_weights(nxt, str(root / "next_with_mtp")),
                       accepting_mtp=near_bigram_with_mtp("qwen3_5", str(root)),
                       next_accepting_mtp=near_bigram_with_mtp("qwen3_next", str(root)))
    return dict(_MODELS)


def with_mtp_weights(src: str, dst: str, seed: int = 4) -> str:
    """A copy of a Qwen3.5 or Qwen3-Next checkpoint (layer 3 full attention) with an MTP module under the official names (mtp.fc, mtp.pre_fc_norm_*,
    mtp.layers.0.*, mtp.norm), random like the rest: transformers ignores them; only hyperdraft's MTP head reads them."""
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(dst, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    layer = [n for n in weights if n.startswith("model.layers.3.")]  # the full-attention layer's names and shapes
    hidden = weights["model.norm.weight"].shape[0]
    extra = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=gen) * 0.2}
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        extra[name] = torch.randn(hidden, generator=gen) * 0.1
    for name in layer:
        extra["mtp.layers.0." + name[len("model.layers.3."):]] = torch.randn(weights[name].shape, generator=gen) * 0.2
    save_file({**weights, **extra}, os.path.join(dst, "model.safetensors"))
    return dst


def near_bigram_with_mtp(kind: str, root: str, mix: float = 0.02, **overrides) -> str:
    """A hybrid checkpoint (written under root, named by kind) whose layers' outputs are scaled by `mix` (the next
    token depends mostly on the current one, a little on the context: linear and full attention still matter), with
    a pass-through MTP module that predicts the bigram part: drafts agree often but not always, so accepted paths of
    several nodes, and rejections at every depth, occur. (test_mtp's bigram has mix 0: its layers' states could be
    wrong without showing.) overrides go to make_tiny_model (e.g. vocab_size, eos_token_id)."""
    path = make_tiny_model(os.path.join(root, f"{kind}_t"), kind, seed=7, **overrides)
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * mix
    save_file(weights, os.path.join(path, "model.safetensors"))
    mtp = with_mtp_weights(path, os.path.join(root, f"{kind}_mtp"))
    weights = load_file(os.path.join(mtp, "model.safetensors"))
    hidden = weights["model.norm.weight"].shape[0]
    weights["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    weights["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)  # (1 + 0): plain RMS normalisation
    weights["mtp.norm.weight"] = weights["model.norm.weight"].clone()
    for name in weights:
        if name.startswith("mtp.layers.0.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, os.path.join(mtp, "model.safetensors"))
    return mtp


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
