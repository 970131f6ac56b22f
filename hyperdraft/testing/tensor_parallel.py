"""Run a model split over gloo processes on the CPU (tests of models/tensor_parallel.py).

split_logits spawns tp_size processes once for several models; each loads its part of every model and runs the same
prompts through a plain causal attention; rank 0 writes the gathered logits, which every rank holds after
compute_logits.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.models.decoder import rotated
from hyperdraft.models.loader import load_model


def prompt_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logits [len, V], one causal forward per prompt (no K/V cache)."""
    def attn(layer_id, q, k, v, rope=None):
        q, k = rotated(q, k, rope)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                             enable_gqa=True)
        return out.transpose(0, 1)

    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden, _ = model(torch.tensor(prompt), torch.arange(len(prompt)), attn)
            outs.append(model.compute_logits(hidden))
    return outs


def whole_logits(model_path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    return prompt_logits(load_model(model_path, "float32", torch.device("cpu"), tp=SINGLE), prompts)


def split_logits(model_paths: list[str], prompts: list[list[int]], tp_size: int) -> list[list[torch.Tensor]]:
    """Per model, each prompt's logits from the model split over tp_size processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "logits.pt")
        mp.spawn(_rank_main, args=(tp_size, model_paths, prompts, os.path.join(tmp, "rendezvous"), out_path),
                 nprocs=tp_size, join=True)
        return torch.load(out_path)


def _rank_main(rank: int, size: int, model_paths: list[str], prompts, rendezvous: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        logits = [prompt_logits(load_model(path, "float32", torch.device("cpu"), tp=tp), prompts) for path in model_paths]
        if rank == 0:
            torch.save(logits, out_path)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # every rank is done: exit without the group's teardown, whose gloo threads can abort a process
    # whose peers have already gone (seen once in CI: "terminate called without an active exception")
