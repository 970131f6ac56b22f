"""RuntimeOptions.launch_thread on CPU with emulated graphs: the decode or verify a step queues for the next one is
computed on the launcher's helper thread (runner/launcher.py), while this thread decodes the results, commits and
schedules. CPU ops run as they are queued, so a step that read a queued forward's outputs, or queued work of its own,
before joining the helper would see stale buffers or race it: outputs must equal the same engine without the thread
(and spec off, greedy), work must really have gone to the helper, and the pool ends free (llm_factory)."""

from __future__ import annotations

import json

import pytest

from hyperdraft import SamplingParams
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_off_ids  # noqa: F401

NEW_TOKENS = [24, 40, 9, 33]
CASES = {
    "plain": {},
    "ngram-chain": dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4),
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=2,
                        speculative_num_draft_tokens=6),
    "eagle3-adaptive": dict(speculative_algorithm="EAGLE3", speculative_adaptive=True, speculative_num_steps=1),
    "standalone-chain": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3),  # a self-draft: accepts all
}
# step 0 (the plain worker's decodes, the head parked) and two drafting tiers, switching often
ADAPTIVE = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1, "1": {"candidate_steps": [0, 1, 3]},
            "4": {"candidate_steps": [0, 1, 3]}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch_thread")
    (root / "adaptive.json").write_text(json.dumps(ADAPTIVE))
    target = make_tiny_model(str(root / "target"), "llama", num_hidden_layers=4)  # EAGLE-3 reads 3 distinct layers
    head = write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3", draft_vocab_size=200)
    return dict(target=target, eagle3=head, adaptive=str(root / "adaptive.json"))


def _args(models, name: str) -> dict:
    args = dict(CASES[name])
    if args.get("speculative_algorithm") == "EAGLE3":
        args["speculative_draft_model_path"] = models["eagle3"]
    if args.get("speculative_algorithm") == "STANDALONE":
        args["speculative_draft_model_path"] = models["target"]
    if args.get("speculative_adaptive"):
        args["speculative_adaptive_config"] = models["adaptive"]
    return args


def _run(llm_factory, models, name, prompts, params, thread: bool):
    llm = llm_factory(models["target"], skip_tokenizer_init=True, cuda_graph_max_bs=4,
                      runtime_options=RuntimeOptions(emulate_cuda_graphs=True, launch_thread=thread), **_args(models, name))
    outs = [o.token_ids for o in gen(llm, prompts, params)]
    return outs, llm.engine.runner.graphs.launcher.submitted


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", list(CASES))
def test_queued_work_on_the_helper_thread_changes_nothing(models, llm_factory, name, sampled):
    prompts = mixed_prompts(len(NEW_TOKENS), seed=5, max_len=48)
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=n, ignore_eos=True, seed=3 + i)
              for i, n in enumerate(NEW_TOKENS)] if sampled else [greedy(n) for n in NEW_TOKENS]
    outs, submitted = _run(llm_factory, models, name, prompts, params, thread=True)
    inline, none_submitted = _run(llm_factory, models, name, prompts, params, thread=False)
    assert outs == inline
    assert none_submitted == 0
    if not sampled:  # (a sampled EAGLE round is drafted ahead only once its round graph exists: none may be queued)
        assert submitted > 3, submitted  # the queued forwards really ran on the helper
        assert outs == spec_off_ids(models["target"], prompts, params)
