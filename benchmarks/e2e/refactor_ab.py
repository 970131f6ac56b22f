"""A/B of two source trees on one GPU: plain decode at batch 1 and 8, and EAGLE-3 chain 5 at simulated acceptance 0.8
at batch 1 and 8, on the 8B-shaped target with random weights, timed as gpu_bench times them (median step time of
several runs, tokens pooled).

It measures whatever `hyperdraft` is importable, and uses only the API every version has (EngineArgs, Engine,
add_request, step), so the same file times a tree from before a refactor and one after it: run it once per tree, in
alternation, on one machine, and compare the JSON files it writes. It is self-contained on purpose (the shared
benchmark helpers follow the current tree's API).

  PYTHONPATH=OLD_TREE python benchmarks/e2e/refactor_ab.py --tag before --out $OUT
  PYTHONPATH=.        python benchmarks/e2e/refactor_ab.py --tag after  --out $OUT
  python benchmarks/e2e/refactor_ab.py --report DIR     (the markdown table of every run in DIR)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import tempfile
import time

TARGET = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
    rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16",
    rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192),
)
HEAD_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "torch_dtype")
INPUT_LEN, OUTPUT_LEN = 512, 256
RUNS = {1: 6, 8: 2}  # decode runs per batch size (batch 1 swings with host jitter; the median drops the slow ones)


def write_configs(root: str) -> tuple[str, str]:
    target, head = os.path.join(root, "target"), os.path.join(root, "eagle3")
    for path in (target, head):
        os.makedirs(path, exist_ok=True)
    json.dump(TARGET, open(os.path.join(target, "config.json"), "w"))
    n = TARGET["num_hidden_layers"]
    head_cfg = {k: TARGET[k] for k in HEAD_KEYS}
    head_cfg.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, tie_word_embeddings=False,
                    draft_vocab_size=32000,
                    eagle_config={"eagle_aux_hidden_state_layer_ids": [1, n // 2 - 1, n - 4], "use_aux_hidden_state": True})
    json.dump(head_cfg, open(os.path.join(head, "config.json"), "w"))
    return target, head


def decode_run(engine, bs: int, seed: int) -> tuple[int, int, float]:
    """Prefill bs random prompts, then time the decode steps -> (tokens, steps, seconds)."""
    import torch

    from hyperdraft.sampling_params import SamplingParams

    prompts = torch.randint(10, TARGET["vocab_size"] - 10, (bs, INPUT_LEN), generator=torch.Generator().manual_seed(seed))
    params = SamplingParams(temperature=0.0, max_new_tokens=OUTPUT_LEN, ignore_eos=True)
    reqs = [engine.add_request(input_ids=p, params=params) for p in prompts.tolist()]
    while any(not r.output_ids for r in reqs):
        engine.step()
    torch.cuda.synchronize()
    tokens0, steps, start = sum(len(r.output_ids) for r in reqs), 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return sum(len(r.output_ids) for r in reqs) - tokens0, steps, time.perf_counter() - start


def measure(engine, bs: int) -> dict:
    runs = [decode_run(engine, bs, seed=bs + 1000 * i) for i in range(RUNS[bs])]
    tokens, steps = sum(r[0] for r in runs), sum(r[1] for r in runs)
    step_ms = statistics.median(1000 * r[2] / r[1] for r in runs)
    return {"batch": bs, "tok_per_s": tokens / steps / step_ms * 1000, "tokens_per_step": tokens / steps,
            "step_ms": step_ms, "runs_tok_per_s": [r[0] / r[2] for r in runs]}


def run(tag: str, out: str) -> str:
    import torch

    import hyperdraft
    from hyperdraft.config import EngineArgs
    from hyperdraft.engine.engine import Engine

    target, head = write_configs(tempfile.mkdtemp(prefix="refactor_ab_"))
    base = dict(model_path=target, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                max_running_requests=8, cuda_graph_max_bs=8, max_total_tokens=8 * (INPUT_LEN + OUTPUT_LEN + 64),
                context_length=4096)
    chain5 = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=5,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=6, speculative_simulate_accept_rate=0.8)
    result = {"tag": tag, "tree": os.path.dirname(os.path.dirname(os.path.abspath(hyperdraft.__file__))),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    for name, extra in (("plain", {}), ("chain5_a0.8", chain5)):
        engine = Engine(EngineArgs.from_kwargs(**base, **extra))
        decode_run(engine, 1, seed=0)  # warm-up: Triton compiles the prefill shapes
        result["rows"][name] = [measure(engine, bs) for bs in (1, 8)]
        print(tag, name, [(r["batch"], round(r["tok_per_s"], 1)) for r in result["rows"][name]], flush=True)
        del engine
        torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"refactor_ab_{tag}_{int(time.time())}.json")
    json.dump(result, open(path, "w"), indent=1)
    return path


def report(folder: str) -> str:
    """Per row and batch: each tag's runs (tok/s), the mean per tag, and after / before."""
    results = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(folder, "refactor_ab_*.json")))]
    lines = ["| row | batch | before tok/s (each run) | after tok/s (each run) | after / before |", "|---|---|---|---|---|"]
    for name in results[0]["rows"]:
        for i, bs in enumerate((1, 8)):
            per_tag = {tag: [r["rows"][name][i]["tok_per_s"] for r in results if r["tag"] == tag] for tag in ("before", "after")}
            mean = {tag: statistics.mean(v) for tag, v in per_tag.items()}
            cells = {tag: ", ".join(f"{v:.1f}" for v in vals) for tag, vals in per_tag.items()}
            lines.append(f"| {name} | {bs} | {cells['before']} | {cells['after']} | {mean['after'] / mean['before']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tag", help="before | after")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--report", metavar="DIR", help="print the table of the runs in DIR")
    a = ap.parse_args()
    if a.report:
        print(report(a.report))
        return
    print("wrote", run(a.tag, a.out))
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
