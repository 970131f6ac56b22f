"""At most one device-to-host transfer per engine step, found on CPU.

HostReadCounter (hyperdraft/testing/host_reads.py) records every tensor operation that would copy device data to the
host or block on it on a GPU (item/tolist/bool(t)/nonzero/x[mask]/x[tensor] = scalar, ...). The engine itself runs
unmodified. A step that returns tokens must make exactly one such transfer, the `tolist` of its results, for plain
decoding and every speculative shape (chain, tree, sampled tree, NGRAM, STANDALONE), greedy and sampled, with
penalties. tests/gpu/test_host_sync.py counts the real syncs on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.host_reads import HostReadCounter
from hyperdraft.testing.tiny import make_tiny_model
from tests.conftest import assert_engine_clean

CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
CASES = {
    "plain": {},
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", draft="eagle3", **CHAIN),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", draft="eagle3", **TREE),
    "eagle3-tree-sampled": dict(speculative_algorithm="EAGLE3", draft="eagle3", speculative_use_rejection_sampling=True,
                                **TREE),
    "standalone-chain-sampled": dict(speculative_algorithm="STANDALONE", draft="draft",
                                     speculative_use_rejection_sampling=True, **CHAIN),
    "standalone-tree": dict(speculative_algorithm="STANDALONE", draft="draft", **TREE),
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4),
    "eagle3-chain-simulated": dict(speculative_algorithm="EAGLE3", draft="eagle3", speculative_simulate_accept_rate=0.7,
                                   **CHAIN),
}
PARAMS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01),
    "penalties": dict(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("host_sync")
    target = make_tiny_model(str(root / "target"), "llama", num_hidden_layers=3)
    return {"target": target, "eagle3": write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3"),
            "draft": make_tiny_model(str(root / "draft"), "qwen3", seed=2, with_tokenizer=False, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16)}


def _reads_per_step(models, case: str, params: dict) -> list[list[str]]:
    """Run three requests (two with a mixed-in prefill) to the end; the transfers each token-producing step made."""
    args = dict(CASES[case])
    if "draft" in args:
        args["speculative_draft_model_path"] = models[args.pop("draft")]
    llm = LLM(models["target"], device="cpu", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16, **args)
    engine = llm.engine
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, seed=3, **params)
    engine.add_request(input_ids=[5, 6, 7, 8] * 5, params=sp)
    per_step, step = [], 0
    # The torch attention backend is the CPU reference: on a GPU the Triton backend runs, which reads no host data.
    with HostReadCounter(ignore_files=("hyperdraft/attention/torch_backend.py",)) as counter:
        while engine.has_unfinished():
            if step == 3:  # a prefill chunk rides along with running decodes
                engine.add_request(input_ids=list(range(10, 50)), params=sp)
                engine.add_request(input_ids=[9] * 7, params=sp)
            counter.clear()
            outs = engine.step()
            if outs:
                per_step.append([f"{k} at {w}" for k, w in zip(counter.kinds(), (e[2] for e in counter.events))])
            else:
                assert not counter.events, f"a step without results read from the device: {counter.events}"
            step += 1
    assert_engine_clean(llm)
    return per_step


RUNS = [(case, params) for case in CASES for params in ("greedy", "sampled")]
RUNS += [(case, "penalties") for case in ("plain", "eagle3-chain", "eagle3-tree")]


@pytest.mark.parametrize("case,params", RUNS, ids=[f"{c}-{p}" for c, p in RUNS])
def test_one_transfer_per_step(models, case, params):
    per_step = _reads_per_step(models, case, PARAMS[params])
    assert len(per_step) >= 4
    bad = [(i, reads) for i, reads in enumerate(per_step) if len(reads) != 1 or not reads[0].startswith("read:tolist")]
    assert not bad, f"steps with other than one tolist: {bad[:3]}"


def test_counter_sees_each_kind():
    """The counter itself: each pattern it exists to find is recorded, and the tensors behave as before."""
    x = torch.arange(6)
    with HostReadCounter() as c:
        x.tolist(), bool(x[0] > 1), int(x.max()), x[x > 2], torch.nonzero(x)
        y = x.clone()
        y[torch.tensor([0, 1])] = 7
        y[torch.tensor([2])] = torch.tensor(1)  # a tensor value: no host copy
        x.repeat_interleave(torch.tensor([1, 2, 0, 1, 1, 1]))
        x.repeat_interleave(2)  # int repeats: no sync
    assert c.kinds() == ["read:tolist", "read:__bool__", "read:__int__", "nonzero:x[mask]", "nonzero:nonzero",
                         "scalar_put:x[tensor] = scalar", "nonzero:repeat_interleave"]
    assert y.tolist() == [7, 7, 1, 3, 4, 5]
