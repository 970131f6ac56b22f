"""RuntimeOptions.launch_thread on a GPU with real CUDA graphs: the decode or verify queued for the next step is
launched from the launcher's helper thread (runner/launcher.py). Outputs equal the same engine launching inline
(fp32, greedy, sampled and penalised requests); the helper really launched; a step still makes one device-to-host
sync (the helper's launches do not sync). CPU tests run the same engine paths with emulated graphs
(tests/speculative/test_launch_thread.py).

Run: `PYTHONPATH=. python3 -m pytest tests/gpu/test_launch_thread_gpu.py -q`. Not part of CI.
"""

from __future__ import annotations

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.options import RuntimeOptions
from helpers.host_sync_cases import PARAMS, engine_args, write_models
from tests.conftest import assert_engine_clean

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = ["plain", "eagle3-chain", "eagle3-tree", "ngram", "standalone-tree", "eagle3-step-zero"]
PROMPTS = ([5, 6, 7, 8] * 6, list(range(10, 40)), [9] * 11, [3, 4] * 20)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return write_models(str(tmp_path_factory.mktemp("launch_thread_gpu")))


def _run(models, case: str, params: dict, thread: bool) -> tuple[list[list[int]], int]:
    llm = LLM(models["target"], device="cuda", dtype="float32", skip_tokenizer_init=True, cuda_graph_max_bs=4,
              runtime_options=RuntimeOptions(launch_thread=thread), **engine_args(models, case))
    sp = [SamplingParams(max_new_tokens=n, ignore_eos=True, seed=1 + i, **params) for i, n in enumerate((64, 40, 90, 7))]
    outs = [o.token_ids for o in llm.generate(input_ids=list(PROMPTS), sampling_params=sp, use_tqdm=False)]
    submitted = llm.engine.runner.graphs.launcher.submitted
    assert_engine_clean(llm)
    llm.shutdown()
    return outs, submitted


@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("case", CASES)
def test_helper_thread_launches_change_nothing(models, case, params):
    threaded, submitted = _run(models, case, PARAMS[params], thread=True)
    inline, _ = _run(models, case, PARAMS[params], thread=False)
    assert threaded == inline
    if params == "greedy":
        assert submitted > 10, submitted
