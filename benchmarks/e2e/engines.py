"""Engines for the GPU benchmarks: a Llama-3.1-8B-shaped target with random weights (load_format="dummy": a forward
costs the same whatever the weights are) and an EAGLE-3-shaped head, built from config files alone; plus the decode
loops that time them. Used by e2e/gpu_bench.py, e2e/gpu_profile.py, e2e/round_timeline.py and probes/gc_probe.py.

Runtime switches (fused kernels, GEMV, PDL, graph segments, decode-ahead, draft-ahead, ...) are RuntimeOptions
fields: make_engine(..., pdl=False) builds an engine with that one switch flipped over the environment's defaults.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import statistics
import time

import torch

from hyperdraft.config import EngineArgs
from hyperdraft.engine.engine import Engine
from hyperdraft.options import RuntimeOptions
from hyperdraft.sampling_params import SamplingParams

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
)
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True, torch_dtype="bfloat16",
               rope_theta=100000.0, rope_scaling=None)
TINY = dict(LLAMA_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)
SETTINGS = {  # name -> (steps, topk, num_draft_tokens)
    "chain3": (3, 1, 4),
    "chain5": (5, 1, 6),
    "tree5x4/8": (5, 4, 8),
}
ALPHAS = (0.6, 0.8, 0.9)
REPEATS = 8  # batch-1 runs: ~1 s each, swinging by up to 25% with host jitter, and ~70 rounds of acceptance each
# Speculative batch-1 rows pool more runs: the accept length is a sample mean. At alpha 0.8, chain 5, one round's
# accepted length has a standard deviation of ~1.7 tokens, so 8 runs (~560 rounds) leave ~2% of E on the mean
# and 24 runs (~1700 rounds) ~1.1%.
SPEC_REPEATS = 24


def write_configs(root: str, target_cfg: dict, draft_vocab: int) -> tuple[str, str]:
    """config.json of the target and of an EAGLE-3 head for it (no weights: engines load them as "dummy")."""
    target, head = os.path.join(root, "target"), os.path.join(root, "eagle3")
    for path in (target, head):
        os.makedirs(path, exist_ok=True)
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(target_cfg, f)
    head_cfg = {k: target_cfg[k] for k in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                           "max_position_embeddings", "rope_theta", "rope_scaling", "torch_dtype")}
    n = target_cfg["num_hidden_layers"]
    head_cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, tie_word_embeddings=False,
                    draft_vocab_size=draft_vocab,
                    eagle_config={"eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4], "use_aux_hidden_state": True})
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump(head_cfg, f)
    return target, head


def eagle3_spec(head: str, steps: int, topk: int, num_draft_tokens: int, alpha: float = 0.8,
                sibling_rate: float | None = None) -> dict:
    """EngineArgs of EAGLE-3 speculation with the head at `head`, at simulated acceptance alpha (random weights
    accept nothing; every draft and verify kernel still runs, only the accept decision is replaced: LOSSY). Trees:
    sibling_rate lets lower-ranked children match too (verify/simulated.py); None, only first children can."""
    return dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=steps,
                speculative_eagle_topk=topk, speculative_num_draft_tokens=num_draft_tokens,
                speculative_simulate_accept_rate=alpha,
                speculative_simulate_sibling_rate=sibling_rate if topk > 1 else None)


class SharedWeights:
    """One target (and head) for every engine of the run: loading 16 GB per configuration would dominate.

    A benchmark-only MONKEYPATCH of the engine's two loaders, kept for the life of the process: the target's
    (hyperdraft.engine.engine.load_model) and the EAGLE head's (load_eagle_head as imported into
    hyperdraft.speculative.proposers.eagle, which EagleProposer.load_draft calls). The loaders return the first
    model loaded from a path to every later engine; nothing else about the engines changes."""

    def __init__(self):
        import hyperdraft.engine.engine as engine_module
        import hyperdraft.speculative.proposers.eagle as eagle_module

        self.models: dict = {}
        self.heads: dict = {}
        load_target, load_head = engine_module.load_model, eagle_module.load_eagle_head

        def load_model(path, dtype, device, load_format="auto", *rest):
            if path not in self.models:
                self.models[path] = load_target(path, dtype, device, load_format, *rest)
            return self.models[path]

        def load_eagle_head(path, target, **kw):
            if path not in self.heads:
                self.heads[path] = load_head(path, target, **kw)
            return self.heads[path]

        engine_module.load_model, eagle_module.load_eagle_head = load_model, load_eagle_head


def make_engine(target: str, device: str, max_bs: int, spec: dict | None, capacity: int, **switches):
    """An engine over the target (dummy weights), CUDA graphs up to max_bs -> (engine, build and capture info).
    switches: RuntimeOptions fields to flip (fused_kernels=False, pdl=False, ...) over the environment's defaults;
    on the CPU (--tiny smoke tests) CUDA graphs are emulated."""
    args = dict(model_path=target, load_format="dummy", dtype="bfloat16", device=device, skip_tokenizer_init=True,
                max_running_requests=max_bs, cuda_graph_max_bs=max_bs, max_total_tokens=capacity,
                context_length=4096, log_level="warning")
    if device == "cpu":
        args.update(dtype="float32")
        switches.setdefault("emulate_cuda_graphs", True)
    engine_args = EngineArgs.from_kwargs(**args, **(spec or {}))
    # from_args keeps EngineArgs' speculative_simulate_accept_rate; the switches go over it
    options = dataclasses.replace(RuntimeOptions.from_args(engine_args), **switches)
    start = time.perf_counter()
    engine = Engine(engine_args, options)
    build = time.perf_counter() - start
    proposer = getattr(engine.worker, "proposer", None)
    graphs = [r.graphs for r in (engine.runner, getattr(proposer, "runner", None)) if r is not None and r.graphs is not None]
    if getattr(proposer, "draft_loop", None) is not None:  # whole chain rounds as one graph each
        graphs.append(proposer.draft_loop)
    info = {"engine_build_s": build, "graphs": sum(len(g.outputs) for g in graphs),
            "capture_s": sum(g.capture_seconds for g in graphs), "capture_MiB": sum(g.capture_bytes for g in graphs) / 2**20}
    return engine, info


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def step_us(engine, steps: int) -> float:
    """Wall time per engine step over `steps` steps, the device drained at the end (us)."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine)
    return (time.perf_counter() - start) / steps * 1e6


