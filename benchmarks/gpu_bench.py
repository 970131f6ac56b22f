"""GPU benchmark: ceilings, plain decode, speculative decode at simulated acceptance, and transformers, in one run.

Target: a Llama-3.1-8B-shaped model with random bf16 weights (load_format="dummy": a forward costs the same whatever
the weights are). Drafter: an EAGLE-3-shaped head (1 layer, 32k draft vocabulary), also random. Random weights
accept nothing, so speculative runs use speculative_simulate_accept_rate=alpha: every draft and verify kernel runs,
only the accept decision is replaced (outputs are NOT the model's; this is a system-speed benchmark).

  1. ceilings      device memory bandwidth (large copy) and the bf16 matmul rate
  2. plain decode  tokens/s at batch 1, 8, 32, 64 (input 512, output 256); batch 1 against the weights roofline
                   (batch-1 rows: 8 runs: pooled tokens per step / median step time, see median_run)
  3. speculative   alpha in {0.6, 0.8, 0.9} x {chain 3, chain 5, tree 5x4/8} x batch {1, 8, 32}; speedup over (2)
                   and the ideal E / (1 + k*c + v) from the measured draft cost ratio c and verify overhead v
  4. transformers  generate() with a static cache at batch 1 and 16, same shapes
  5. CUDA graphs   capture time and memory per engine

Run on a GPU machine:  python3 benchmarks/gpu_bench.py --out DIR       (writes DIR/gpu_bench.json)
Then anywhere:         python3 benchmarks/gpu_bench.py --report DIR/gpu_bench.json --results benchmarks/results
                       (markdown table and PNG plots; also done at the end of a GPU run when matplotlib exists)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import statistics
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hyperdraft.speculative.drafting.graphs import DRAFT_LOOP_GRAPH_ENV  # noqa: E402
from hyperdraft.speculative.proposers.model_proposer import DRAFT_AHEAD_ENV  # noqa: E402
from hyperdraft.engine.model_worker import DECODE_AHEAD_ENV  # noqa: E402

LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
)
TINY = dict(LLAMA_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512)
SETTINGS = {  # name -> (steps, topk, num_draft_tokens)
    "chain3": (3, 1, 4),
    "chain5": (5, 1, 6),
    "tree5x4/8": (5, 4, 8),
}
ALPHAS = (0.6, 0.8, 0.9)


def write_configs(root: str, target_cfg: dict, draft_vocab: int) -> tuple[str, str]:
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


# ---- 1. ceilings --------------------------------------------------------------------------------------------------
def cuda_time(fn, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeat


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16 each way
    a, b = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    copy_s = cuda_time(lambda: b.copy_(a), 20)
    bandwidth = 2 * a.numel() * a.element_size() / copy_s  # read + write
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = cuda_time(lambda: m @ m, 20)
    del m
    torch.cuda.empty_cache()
    return {"bandwidth_GBps": bandwidth / 1e9, "bf16_matmul_TFLOPS": 2 * 8192**3 / mm_s / 1e12}


# ---- engines --------------------------------------------------------------------------------------------------------
class SharedWeights:
    """One target (and head) for every engine of the run: loading 16 GB per configuration would dominate."""

    def __init__(self):
        import hyperdraft.engine.engine as engine_mod

        self.models: dict = {}
        self.heads: dict = {}
        orig_load, orig_head = engine_mod.load_model, engine_mod.load_eagle_head

        def load_model(path, dtype, device, load_format="auto"):
            if path not in self.models:
                self.models[path] = orig_load(path, dtype, device, load_format)
            return self.models[path]

        def load_eagle_head(path, target, **kw):
            if path not in self.heads:
                self.heads[path] = orig_head(path, target, **kw)
            return self.heads[path]

        engine_mod.load_model, engine_mod.load_eagle_head = load_model, load_eagle_head


def make_engine(target: str, device: str, max_bs: int, spec: dict | None, capacity: int):
    from hyperdraft.config import EngineArgs
    from hyperdraft.engine.engine import Engine

    args = dict(model_path=target, load_format="dummy", dtype="bfloat16", device=device, skip_tokenizer_init=True,
                max_running_requests=max_bs, cuda_graph_max_bs=max_bs, max_total_tokens=capacity,
                context_length=4096, log_level="warning")
    if device == "cpu":
        args.update(dtype="float32")
    start = time.perf_counter()
    engine = Engine(EngineArgs.from_kwargs(**args, **(spec or {})))
    build = time.perf_counter() - start
    proposer = getattr(engine.worker, "proposer", None)
    graphs = [r.graphs for r in (engine.runner, getattr(proposer, "runner", None)) if r is not None and r.graphs is not None]
    if getattr(proposer, "draft_loop", None) is not None:  # whole chain rounds as one graph each
        graphs.append(proposer.draft_loop)
    info = {"engine_build_s": build, "graphs": sum(len(g.outputs) for g in graphs),
            "capture_s": sum(g.capture_seconds for g in graphs), "capture_MiB": sum(g.capture_bytes for g in graphs) / 2**20}
    return engine, info


def decode_run(engine, bs: int, input_len: int, output_len: int, seed: int) -> dict:
    """Prefill bs random prompts, then time the decode steps until every request has output_len tokens."""
    from hyperdraft.sampling_params import SamplingParams

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


REPEATS = 8  # batch-1 runs: ~1 s each, swinging by up to 25% with host jitter, and ~70 rounds of acceptance each
# Speculative batch-1 rows pool more runs: the accept length is a sample mean. At alpha 0.8, chain 5, one round's
# accepted length has a standard deviation of ~1.7 tokens, so 8 runs (~560 rounds) leave ~2% of E on the mean
# and 24 runs (~1700 rounds) ~1.1%.
SPEC_REPEATS = 24


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


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def phase_split(engine, bs: int, input_len: int, output_len: int) -> dict:
    """Per-step time split (synced phases, draft-ahead off, so slower than the real run; used for c, v and the
    split plot)."""
    timer = engine.worker.timer
    timer.enabled, timer.seconds = True, {}
    os.environ[DRAFT_AHEAD_ENV] = "0"  # a draft queued ahead would be timed inside the previous step's accept phase
    try:
        run = decode_run(engine, bs, input_len, output_len, seed=99)
    finally:
        timer.enabled = False
        del os.environ[DRAFT_AHEAD_ENV]
    steps = max(run["engine_steps"], 1)
    ms = {k: 1000 * v / steps for k, v in timer.seconds.items()}
    split = {"draft_steps": ms.get("draft", 0) - ms.get("draft_extend", 0), "draft_extend": ms.get("draft_extend", 0),
             "verify": ms.get("verify", 0), "accept_commit": ms.get("accept_commit", 0)}
    split["host_overhead"] = max(run["step_ms"] - sum(split.values()), 0.0)
    return split


def profile_steps(engine, bs: int, input_len: int, num_steps: int) -> dict:
    """torch.profiler over num_steps decode steps: device-to-host copies and host syncs per step (the target is one
    D2H copy per step), host-to-device copies per step and how many of them came from pinned memory."""
    from torch.profiler import ProfilerActivity, profile

    from hyperdraft.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_new_tokens=num_steps * 8 + 8, ignore_eos=True)
    reqs = [engine.add_request(input_ids=torch.randint(10, vocab - 10, (input_len,)).tolist(), params=params)
            for _ in range(bs)]
    while any(not r.output_ids for r in reqs):
        engine.step()
    sync(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        sync(engine)
    for r in reqs:
        engine.abort(r.rid)
    counts: dict[str, int] = {}
    for ev in prof.events():
        name = ev.name
        for key in ("Memcpy DtoH", "Memcpy HtoD", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            if name.startswith(key):
                label = key + (" (pinned)" if "Pinned" in name else " (pageable)" if "Pageable" in name else "")
                counts[label] = counts.get(label, 0) + 1
    return {"batch": bs, "steps": num_steps, "per_step": {k: v / num_steps for k, v in sorted(counts.items())}}


def free(engine) -> None:
    engine.runner.graphs = None
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- 4. transformers ------------------------------------------------------------------------------------------------
def transformers_baseline(target_cfg: dict, device: str, batches, input_len: int, output_len: int,
                          compiled: bool = False) -> list[dict]:
    """generate() with a static cache; compiled=True lets transformers torch.compile the decode step (its default
    for static caches), timed after a warm-up generate that pays the compilation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in target_cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    for bs in batches:
        ids = torch.randint(10, cfg.vocab_size - 10, (bs, input_len), device=device)

        def gen(n):
            sync_dev(device)
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, cache_implementation="static", disable_compile=not compiled)
            sync_dev(device)
            return time.perf_counter() - start

        # Warm up with the timed call's own length: the static cache is sized from it, so any other length would
        # recompile inside the timed call. The timed call includes the prefill (1-3% of it at these sizes).
        warm = gen(output_len)
        total = gen(output_len)
        out.append({"batch": bs, "tok_per_s": bs * output_len / total, "seconds": total, "compiled": compiled,
                    "warmup_s": warm})
    del model
    gc.collect()
    return out


