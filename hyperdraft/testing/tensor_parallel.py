"""Run a model, or a draft head, split over gloo processes on the CPU (tests of models/tensor_parallel.py).

split_logits spawns tp_size processes once for several models; each loads its part of every model and runs the same
prompts through a plain causal attention; rank 0 writes the gathered logits, which every rank holds after
compute_logits. split_head_logits does the same for EAGLE / EAGLE-3 heads split like their (split) target.
"""

from __future__ import annotations

import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.models.decoder import rotated
from hyperdraft.models.eagle_loader import load_eagle_head
from hyperdraft.models.loader import load_model


def _causal_attention(layer_id, q, k, v, rope=None):
    q, k = rotated(q, k, rope)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def prompt_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's logits [len, V], one causal forward per prompt (no K/V cache)."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden, _ = model(torch.tensor(prompt), torch.arange(len(prompt)), _causal_attention)
            outs.append(model.compute_logits(hidden))
    return outs


def head_logits(head, ids: list[int], aux: torch.Tensor) -> torch.Tensor:
    """A draft head's draft logits [T, Vd] for tokens `ids` whose target states are `aux` ([T, 3H] for EAGLE-3, the
    final normed [T, H] for EAGLE), one causal forward (no K/V cache)."""
    with torch.inference_mode():
        out = head(torch.tensor(ids), torch.arange(len(ids)), head.project_target_hidden(aux), _causal_attention)
        return head.compute_draft_logits(out)


def whole_logits(model_path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    return _model_logits([model_path], prompts, SINGLE)[0]


def whole_head_logits(target_path: str, head_paths: list[str], ids: list[int], aux: list[torch.Tensor]):
    return _head_logits(target_path, head_paths, ids, aux, SINGLE)


def split_logits(model_paths: list[str], prompts: list[list[int]], tp_size: int) -> list[list[torch.Tensor]]:
    """Per model, each prompt's logits from the model split over tp_size processes."""
    return _on_ranks(functools.partial(_model_logits, model_paths, prompts), tp_size)


def split_head_logits(target_path: str, head_paths: list[str], ids: list[int], aux: list[torch.Tensor],
                      tp_size: int) -> list[torch.Tensor]:
    """Per head (aux: its target states), its draft logits with the target and the head's layers split over tp_size
    processes."""
    return _on_ranks(functools.partial(_head_logits, target_path, head_paths, ids, aux), tp_size)


def _model_logits(model_paths: list[str], prompts, tp: TensorParallel) -> list[list[torch.Tensor]]:
    return [prompt_logits(load_model(path, "float32", torch.device("cpu"), tp=tp), prompts) for path in model_paths]


def _head_logits(target_path: str, head_paths: list[str], ids, aux, tp: TensorParallel) -> list[torch.Tensor]:
    target = load_model(target_path, "float32", torch.device("cpu"), tp=tp)
    return [head_logits(load_eagle_head(path, target, tp=tp), ids, states) for path, states in zip(head_paths, aux)]


def _on_ranks(job, tp_size: int):
    """job(tp) on each of tp_size gloo processes -> rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pt")
        mp.spawn(_rank_main, args=(tp_size, job, os.path.join(tmp, "rendezvous"), out_path), nprocs=tp_size, join=True)
        return torch.load(out_path)


def _rank_main(rank: int, size: int, job, rendezvous: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    try:
        result = job(TensorParallel(rank, size))
        if rank == 0:
            torch.save(result, out_path)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # every rank is done: exit without the group's teardown, whose gloo threads can abort a process
    # whose peers have already gone (seen once in CI: "terminate called without an active exception")
