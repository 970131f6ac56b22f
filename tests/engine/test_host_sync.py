"""At most one device-to-host transfer per engine step, found on CPU.

HostReadCounter (tests/helpers/host_reads.py) records every tensor operation that would copy device data to the
host or block on it on a GPU (item/tolist/bool(t)/nonzero/x[mask]/x[tensor] = scalar, ...). The engine itself runs
unmodified. A step that returns tokens must make exactly one such transfer, the `tolist` of its results, for plain
decoding and every speculative shape (chain, tree, sampled tree, NGRAM, STANDALONE), greedy and sampled, with
penalties. tests/gpu/test_host_sync.py counts the real syncs on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from helpers.host_reads import HostReadCounter
from helpers.host_sync_cases import CASES, PARAMS, engine_args, write_models
from tests.conftest import assert_engine_clean


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(str(tmp_path_factory.mktemp("host_sync")))


def _reads_per_step(models, case: str, params: dict) -> list[list[str]]:
    """Run three requests (two with a mixed-in prefill) to the end; the transfers each token-producing step made."""
    llm = LLM(models["target"], device="cpu", dtype="float32", skip_tokenizer_init=True, chunked_prefill_size=16,
              **engine_args(models, case))
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
