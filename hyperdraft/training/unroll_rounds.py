"""What the training-time-test unroll predicts the engine accepts, round by round, on a known greedy answer.

The unroll scores every draft step at every head position at once; at inference a chain round anchored at the newest
token ids[m] drafts step s at head position m - 1 + s (trainer.py, unroll_attention.py). Walking the answer round by
round with those drafts gives the accepted drafts of each round the engine must run in fp32, if the head drafts
exactly as it was trained. The tests hold the engine to it (tests/training, tests/gpu); the probe
benchmarks/probes/unroll_rounds.py checks it on a real model and head.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hyperdraft import options
from hyperdraft.models.eagle import Eagle3Head, eagle_config_from_dict, target_capture_layers
from hyperdraft.models.loader import load_model, read_safetensors
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.training.trainer import causal_within, reference_paths
from hyperdraft.training.unroll_attention import UnrollAttention

if TYPE_CHECKING:
    from hyperdraft.llm import LLM


def load_target_and_head(target: str, head_dir: str, device: str = "cpu",
                         aux_layer_ids: tuple[int, ...] | None = None):
    """The target (fp32) and the head train-draft wrote, built as the trainer builds it; aux_layer_ids, when given,
    replaces the config's (to show that a check would see the engine read other layers)."""
    model = load_model(target, "float32", torch.device(device))
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = eagle_config_from_dict(json.load(f))
    head = Eagle3Head(cfg, model, own_embed=False, own_lm_head=True,
                      aux_layer_ids=aux_layer_ids or tuple(cfg.eagle_aux_hidden_state_layer_ids))
    head.load_state_dict(read_safetensors(os.path.join(head_dir, "model.safetensors")), strict=False)
    head.finish_loading()
    return model, head.to(device)


def unrolled_drafts(model, head, ids: list[int], steps: int) -> list[list[int]]:
    """-> [steps][len(ids) - 2] target ids: row s, column i is the head's draft after s earlier ones, at head position
    i (fed ids[i + 1]), as the training-time-test unroll computes it."""
    _, logits = unrolled_logits(model, head, ids, steps)
    return torch.stack([head.draft_to_target[step.argmax(-1)] for step in logits]).tolist()


def unrolled_logits(model, head, ids: list[int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> (the target's final hidden states [len(ids), H], the head's draft logits [steps][len(ids) - 2, Vd]): step s
    at head position i (fed ids[i + 1]) drafts ids[i + 2 + s] after s earlier drafts, as the unroll computes it."""
    t, device = len(ids), head.d2t.device
    tokens = torch.tensor(ids, device=device)
    positions = torch.arange(t, device=device)
    with torch.no_grad(), options.activated(reference_paths()):
        final, captured = model(tokens, positions, causal_within(1), target_capture_layers(head))
        hidden = head.project_target_hidden(torch.cat(captured, -1)[: t - 2])
        attention, logits = UnrollAttention(), []
        for _ in range(steps):
            out = head(tokens[1:t - 1], positions[: t - 2], hidden, attention)
            logits.append(head.compute_draft_logits(out))
            hidden = torch.cat([out.new_zeros(1, out.shape[1]), out[:-1]])
    return final, logits


def predicted_rounds(drafts: list[list[int]], ids: list[int], prompt_len: int, new_tokens: int) -> list[int]:
    """Greedy chain rounds over a known answer (ids = prompt + answer, at least new_tokens + steps + 1 answer tokens):
    the round whose newest token is ids[m] drafts drafts[s][m - 1 + s] for s = 0 .. steps - 1 and accepts the longest
    prefix equal to ids[m + 1 ..]. -> accepted drafts per round, until new_tokens are out."""
    steps, m, emitted, accepted = len(drafts), prompt_len, 1, []  # the prefill emitted ids[prompt_len]
    while emitted < new_tokens:
        a = 0
        while a < steps and drafts[a][m - 1 + a] == ids[m + 1 + a]:
            a += 1
        accepted.append(a)
        emitted, m = emitted + a + 1, m + a + 1
    return accepted


@dataclass(frozen=True)
class Rounds:
    """One prompt's greedy chain rounds: the engine's and the unroll's (round count, accepted drafts)."""

    engine: tuple[int, int]
    unroll: tuple[int, int]
    output_equal: bool  # the speculative output equals plain decoding's


def compare_rounds(plain: LLM, speculative: LLM, model, head: Eagle3Head, prompts: list[list[int]], steps: int,
                   new_tokens: int) -> list[Rounds]:
    """plain, speculative: LLMs on the target (speculative: EAGLE-3 chain of `steps`, the head's directory); model,
    head: load_target_and_head's. Each prompt alone, greedy, new_tokens long."""
    longer = SamplingParams(temperature=0, max_new_tokens=new_tokens + steps + 1, ignore_eos=True)
    answers = [o.token_ids for o in plain.generate(input_ids=prompts, sampling_params=longer, use_tqdm=False)]
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    rows = []
    for prompt, answer in zip(prompts, answers):
        out = speculative.generate(input_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0]
        ids = prompt + answer
        rounds = predicted_rounds(unrolled_drafts(model, head, ids, steps), ids, len(prompt), new_tokens)
        rows.append(Rounds((out.meta_info["spec_verify_ct"], out.meta_info["spec_accepted_tokens"]),
                           (len(rounds), sum(rounds)), out.token_ids == answer[:new_tokens]))
    return rows
