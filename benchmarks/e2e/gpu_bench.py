"""GPU benchmark: ceilings, plain decode, speculative decode at simulated acceptance, and transformers, in one run.

Target: a Llama-3.1-8B-shaped model with random bf16 weights (load_format="dummy": a forward costs the same whatever
the weights are). Drafter: an EAGLE-3-shaped head (1 layer, 32k draft vocabulary), also random. Random weights
accept nothing, so speculative runs use speculative_simulate_accept_rate=alpha: every draft and verify kernel runs,
only the accept decision is replaced (outputs are NOT the model's; this is a system-speed benchmark).

  1. ceilings      device memory bandwidth (large copy) and the bf16 matmul rate
  2. plain decode  tokens/s at batch 1, 8, 32, 64 (input 512, output 256); batch 1 against the weights roofline
                   (batch-1 rows: 8 runs: pooled tokens per step / median step time, see engines.median_run)
  3. speculative   alpha in {0.6, 0.8, 0.9} x {chain 3, chain 5, tree 5x4/8} x batch {1, 8, 32}; speedup over (2)
                   and the ideal E / (1 + k*c + v) from the measured draft cost ratio c and verify overhead v
  4. transformers  generate() with a static cache at batch 1 and 16, same shapes
  5. CUDA graphs   capture time and memory per engine
  6. deterministic --enable-deterministic-inference against the default: plain and chain 5 at alpha 0.8, batch 1
                   and 8, each pair in this run (also alone: --only-deterministic, a few minutes)
A/B rows: engines built with one RuntimeOptions switch flipped (fused_kernels, gemv, pdl, graph_segments,
decode_ahead; draft_loop_graphs and draft_ahead for the speculative settings), timed in the same run.

Run on a GPU machine (from the repository root):
  python -m benchmarks.e2e.gpu_bench --out $OUT          # writes $OUT/gpu_bench_<device>.json (+ .md, .png)
Then anywhere:
  python -m benchmarks.e2e.gpu_bench --report $OUT/gpu_bench_h100.json --results benchmarks/results
                                     # benchmarks/results/gpu_bench_h100.md and its PNG plots (needs matplotlib)
CPU smoke test of this script: python -m benchmarks.e2e.gpu_bench --tiny --skip-transformers --out /tmp/gb
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import tempfile
import time

import torch

from benchmarks.common import RESULTS_DIR, command_line, git_commit, require_cuda, tag_of
from benchmarks.e2e.engines import (ALPHAS, LLAMA_8B, REPEATS, SETTINGS, SPEC_REPEATS, TINY, SharedWeights, decode_run,
                                    eagle3_spec, free, make_engine, median_run, sync, write_configs)
from benchmarks.e2e.gpu_bench_report import render, report
from hyperdraft.sampling_params import SamplingParams

# A/B rows of plain decode: (result key, the RuntimeOptions switch turned off)
PLAIN_AB = (
    ("plain_unfused", "fused_kernels"),  # torch elementwise ops and cuBLAS instead of every Triton kernel
    ("plain_cublas", "gemv"),  # cuBLAS projections only (the few-row GEMV's gain)
    ("plain_no_pdl", "pdl"),  # plain launches (programmatic dependent launch's gain)
    ("plain_one_graph", "graph_segments"),  # one graph per forward instead of layer-cut segments
)


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


# ---- 3. speculative: where a step's time goes ----------------------------------------------------------------------
def phase_split(engine, bs: int, input_len: int, output_len: int) -> dict:
    """Per-step time split on an engine built with record_step_time=True (every phase synced) and draft_ahead=False
    (a draft queued ahead would be timed inside the previous step's accept phase), so slower than the real run; used
    for c, v and the split plot."""
    timer = engine.worker.timer
    assert timer.enabled, "phase_split needs an engine built with record_step_time=True"
    before = dict(timer.seconds)
    run = decode_run(engine, bs, input_len, output_len, seed=99)
    steps = max(run["engine_steps"], 1)
    ms = {k: 1000 * (v - before.get(k, 0.0)) / steps for k, v in timer.seconds.items()}
    split = {"draft_steps": ms.get("draft", 0) - ms.get("draft_extend", 0), "draft_extend": ms.get("draft_extend", 0),
             "verify": ms.get("verify", 0), "accept_commit": ms.get("accept_commit", 0)}
    split["host_overhead"] = max(run["step_ms"] - sum(split.values()), 0.0)
    return split


def profile_steps(engine, bs: int, input_len: int, num_steps: int) -> dict:
    """torch.profiler over num_steps decode steps: device-to-host copies and host syncs per step (the target is one
    D2H copy per step), host-to-device copies per step and how many of them came from pinned memory."""
    from torch.profiler import ProfilerActivity, profile

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



def sync_dev(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def save(result: dict, out: str, stem: str) -> str:
    """Written after every section, so a run cut short still leaves its numbers."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


# ---- 6. deterministic mode against the default ---------------------------------------------------------------------
DETERMINISTIC_ROWS = (("plain", None), ("chain5", "chain5"))


def deterministic_ab(target: str, head: str, device: str, capacity: int, a) -> list[dict]:
    """Rows (setting, batch, default tok/s, deterministic tok/s, slowdown): each setting's two engines run back to
    back, so the ratio is taken under the same conditions."""
    rows = []
    for name, setting in DETERMINISTIC_ROWS:
        spec = eagle3_spec(head, *SETTINGS[setting], alpha=0.8) if setting else None
        runs = {}
        for mode, flag in (("default", False), ("deterministic", True)):
            engine, _ = make_engine(target, device, 8, spec, capacity, deterministic=flag)
            decode_run(engine, 1, 32, 8, seed=0)
            runs[mode] = [median_run(engine, bs, a.input_len, a.output_len, seed=bs,
                                     repeats=SPEC_REPEATS if spec else REPEATS) for bs in (1, 8)]
            free(engine)
        for base, det in zip(runs["default"], runs["deterministic"]):
            rows.append({"setting": name, "batch": base["batch"], "default_tok_s": base["tok_per_s"],
                         "deterministic_tok_s": det["tok_per_s"], "slowdown": base["tok_per_s"] / det["tok_per_s"],
                         "default_accept": base.get("accept_length"), "deterministic_accept": det.get("accept_length")})
            print("deterministic", rows[-1], flush=True)
    return rows


def deterministic_md(result: dict) -> str:
    lines = [f"# Deterministic mode against the default ({result['device']})", "",
             f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
             f"- Llama-3.1-8B shape, dummy bf16 weights, input {result['input_len']}, output {result['output_len']}; "
             "chain 5 = EAGLE-3 chain 5 at simulated acceptance 0.8; each pair's engines back to back in one run", "",
             "| setting | batch | default tok/s | deterministic tok/s | slowdown (default / deterministic) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['batch']} | {r['default_tok_s']:.1f} | {r['deterministic_tok_s']:.1f} | "
              f"{r['slowdown']:.3f}x |" for r in result["deterministic_ab"]]
    return "\n".join(lines) + "\n"


# ---- the run --------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.gpu_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."),
                    help="directory for the JSON and report (default: $OUT or .)")
    ap.add_argument("--name", default="gpu_bench", help="file name stem; files are <name>_<device>.json/.md/_*.png")
    ap.add_argument("--report", metavar="JSON", help="only render a report from this gpu_bench JSON into --results")
    ap.add_argument("--results", default=RESULTS_DIR,
                    help="with --report: where the report goes (default: %(default)s)")
    ap.add_argument("--merge", help="with --report: a second gpu_bench JSON whose transformers results to add")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test of this script)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--only-transformers", action="store_true",
                    help="only section 4 (its own JSON; merge with --merge when rendering)")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="speculative settings to run (comma-separated)")
    ap.add_argument("--spec-batches", default="1,8,32")
    ap.add_argument("--only-deterministic", action="store_true", help="only section 6 (deterministic against default)")
    ap.add_argument("--tree-sibling-rate", type=float, default=None,
                    help="simulated trees: a lower-ranked child's chance to match (speculative_simulate_sibling_rate); "
                         "default: only first children match, so trees accept like chains")
    ap.add_argument("--skip-ab", action="store_true",
                    help="skip the plain A/B rows " + ", ".join(k for k, _ in PLAIN_AB)
                    + " (plain_no_decode_ahead still runs)")
    a = ap.parse_args()
    if a.report:
        print("wrote", report(a.report, a.results, a.name, a.merge))
        return
    device = "cpu" if a.tiny else "cuda"
    if device == "cuda":
        require_cuda()
    target_cfg = TINY if a.tiny else LLAMA_8B
    root = tempfile.mkdtemp(prefix="gpu_bench_")
    target, head = write_configs(root, target_cfg, draft_vocab=64 if a.tiny else 32000)
    shared = SharedWeights()
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (tiny smoke test)",
              "torch": torch.__version__, "input_len": a.input_len, "output_len": a.output_len, "engines": {},
              "tree_sibling_rate": a.tree_sibling_rate}
    stem = f"{a.name}_{tag_of(result['device'])}"
    if a.only_transformers:
        result["transformers"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len, a.output_len)
        print("transformers", result["transformers"], flush=True)
        save(result, a.out, stem)
        if device == "cuda":
            result["transformers_compiled"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len,
                                                                    a.output_len, compiled=True)
            print("transformers compiled", result["transformers_compiled"], flush=True)
        save(result, a.out, stem)
        return
    if device == "cuda":
        result["ceilings"] = ceilings()
        print("ceilings", result["ceilings"], flush=True)
    capacity = 64 * (a.input_len + a.output_len + 64)
    if a.only_deterministic:
        result["deterministic_ab"] = deterministic_ab(target, head, device, capacity, a)
        print("wrote", save(result, a.out, stem))
        with open(os.path.join(a.out, f"{stem}_deterministic.md"), "w") as f:
            f.write(deterministic_md(result))
        return

    engine, info = make_engine(target, device, 64, None, capacity)
    model = engine.runner.model
    result["weight_bytes"] = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    result["engines"]["plain"] = info
    decode_run(engine, 1, 32, 8, seed=0)  # warm-up (Triton compilation of the prefill shapes)
    result["plain"] = [median_run(engine, bs, a.input_len, a.output_len, seed=bs) for bs in (1, 8, 32, 64)]
    if device == "cuda":
        result["profile"] = {"plain": profile_steps(engine, 8, a.input_len, 10)}
    print("plain", [(r["batch"], round(r["tok_per_s"], 1)) for r in result["plain"]], flush=True)
    save(result, a.out, stem)
    free(engine)

    # A/B rows in the same run, each on an engine built with one switch off: decode-ahead (each step decoded when
    # scheduled), then unless --skip-ab the torch elementwise ops and cuBLAS instead of every Triton kernel (the
    # fusion's gain), cuBLAS projections only (the GEMV's gain), plain launches (PDL's gain), and one graph per forward
    # instead of layer-cut segments (the GPU then waits for the whole launch call).
    ab_rows = [("plain_no_decode_ahead", "decode_ahead")] + ([] if a.skip_ab else list(PLAIN_AB))
    for key, switch in ab_rows:
        engine, _ = make_engine(target, device, 64, None, capacity, **{switch: False})
        decode_run(engine, 1, 32, 8, seed=0)
        result[key] = [median_run(engine, bs, a.input_len, a.output_len, seed=bs) for bs in (1, 8)]
        print(key, [(r["batch"], round(r["tok_per_s"], 1)) for r in result[key]], flush=True)
        save(result, a.out, stem)
        free(engine)

    result["spec"], result["split"] = [], {}
    spec_batches = [int(b) for b in a.spec_batches.split(",")]
    for name in a.settings.split(","):
        steps, topk, n = SETTINGS[name]
        spec = eagle3_spec(head, steps, topk, n, alpha=0.8, sibling_rate=a.tree_sibling_rate)
        engine, info = make_engine(target, device, 32, spec, capacity)
        result["engines"][name] = info
        # Requests take their seeds from the engine in arrival order: this warm-up, then every alpha and batch size
        # in turn. accept_draws.py replays that order: keep it.
        decode_run(engine, 1, 32, 8, seed=0)
        for alpha in ALPHAS:
            engine.worker.set_simulated_accept_rate(alpha)
            for bs in spec_batches:
                run = median_run(engine, bs, a.input_len, a.output_len, seed=bs, repeats=SPEC_REPEATS)
                result["spec"].append({"setting": name, "steps": steps, "alpha": alpha, **run})
                print(name, alpha, bs, round(run["tok_per_s"], 1), round(run["accept_length"] or 0, 2), flush=True)
        engine.worker.set_simulated_accept_rate(0.8)
        if device == "cuda":
            result.setdefault("profile", {})[name] = profile_steps(engine, 8, a.input_len, 10)
        save(result, a.out, stem)
        free(engine)
        # The phase split at alpha 0.8 (c, v): every phase synced, draft-ahead off, on an engine of its own
        engine, _ = make_engine(target, device, 32, spec, capacity, record_step_time=True, draft_ahead=False)
        decode_run(engine, 1, 32, 8, seed=0)
        result["split"][name] = {bs: phase_split(engine, bs, a.input_len, min(a.output_len, 64)) for bs in spec_batches}
        save(result, a.out, stem)
        free(engine)
        # A/B rows in the same run: every draft step launched on its own (per-step graphs, which also means no
        # draft-ahead), and one graph per round without draft-ahead (chains)
        ab_spec = [("spec_per_step_draft", "draft_loop_graphs")] + ([("spec_no_draft_ahead", "draft_ahead")] if topk == 1 else [])
        for key, switch in ab_spec:
            engine, _ = make_engine(target, device, 32, spec, capacity, **{switch: False})
            decode_run(engine, 1, 32, 8, seed=0)
            run = median_run(engine, 1, a.input_len, a.output_len, seed=1)
            result.setdefault(key, []).append({"setting": name, "steps": steps, "alpha": 0.8, **run})
            print(name, key, 0.8, 1, round(run["tok_per_s"], 1), flush=True)
            save(result, a.out, stem)
            free(engine)

    result["deterministic_ab"] = deterministic_ab(target, head, device, capacity, a)
    save(result, a.out, stem)

    if not a.skip_transformers:
        shared.models.clear()  # free our 16 GB before transformers builds its own copy
        shared.heads.clear()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        result["transformers"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len, a.output_len)
        print("transformers", result["transformers"], flush=True)
        save(result, a.out, stem)
        if not a.tiny:  # compilation is minutes on a GPU and pointless on the CPU smoke test
            try:
                result["transformers_compiled"] = transformers_baseline(target_cfg, device, (1, 16), a.input_len,
                                                                        a.output_len, compiled=True)
            except Exception as e:  # report what failed rather than lose the run
                result["transformers_compiled_error"] = repr(e)[:500]
            print("transformers compiled", result.get("transformers_compiled", result.get("transformers_compiled_error")), flush=True)
    print("wrote", save(result, a.out, stem))
    render(result, a.out, stem)  # the markdown always; the plots where matplotlib is installed
    print("wrote", os.path.join(a.out, f"{stem}.md"))


if __name__ == "__main__":
    main()
