"""Tensor parallelism on two GPUs: per-token latency and throughput of TP 2 against TP 1 in the same run, on random
bf16 weights of a Llama-3.1-8B shape (load_format="dummy"), plain decoding and EAGLE-3 chain 5 at simulated
acceptance 0.8 (its head replicated on both ranks), CUDA graphs with the all-reduces inside (the small ones through
the push kernel, the default; --all-reduce-rows compares it with NCCL's) and one eager row;
then a target that does not fit one GPU (a Llama-3.1-70B shape, 141 GB in bf16) on two.

Each row: input 512 random tokens, output 256, the median step time of several decode runs (engines.median_run).
Ideal TP 2 speed-up at batch 1 is 2x (each GPU reads half the weights); the all-reduces (two per layer) and the
unsplit parts (norms, the replicated head) take from it.

  python -m benchmarks.e2e.tp_bench --out $OUT            # two GPUs -> $OUT/tp_bench_<device>.md and .json
  python -m benchmarks.e2e.tp_bench --tiny                # CPU smoke test (gloo, tiny shapes)
  python -m benchmarks.e2e.tp_bench --all-reduce-rows     # 8B: TP 2 with NCCL's all-reduces against the push kernel's
  python -m benchmarks.e2e.tp_bench --head-rows           # 8B chain 5: the EAGLE-3 head whole on each rank or split
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import tempfile

import torch
import torch.multiprocessing as mp

from benchmarks.common import command_line, cpu_name, device_tag, git_commit, require_cuda
from benchmarks.e2e.engines import LLAMA_8B, TINY, eagle3_spec, make_engine, median_run, write_configs

LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8)
INPUT_LEN, OUTPUT_LEN, MAX_BS = 512, 256, 8
LLAMA_1B = dict(LLAMA_8B, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, tie_word_embeddings=True)  # Llama-3.2-1B: a STANDALONE draft
BIG_CAPACITY = 4096  # K/V tokens beside a 70.6 GB part on an 80 GB GPU: batch 4 of 512 + 256 fits, batch 8 would queue
CHAIN5 = (5, 1, 6)


def write_config(path: str, cfg: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def spec_args(name: str | None, drafts: dict[str, str]) -> dict:
    """EngineArgs of a row's speculation: chain5 = EAGLE-3 chain 5, standalone5 = a Llama-1B-shaped draft model's
    chain 5; both at simulated acceptance 0.8 (LOSSY: speed only)."""
    if name == "chain5":
        return eagle3_spec(drafts["head"], *CHAIN5, alpha=0.8)
    if name == "standalone5":
        return dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=drafts["draft"],
                    speculative_num_steps=5, speculative_eagle_topk=1, speculative_num_draft_tokens=6,
                    speculative_simulate_accept_rate=0.8)
    return {}


def run_rows(target: str, drafts: dict[str, str], device: str, rows: list[tuple], capacity: int,
             repeats: int, results: list[dict], save) -> list[dict]:
    """rows: (tp_size, speculation name or None, batch sizes, extra engine args[, RuntimeOptions switches]). One engine
    per row, each in a fresh process on CUDA: the 70B part needs the whole GPU, and torch's symmetric memory maps the
    push all-reduce's buffers for one engine per process (a later one would fall back to NCCL). Rows are appended to
    `results` and `save()` runs after each, so a run cut short by a time limit still leaves its report."""
    for tp, spec_name, batches, extra, *switches in rows:
        row_args = (target, drafts, device, tp, spec_name, batches, extra, capacity, repeats,
                    switches[0] if switches else {})
        results += measure_row(*row_args) if device == "cpu" else measure_in_fresh_process(row_args)
        save()
        gc.collect()
    return results


def _measure_into(path: str, row_args: tuple) -> None:
    with open(path, "w") as f:
        json.dump(measure_row(*row_args), f)


def measure_in_fresh_process(row_args: tuple) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")
        proc = mp.get_context("spawn").Process(target=_measure_into, args=(path, row_args))
        proc.start()
        proc.join()
        if proc.exitcode != 0 or not os.path.exists(path):
            return [dict(tp=row_args[3], spec=row_args[4] or "plain", error=f"its process exited with {proc.exitcode}")]
        with open(path) as f:
            return json.load(f)


def measure_row(target, drafts, device, tp, spec_name, batches, extra, capacity, repeats, switches) -> list[dict]:
    spec = spec_args(spec_name, drafts)
    name = (spec_name or "plain") + (" (draft split over the ranks)" if switches.get("split_draft_model") else "")
    name += " (head split over the ranks)" if switches.get("split_draft_head") else ""
    if "push_all_reduce" in switches:
        name += " (push all-reduces)" if switches["push_all_reduce"] else " (NCCL all-reduces)"
    try:
        engine, info = make_engine(target, device, MAX_BS, {**spec, "tp_size": tp, **extra}, capacity, **switches)
    except torch.cuda.OutOfMemoryError as e:
        print(f"tp {tp} {name}: out of memory", flush=True)
        return [dict(tp=tp, spec=name, error=f"out of memory at build: {str(e)[:160]}")]
    results = []
    try:
        weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        for bs in batches:
            row = median_run(engine, bs, INPUT_LEN, OUTPUT_LEN, seed=bs, repeats=repeats * (2 if spec_name else 1))
            row.update(info, tp=tp, spec=name, graphs=not extra.get("disable_cuda_graph", False),
                       rank_weight_GB=weights / 1e9, captured_graphs=info["graphs"],
                       all_reduce="-" if tp == 1 else "push" if engine.lockstep.tp.push is not None else
                       "NCCL" if device == "cuda" else "gloo")
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        engine.close()  # destroys its graphs before the group goes
    return results


def ratio_rows(results: list[dict]) -> list[str]:
    """TP 2 against TP 1 for each (speculation, batch) measured both ways with graphs."""
    key = {(r["spec"], r["batch"], r["tp"]): r for r in results if "error" not in r and r["graphs"]}
    lines = []
    for (spec, bs, tp), r2 in key.items():
        r1 = key.get((spec.split(" (")[0], bs, 1))  # a split-draft row against the TP 1 row of its drafter
        if tp == 2 and r1 is not None:
            lines.append(f"| {spec} | {bs} | {r1['step_ms']:.2f} | {r2['step_ms']:.2f} | "
                         f"{r1['step_ms'] / r2['step_ms']:.2f}x | {r2['tok_per_s'] / r1['tok_per_s']:.2f}x |")
    return lines


def report(results: list[dict], shape_rows: dict[str, list[dict]], device: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if device == "cuda" else cpu_name()
    out = [f"# Tensor parallelism: TP 2 against TP 1 ({device_tag(device)})", "",
           f"- **Date:** {now}. **Device:** {gpu}, torch {torch.__version__}. **Commit:** {git_commit()}.",
           f"- **Command:** `{command_line()}`",
           f"- **What runs:** random bf16 weights, input {INPUT_LEN}, output {OUTPUT_LEN}, CUDA graphs up to batch "
           f"{MAX_BS} with the all-reduces captured inside (the push kernel, kernels/all_reduce.py, for "
           "those that fit, NCCL's for the rest and in rows marked so); EAGLE-3 chain 5 at simulated acceptance "
           "0.8 (LOSSY: speed only), its head whole on every rank unless marked split. Step time = median over the "
           "runs.", "",
           "## Llama-3.1-8B shape", "",
           "| row | batch | TP 1 step ms | TP 2 step ms | latency TP1/TP2 | tok/s TP2/TP1 |", "|---|---|---|---|---|---|",
           *ratio_rows(results), ""]
    for title, rows in shape_rows.items():
        out += [f"## {title}", "", "| TP | row | all-reduces | graphs | batch | step ms | tok/s | accept length | "
                "weights per rank GB |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                out.append(f"| {r['tp']} | {r['spec']} | | | | {r['error']} | | | |")
                continue
            accept = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
            out.append(f"| {r['tp']} | {r['spec']} | {r['all_reduce']} | {'yes' if r['graphs'] else 'no'} | "
                       f"{r['batch']} | {r['step_ms']:.2f} | {r['tok_per_s']:.1f} | {accept} | "
                       f"{r['rank_weight_GB']:.1f} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.tp_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny shapes, gloo")
    ap.add_argument("--no-big", action="store_true", help="skip the 70B shape")
    ap.add_argument("--only-big", action="store_true", help="only the 70B shape")
    ap.add_argument("--draft-rows", action="store_true",
                    help="only the STANDALONE rows: a Llama-1B-shaped draft model for the 8B shape, chain 5, TP 1, "
                         "TP 2 with the draft whole on each rank, TP 2 with it split")
    ap.add_argument("--head-rows", action="store_true",
                    help="only the 8B EAGLE-3 chain 5 rows: TP 1, TP 2 with the head whole on each rank, TP 2 with its "
                         "layers split over the ranks")
    ap.add_argument("--all-reduce-rows", action="store_true",
                    help="only the 8B rows that compare all-reduces: plain and chain 5 at TP 1, TP 2 with NCCL's, "
                         "TP 2 with the push all-reduce")
    ap.add_argument("--repeats", type=int, default=4, help="batch-1 decode runs per plain row (chain rows: twice)")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes to keep from each 8B row")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if not args.tiny:
        require_cuda()
        if torch.cuda.device_count() < 2:
            raise SystemExit("tp_bench needs two GPUs")
    root = tempfile.mkdtemp()
    target, head = write_configs(os.path.join(root, "8b"), TINY if args.tiny else LLAMA_8B, 512 if args.tiny else 32000)
    drafts = {"head": head, "draft": write_config(os.path.join(root, "draft"), dict(TINY, num_hidden_layers=2)
                                                  if args.tiny else LLAMA_1B)}
    capacity = 4096 if args.tiny else 16384
    rows = [(1, None, (1, 8), {}), (2, None, (1, 8), {}), (2, None, (1,), dict(disable_cuda_graph=True)),
            (1, "chain5", (1, 8), {}), (2, "chain5", (1, 8), {})]
    if args.draft_rows:
        rows = [(1, "standalone5", (1, 8), {}), (2, "standalone5", (1, 8), {}),
                (2, "standalone5", (1, 8), {}, dict(split_draft_model=True))]
        args.no_big = True
    if args.head_rows:
        split = dict(split_draft_head=True)
        rows = [(2, "chain5", (1, 8), {}, split), (2, "chain5", (1, 8), {}), (1, "chain5", (1, 8), {})]  # the new first
        args.no_big = True
    if args.all_reduce_rows:
        nccl, push = dict(push_all_reduce=False), dict(push_all_reduce=True)
        rows = [(1, None, (1, 8), {}), (2, None, (1, 8), {}, nccl), (2, None, (1, 8), {}, push),
                (2, "chain5", (1, 8), {}, push), (2, "chain5", (1, 8), {}, nccl), (1, "chain5", (1, 8), {})]
        args.no_big = True
    keep = {int(b) for b in args.batches.split(",")}
    rows = [(tp, spec, tuple(b for b in batches if b in keep), *rest) for tp, spec, batches, *rest in rows
            if keep & set(batches)]
    repeats = 1 if args.tiny else args.repeats
    results: list[dict] = []
    shapes = {} if args.only_big else {"Llama-3.1-8B shape, every row": results}
    save = functools.partial(save_report, results, shapes, device, args)
    if not args.only_big:
        run_rows(target, drafts, device, rows, capacity, repeats, results, save)
    if not args.no_big:
        big_cfg = dict(TINY, num_hidden_layers=16) if args.tiny else LLAMA_70B
        big, big_head = write_configs(os.path.join(root, "70b"), big_cfg, 512 if args.tiny else 32000)
        big_rows = [(2, None, (1, 4), {}), (2, "chain5", (1,), {}), (2, "chain5", (1,), {}, dict(split_draft_head=True))]
        shapes["Llama-3.1-70B shape (141 GB of bf16 weights: does not fit one GPU), TP 2"] = big_results = []
        run_rows(big, {"head": big_head}, device, big_rows, BIG_CAPACITY, repeats, big_results, save)
    print(save_report(results, shapes, device, args))


def save_report(results: list[dict], shapes: dict[str, list[dict]], device: str, args) -> str:
    text = report(results, shapes, device)
    if args.only_big:
        text = text.replace("## Llama-3.1-8B shape\n", "## Llama-3.1-8B shape (not run: --only-big)\n")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"tp_bench_{device_tag(device)}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump(shapes, f, indent=1)
    return text


if __name__ == "__main__":
    main()
