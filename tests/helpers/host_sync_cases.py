"""The engine configurations the host-sync tests run (tests/test_host_sync.py on CPU, tests/gpu/test_host_sync.py
on a GPU): one table and one set of tiny checkpoints, so both count transfers over the same shapes."""

from __future__ import annotations

import json

from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model

CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
CASES = {  # "draft" names a checkpoint of write_models
    "plain": {},
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", draft="eagle3", **CHAIN),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", draft="eagle3", **TREE),
    "eagle3-tree-sampled": dict(speculative_algorithm="EAGLE3", draft="eagle3", speculative_use_rejection_sampling=True,
                                **TREE),
    "standalone-chain-sampled": dict(speculative_algorithm="STANDALONE", draft="draft",
                                     speculative_use_rejection_sampling=True, **CHAIN),
    "standalone-tree": dict(speculative_algorithm="STANDALONE", draft="draft", **TREE),
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4),
    "ngram-trie-tree": dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="BFS",
                            speculative_ngram_max_bfs_breadth=3, speculative_num_draft_tokens=6),
    "eagle3-chain-simulated": dict(speculative_algorithm="EAGLE3", draft="eagle3", speculative_simulate_accept_rate=0.7,
                                   **CHAIN),
    # adaptive tiers of step 0 only: rounds that draft nothing, each queuing the next verify where graphs run
    "eagle3-step-zero": dict(speculative_algorithm="EAGLE3", draft="eagle3", speculative_adaptive=True,
                             adaptive_config="zero_only", speculative_num_steps=0),
}
PARAMS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01),
    "penalties": dict(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
}


def write_models(root: str) -> dict[str, str]:
    """A 3-layer target, an EAGLE-3 head for it, a smaller STANDALONE draft (other hidden size and heads), and an
    adaptive config of step 0 only."""
    target = make_tiny_model(f"{root}/target", "llama", num_hidden_layers=3)
    with open(f"{root}/zero_only.json", "w") as f:
        json.dump({"1": {"candidate_steps": [0]}}, f)
    return {"target": target, "zero_only": f"{root}/zero_only.json", "eagle3": write_random_eagle_checkpoint(f"{root}/e3", target, kind="eagle3"),
            "draft": make_tiny_model(f"{root}/draft", "qwen3", seed=2, with_tokenizer=False, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16)}


def engine_args(models: dict[str, str], case: str) -> dict:
    """CASES[case] as LLM keyword arguments (the draft name resolved to its checkpoint path)."""
    args = dict(CASES[case])
    if "draft" in args:
        args["speculative_draft_model_path"] = models[args.pop("draft")]
    if "adaptive_config" in args:
        args["speculative_adaptive_config"] = models[args.pop("adaptive_config")]
    return args
