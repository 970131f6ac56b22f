"""The parts of a train-draft run around its epochs: which samples are held out, the learning-rate schedule, and the
score that decides which epoch's head is published."""

from __future__ import annotations

import hashlib
import math
import random

import torch

from hyperdraft.training.samples import Sample

WARMUP_SHARE = 50  # warm up over 1/50 of the optimizer steps (at least one)
FINAL_LR = 0.1  # the cosine ends at this share of the peak lr, not at 0: the last steps still learn


def split_samples(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """-> (training, validation), each in the samples' order. The distinct prompts (a sample's tokens before its
    answer) are shuffled by random.Random(seed) and the first int(prompts * fraction) held out with all their
    answers: with several temperatures a prompt has several answers, and one of them in training would make the
    others easy to predict, so the validation score would not measure unseen prompts. With one answer per prompt
    this is a shuffle of the sample indices. Depends only on the samples, so a resumed run splits as the first did."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.token_ids[:s.answer_start]), []).append(i)
    order = list(groups.values())
    random.Random(seed).shuffle(order)
    held = {i for group in order[:int(len(order) * fraction)] for i in group}
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def prompt_key(sample: Sample) -> str:
    """A sample's prompt (its tokens before the answer), hashed: how a held-out set is recorded and matched."""
    return hashlib.sha256(",".join(map(str, sample.token_ids[:sample.answer_start])).encode()).hexdigest()[:16]


def split_by_prompts(samples: list[Sample], held: frozenset[str]) -> tuple[list[Sample], list[Sample]]:
    """-> (training, validation): the samples whose prompt is in `held` (prompt_key) held out, in the samples' order."""
    keys = [prompt_key(s) for s in samples]
    return ([s for s, k in zip(samples, keys) if k not in held], [s for s, k in zip(samples, keys) if k in held])


def lr_schedule(optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first max(1, total_steps // WARMUP_SHARE) steps, then a cosine from the peak down to
    FINAL_LR x the peak at step total_steps - 1. Call step() after each optimizer step. A resume with more epochs
    than the stopped run asked for goes on along the longer run's curve, so its lr rises again."""
    warmup = max(1, total_steps // WARMUP_SHARE)

    def factor(step: int) -> float:
        if step < warmup:  # (step + 1) / (warmup + 1), not step / warmup: the first step does not run at lr 0
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - 1 - warmup)
        return FINAL_LR + (1 - FINAL_LR) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def accept_length_estimate(accuracy_by_step: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: the tokens a greedy chain of len(accuracy_by_step) drafts would commit per
    verification if misses at different steps were independent. They are not (acc_j is measured at every position,
    whatever the earlier drafts did, and a hard position tends to fail every step), so this ranks heads rather than
    predicting the engine's accept length."""
    total, chain = 1.0, 1.0
    for accuracy in accuracy_by_step:
        chain *= accuracy
        total += chain
    return total
