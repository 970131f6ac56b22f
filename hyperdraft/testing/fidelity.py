"""Fidelity runs shared by tests/gpu/test_deterministic_engine.py and benchmarks/e2e/fidelity.py: one target decoded
by plain decoding and by each drafter, batched or one request at a time, in the default or the deterministic mode,
and the outputs compared with a reference token for token."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from hyperdraft.llm import LLM
from hyperdraft.models.config import load_model_config
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint

SELF = "<self>"  # a STANDALONE draft that is the target itself
CONFIGS = {  # row name -> EngineArgs fields over plain decoding
    "plain batched": {},
    "plain eager": dict(disable_cuda_graph=True),
    "plain, 32-token prefill chunks": dict(chunked_prefill_size=32),
    "NGRAM chain 4": dict(speculative_algorithm="NGRAM", speculative_num_steps=4, speculative_num_draft_tokens=5),
    "NGRAM trie tree BFS/12": dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="BFS"),
    "NGRAM trie tree PROB/12": dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="PROB"),
    "self-draft chain 5": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=SELF,
                               speculative_num_steps=5, speculative_eagle_topk=1, speculative_num_draft_tokens=6),
    "self-draft tree 3x4/8": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=SELF,
                                  speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
    "self-draft adaptive": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=SELF,
                                speculative_adaptive=True),
    "EAGLE3 chain 3": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                           speculative_num_draft_tokens=4),
    "EAGLE3 tree 3x4/8": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=4,
                              speculative_num_draft_tokens=8),
    "EAGLE chain 3": dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=1,
                          speculative_num_draft_tokens=4),
}


@dataclass(frozen=True)
class Subject:
    target: str
    prompts: dict  # {"prompts": [...]} or {"input_ids": [...]}: LLM.generate's keyword
    heads: dict[str, str] = field(default_factory=dict)  # algorithm -> random head directory

    @property
    def count(self) -> int:
        return len(next(iter(self.prompts.values())))


@dataclass(frozen=True)
class Run:
    outputs: list[list[int]]
    state: dict  # the engine's internal_state after the run
    pool_free: bool  # every KV page back in the pool once the prefix cache is flushed


def random_heads(target: str, root: str) -> dict[str, str]:
    """Random EAGLE-3 and EAGLE heads shaped for the target (acceptance is not the point: losslessness is)."""
    src = head_config_source(target, root)
    with open(os.path.join(src, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]  # a tiny target's vocabulary may be smaller than the draft's 2048
    return {"EAGLE3": write_random_eagle_checkpoint(os.path.join(root, "eagle3"), src, kind="eagle3",
                                                    draft_vocab_size=min(2048, vocab)),
            "EAGLE": write_random_eagle_checkpoint(os.path.join(root, "eagle"), src, kind="eagle")}


def head_config_source(target: str, root: str) -> str:
    """A directory with the config.json an EAGLE head is shaped from (a GGUF target has none of its own)."""
    if os.path.isdir(target):
        return target
    cfg = load_model_config(target)
    src = os.path.join(root, "target_config")
    os.makedirs(src, exist_ok=True)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                   "vocab_size": cfg.vocab_size, "num_attention_heads": cfg.num_heads,
                   "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                   "num_hidden_layers": cfg.num_layers, "rms_norm_eps": cfg.rms_norm_eps,
                   "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings}, f)
    return src


def generate(subject: Subject, deterministic: bool, config: dict, sampling: list[SamplingParams],
             batched: bool = True, **engine) -> Run:
    """The subject's prompts through an engine of `config`; batched: all submitted at once, else one at a time."""
    kw = {**engine, **config}
    if kw.get("speculative_draft_model_path") == SELF:
        kw["speculative_draft_model_path"] = subject.target
    elif kw.get("speculative_algorithm") in subject.heads:
        kw["speculative_draft_model_path"] = subject.heads[kw["speculative_algorithm"]]
    llm = LLM(subject.target, enable_deterministic_inference=deterministic, **kw)
    (key, items), = subject.prompts.items()
    if batched:
        outs = [o.token_ids for o in llm.generate(**{key: items}, sampling_params=sampling, use_tqdm=False)]
    else:
        outs = [llm.generate(**{key: [item]}, sampling_params=[sp], use_tqdm=False)[0].token_ids
                for item, sp in zip(items, sampling)]
    state = llm.engine.internal_state()
    pool_free = llm.engine.flush_cache() and llm.engine.kv_free_slots == llm.engine.kv_capacity_slots
    llm.shutdown()
    return Run(outs, state, pool_free)


def compare(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """{identical, total, first_differing_positions (one per differing output)}."""
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), min(len(r), len(o)))
              for r, o in zip(reference, outputs) if r != o]
    return {"identical": sum(r == o for r, o in zip(reference, outputs)), "total": len(reference),
            "first_differing_positions": firsts}
