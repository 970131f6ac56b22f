"""Does the one-row norm-in-projection fusion (kernels/norm_gemv.py) change what the real default model says?

Plain greedy decoding of SmolLM2-135M-Instruct in bf16, one request at a time (the fusion serves one-row decodes
only), with RuntimeOptions.fused_norm_gemv on and off; the outputs are compared token for token. Where two outputs
part, both runs' probabilities of their own token at that position are printed: if the fusion only reorders
rounding, the two tokens were nearly tied there (each well below 1). The control is the default mode's existing
spread: plain batched against plain one at a time (benchmarks/results/fidelity_h100.md: 0/20 identical, first
difference at position 16 in the median).

    python -m benchmarks.probes.norm_gemv_fidelity --num-prompts 20 --max-new-tokens 192
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics

from benchmarks.common import command_line, device_tag, git_commit, mt_bench_first_turns, require_cuda
from hyperdraft.llm import LLM
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.options import RuntimeOptions
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.testing.fidelity import compare

ENGINE = dict(device="cuda", dtype="bfloat16", max_total_tokens=1 << 15, cuda_graph_max_bs=32)


def decode(target: str, prompts: list[str], new_tokens: int, fused: bool, batched: bool) -> list[dict]:
    options = dataclasses.replace(RuntimeOptions.from_env(), fused_norm_gemv=fused)
    llm = LLM(target, runtime_options=options, **ENGINE)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True, return_logprob=True)
    ids = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in prompts]
    if batched:
        outs = llm.generate(input_ids=ids, sampling_params=[params] * len(ids), use_tqdm=False)
    else:
        outs = [llm.generate(input_ids=[i], sampling_params=[params], use_tqdm=False)[0] for i in ids]
    llm.shutdown()
    return [{"tokens": o.token_ids, "logprobs": o.meta_info["output_token_logprobs"]} for o in outs]


def partings(a: list[dict], b: list[dict]) -> list[dict]:
    """Per differing output: the first differing position and each run's probability of its own token there."""
    rows = []
    for x, y in zip(a, b):
        at = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), None)
        if at is not None:
            rows.append({"position": at, "p_a": math.exp(x["logprobs"][at]), "p_b": math.exp(y["logprobs"][at])})
    return rows


def summary(name: str, a: list[dict], b: list[dict]) -> dict:
    parts = partings(a, b)
    same = compare([x["tokens"] for x in a], [y["tokens"] for y in b])["identical"]
    return {"row": name, "identical": same, "total": len(a), "partings": parts,
            "median_position": statistics.median(p["position"] for p in parts) if parts else None,
            "max_p_at_parting": max((max(p["p_a"], p["p_b"]) for p in parts), default=None)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.norm_gemv_fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    require_cuda()
    target, prompts = ensure_default_model(), mt_bench_first_turns()[: args.num_prompts]
    fused = decode(target, prompts, args.max_new_tokens, fused=True, batched=False)
    unfused = decode(target, prompts, args.max_new_tokens, fused=False, batched=False)
    batched = decode(target, prompts, args.max_new_tokens, fused=True, batched=True)
    rows = [summary("fusion on against off, one at a time", fused, unfused),
            summary("control: batched against one at a time, fusion on", fused, batched)]
    header = {"device": device_tag("cuda"), "commit": git_commit(), "command": command_line()}
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "partings"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "norm_gemv_fidelity.json"), "w") as f:
        json.dump({**header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