def decode_run(engine, bs: int, input_len: int, output_len: int, seed: int) -> dict:
    """Prefill bs random prompts, then time the decode steps until every request has output_len tokens."""
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, vocab - 10, (bs, input_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
    reqs = [engine.add_request(input_ids=p, params=params) for p in prompts]
    while any(not r.output_ids for r in reqs):
        engine.step()
    sync(engine)
    tokens0, steps = sum(len(r.output_ids) for r in reqs), 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync(engine)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_ids) for r in reqs) - tokens0
    verify = sum(r.spec_verify_ct for r in reqs)
    return {"batch": bs, "tokens": tokens, "seconds": seconds, "engine_steps": steps, "tok_per_s": tokens / seconds,
            "step_ms": 1000 * seconds / max(steps, 1),
            "accept_length": (sum(len(r.output_ids) for r in reqs) - bs) / verify if verify else None,
            "verify_steps": verify}


def median_run(engine, bs: int, input_len: int, output_len: int, seed: int, repeats: int = REPEATS) -> dict:
    """decode_run, `repeats` times at batch 1 (once above), each with its own prompts and request seeds.
    tok/s = tokens per step pooled over the runs / the median step time: the median drops runs slowed by host jitter,
    and pooling measures the accept length over many rounds (one run's ~70 rounds leave a standard deviation of ~6%
    of E in its mean accept length at alpha 0.8, chain 5; the run-to-run spread of the speedup came mostly from
    there). Every run's tok/s is kept."""
    runs = [decode_run(engine, bs, input_len, output_len, seed + 1000 * i) for i in range(repeats if bs == 1 else 1)]
    steps, tokens = sum(r["engine_steps"] for r in runs), sum(r["tokens"] for r in runs)
    step_ms = statistics.median(r["step_ms"] for r in runs)
    verify = sum(r["verify_steps"] for r in runs)
    accept = sum(r["accept_length"] * r["verify_steps"] for r in runs if r["verify_steps"]) / verify if verify else None
    return {"batch": bs, "tokens": tokens, "engine_steps": steps, "step_ms": step_ms,
            "tok_per_s": tokens / steps / step_ms * 1000, "accept_length": accept, "verify_steps": verify,
            "runs_tok_per_s": [r["tok_per_s"] for r in runs]}


def free(engine) -> None:
    """Drop an engine and its CUDA graphs, the drafter's too (Engine.close; the shared weights stay)."""
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
