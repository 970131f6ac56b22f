"""Where CUDA-graph memory goes when an engine captures: per graph runner (the target's, the drafter's, its whole-round
loops), the bytes reserved by its captures and the bytes of the static outputs its graphs keep alive (one set per
captured batch size and shape: logits, hidden states, captured layers). Random weights of SmolLM2-135M's shape and a
random EAGLE-3 head (8192-token draft vocabulary): memory only, the weights do not matter.

  python -m benchmarks.probes.graph_memory --mem-fraction-static 0.85 0.7      # on a GPU -> stdout

Each setting builds one engine (chain 5, graphs to the default max batch size) and reports free memory after the
build, or the error that stopped it.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from benchmarks.probes.prefix_noreuse import SMOLLM2_SHAPE
from hyperdraft import LLM
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model


def output_bytes(outputs: dict) -> int:
    """Bytes of the distinct tensors a runner's captured outputs hold (views of one buffer counted once)."""
    seen, total = set(), 0
    for out in outputs.values():
        if out is None:
            continue
        tensors = list(out) if isinstance(out, tuple) else [out.logits, out.hidden, *out.captured, out.logits_hidden]
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def report(name: str, graphs) -> str:
    if graphs is None:
        return f"| {name} | - | - | - |"
    outputs = graphs.outputs
    return (f"| {name} | {len(outputs)} | {graphs.capture_bytes / 2**20:.0f} | "
            f"{output_bytes(outputs) / 2**20:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.graph_memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mem-fraction-static", type=float, nargs="+", default=[0.85, 0.7])
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    root = tempfile.mkdtemp()
    target = make_tiny_model(root + "/t", "llama", seed=0, **SMOLLM2_SHAPE)
    head = write_random_eagle_checkpoint(root + "/h", target, kind="eagle3", draft_vocab_size=8192, seed=1)
    total = torch.cuda.mem_get_info()[1]
    print(f"{torch.cuda.get_device_name()}, {total / 2**30:.1f} GiB")
    for fraction in args.mem_fraction_static:
        print(f"\n## mem_fraction_static {fraction}, max_running_requests {args.max_running_requests}\n")
        try:
            llm = LLM(target, device="cuda", dtype=args.dtype, mem_fraction_static=fraction,
                      max_running_requests=args.max_running_requests, speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=head, speculative_num_steps=5, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=6)
        except Exception as error:  # the point of the probe: report what stopped the build
            print(f"build failed: {type(error).__name__}: {str(error)[:300]}")
            torch.cuda.empty_cache()
            continue
        engine = llm.engine
        proposer = engine.worker.proposer
        print("| runner | graphs | capture reserved MiB | static outputs MiB |\n|---|---|---|---|")
        print(report("target", engine.runner.graphs))
        print(report("draft head", proposer.runner.graphs))
        print(report("draft loops", proposer.draft_loop))
        free = torch.cuda.mem_get_info()[0]
        print(f"\ngraph max bs {engine.runner.graphs.batch_sizes[-1]}, K/V capacity {engine.kv_capacity_slots} tokens, "
              f"free after build {free / 2**30:.2f} GiB, allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
              f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB")
        llm.shutdown()
        del llm, engine, proposer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