def save(result: dict, out: str) -> str:
    """Written after every section, so a run cut short still leaves its numbers."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "gpu_bench.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def sync_dev(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- the run --------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--report", help="only render a report from this gpu_bench.json")
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test of this script)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--only-transformers", action="store_true",
                    help="only section 4 (its own gpu_bench.json; merge with --merge when rendering)")
    ap.add_argument("--merge", help="with --report: a second gpu_bench.json whose transformers results to add")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="speculative settings to run (comma-separated)")
    ap.add_argument("--spec-batches", default="1,8,32")
    ap.add_argument("--skip-ab", action="store_true", help="skip the plain A/B rows (fused off, one graph)")
    a = ap.parse_args()
    if a.report:
        from benchmarks.gpu_bench_report import render

        result = json.load(open(a.report))
        if a.merge:
            extra = json.load(open(a.merge))
            result.update({k: v for k, v in extra.items() if k.startswith("transformers")})
        render(result, a.results)
        return
    device = "cpu" if a.tiny else "cuda"
    if a.tiny:
        os.environ["HYPERDRAFT_EMULATE_CUDA_GRAPH"] = "1"
    target_cfg = TINY if a.tiny else LLAMA_8B
    root = tempfile.mkdtemp(prefix="gpu_bench_")
    target, head = write_configs(root, target_cfg, draft_vocab=64 if a.tiny else 32000)
    shared = SharedWeights()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (tiny smoke test)",
              "torch": torch.__version__, "input_len": a.input_len, "output_len": a.output_len, "engines": {}}
    if a.only_transformers:
        result["transformers"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len, a.output_len)
        print("transformers", result["transformers"], flush=True)
        save(result, a.out)
        if device == "cuda":
            result["transformers_compiled"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len,
                                                                    a.output_len, compiled=True)
            print("transformers compiled", result["transformers_compiled"], flush=True)
        save(result, a.out)
        return
    if device == "cuda":
        result["ceilings"] = ceilings()
        print("ceilings", result["ceilings"], flush=True)
    capacity = 64 * (a.input_len + a.output_len + 64)

    engine, info = make_engine(target, device, 64, None, capacity)
    model = engine.runner.model
    result["weight_bytes"] = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    result["engines"]["plain"] = info
    decode_run(engine, 1, 32, 8, seed=0)  # warm-up (Triton compilation of the prefill shapes)
    result["plain"] = [median_run(engine, bs, a.input_len, a.output_len, seed=bs) for bs in (1, 8, 32, 64)]
    if device == "cuda":
        result["profile"] = {"plain": profile_steps(engine, 8, a.input_len, 10)}
    print("plain", [(r["batch"], round(r["tok_per_s"], 1)) for r in result["plain"]], flush=True)
    os.environ[DECODE_AHEAD_ENV] = "0"  # A/B on the same engine: each step decoded when scheduled
    try:
        result["plain_no_decode_ahead"] = [median_run(engine, bs, a.input_len, a.output_len, seed=bs) for bs in (1, 8)]
    finally:
        del os.environ[DECODE_AHEAD_ENV]
    print("plain_no_decode_ahead", [(r["batch"], round(r["tok_per_s"], 1)) for r in result["plain_no_decode_ahead"]],
          flush=True)
    save(result, a.out)
    free(engine)

    # A/B rows in the same run: the torch elementwise ops and cuBLAS instead of every Triton kernel (the fusion's
    # gain), cuBLAS projections only (the GEMV's gain), plain launches (PDL's gain), and one graph per forward
    # instead of layer-cut segments (the GPU then waits for the whole launch call).
    import hyperdraft.runner.graph_runner as graph_runner
    import hyperdraft.kernels as kernels
    import hyperdraft.kernels.gemv as gemv
    import hyperdraft.kernels.pdl as pdl

    ab_rows = () if a.skip_ab else (("plain_unfused", kernels, "FUSED_ENABLED"), ("plain_cublas", gemv, "ENABLED"),
                                    ("plain_no_pdl", pdl, "ENABLED"), ("plain_one_graph", graph_runner, "SEGMENTED"))
    for name, module, switch in ab_rows:
        setattr(module, switch, False)
        try:
            engine, _ = make_engine(target, device, 64, None, capacity)
            decode_run(engine, 1, 32, 8, seed=0)
            result[name] = [median_run(engine, bs, a.input_len, a.output_len, seed=bs) for bs in (1, 8)]
        finally:
            setattr(module, switch, True)
        print(name, [(r["batch"], round(r["tok_per_s"], 1)) for r in result[name]], flush=True)
        save(result, a.out)
        free(engine)

    result["spec"], result["split"] = [], {}
    spec_batches = [int(b) for b in a.spec_batches.split(",")]
    for name in a.settings.split(","):
        steps, topk, n = SETTINGS[name]
        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=steps,
                    speculative_eagle_topk=topk, speculative_num_draft_tokens=n, speculative_simulate_accept_rate=0.8)
        engine, info = make_engine(target, device, 32, spec, capacity)
        result["engines"][name] = info
        decode_run(engine, 1, 32, 8, seed=0)
        for alpha in ALPHAS:
            engine.worker.simulate_accept_rate = alpha
            for bs in spec_batches:
                run = median_run(engine, bs, a.input_len, a.output_len, seed=bs, repeats=SPEC_REPEATS)
                result["spec"].append({"setting": name, "steps": steps, "alpha": alpha, **run})
                print(name, alpha, bs, round(run["tok_per_s"], 1), round(run["accept_length"] or 0, 2), flush=True)
        engine.worker.simulate_accept_rate = 0.8
        result["split"][name] = {bs: phase_split(engine, bs, a.input_len, min(a.output_len, 64)) for bs in spec_batches}
        if device == "cuda":
            result.setdefault("profile", {})[name] = profile_steps(engine, 8, a.input_len, 10)
        save(result, a.out)
        free(engine)
        # A/B rows in the same run: every draft step launched on its own (per-step graphs, which also means no
        # draft-ahead), and one graph per round without draft-ahead (chains)
        ab_spec = [("spec_per_step_draft", DRAFT_LOOP_GRAPH_ENV)] + ([("spec_no_draft_ahead", DRAFT_AHEAD_ENV)] if topk == 1 else [])
        for key, env in ab_spec:
            os.environ[env] = "0"
            try:
                engine, _ = make_engine(target, device, 32, spec, capacity)
                decode_run(engine, 1, 32, 8, seed=0)
                run = median_run(engine, 1, a.input_len, a.output_len, seed=1)
            finally:
                del os.environ[env]
            result.setdefault(key, []).append({"setting": name, "steps": steps, "alpha": 0.8, **run})
            print(name, key, 0.8, 1, round(run["tok_per_s"], 1), flush=True)
            save(result, a.out)
            free(engine)

    if not a.skip_transformers:
        shared.models.clear()  # free our 16 GB before transformers builds its own copy
        shared.heads.clear()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        result["transformers"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len, a.output_len)
        print("transformers", result["transformers"], flush=True)
        save(result, a.out)
        if not a.tiny:  # compilation is minutes on a GPU and pointless on the CPU smoke test
            try:
                result["transformers_compiled"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len,
                                                                        a.output_len, compiled=True)
            except Exception as e:  # report what failed rather than lose the run
                result["transformers_compiled_error"] = repr(e)[:500]
            print("transformers compiled", result.get("transformers_compiled", result.get("transformers_compiled_error")), flush=True)
    print("wrote", save(result, a.out))
    try:
        from benchmarks.gpu_bench_report import render

        render(result, a.out)
    except ImportError as e:  # matplotlib may be missing on the GPU machine; render later with --report
        print("report skipped:", e)


if __name__ == "__main__":
    main()
