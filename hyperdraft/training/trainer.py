"""Train an EAGLE-3 head on the target's own answers, with EAGLE-3's training-time test.

Per sample (prompt + the target's answer, tokens t_0 .. t_{T-1}; a step trains batch_size samples, padded to one
length, each attending only within itself):
  1. The frozen target runs the sequence: its aux states (the outputs of the head's three target layers) and its
     logits at every position; softmax over the draft vocabulary is the soft label.
  2. Head position i (RoPE position i) is fed token t_{i+1} and predicts t_{i+2}, labelled by the target's logits
     at position i + 1, exactly as the head runs at inference (models/eagle.py's alignment).
  3. Step 0 is fed fc(aux states); step s >= 1 is fed the head's own step-(s-1) output at position i - 1, with the
     attention of unroll_attention.py, so every position is also trained as the s-th draft of a chain.
     Step s is valid from position s on, and counts only where t_{i+2} is an answer token.
Loss: cross-entropy against the soft label (with cfg.hard_label_weight, mixed with cross-entropy against the target's
argmax: loss.py), step s weighted STEP_DECAY^s, averaged over each sample's positions and then over the batch.
Accuracy at step s: the head's argmax (as a target id) equals the target's argmax, i.e. greedy acceptance of the s-th
draft given the earlier ones.

Each prompt is answered once per temperature (cfg.temperatures). validation_fraction of the prompts, with all their
answers, are held out (plan.split_samples: a seeded shuffle; recorded in the checkpoint and beside the head, so a
resumed run keeps it and an --init run holds out its head's): never trained on, not counted in the draft
vocabulary. After each epoch the head is scored on them, and the published head (config.json,
model.safetensors) is rewritten only when its estimated accept length beats every earlier epoch's, so a head that
has begun to memorise its training answers does not replace a better one; the checkpoint (for --resume) always holds
the last epoch's head. With nothing held out every epoch's head is published.
A run may start from a published head (cfg.init): its weights, and the draft vocabulary, aux layers and MLP width they
were trained with; the optimizer and the lr schedule start afresh. That adds epochs, or other answers, to a head
without training it again from nothing.
The lr warms up linearly over the first 2% of the optimizer steps, then decays along a cosine to 0.1 x lr at the
last step (plan.lr_schedule).

The head is the inference module itself (models/eagle.Eagle3Head), run through the torch reference paths
(RuntimeOptions without fused kernels: Triton launches have no backward), so what is trained is what runs. Its
parameters and AdamW stay fp32; with a bf16 target its forward and logits run under bf16 autocast, the loss in fp32.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random

import torch
import torch.nn.functional as F

from hyperdraft import options
from hyperdraft.models.config import load_model_config
from hyperdraft.models.decoder import rotated
from hyperdraft.models.eagle import Eagle3Head, default_aux_layer_ids, eagle_config_from_dict, target_capture_layers
from hyperdraft.models.loader import load_model
from hyperdraft.training.draft_vocab import DraftVocab, frequent_tokens
from hyperdraft.training.head_io import (PublishedHead, head_config, load_checkpoint, read_head, save_checkpoint,
                                        save_head, write_held_out)
from hyperdraft.training.loss import draft_index, step_loss
from hyperdraft.training.plan import (accept_length_estimate, lr_schedule, prompt_key, split_by_prompts,
                                      split_samples)
from hyperdraft.training.plot import append_log, plot_log, start_log
from hyperdraft.training.samples import (EngineOnDemand, Sample, SampleStore, answer, load_prompts,
                                         refuse_evaluation_prompts, self_written_prompts)
from hyperdraft.training.train_config import TrainConfig
from hyperdraft.training.unroll_attention import UnrollAttention

logger = logging.getLogger(__name__)

STEP_DECAY = 0.8  # EAGLE-3's weighting of later unrolled steps
GRAD_CLIP = 0.5
SAMPLES = "samples.jsonl"  # the target's answers, appended as they are made (a stopped run resumes them)
SAMPLES_COPY = "samples_{}.jsonl"  # the answers at the c-th temperature, c >= 1
SELF_PROMPTS = "self_prompts.jsonl"
LOG_EVERY = 25  # samples per logged point
# What a resumed run must be given as the checkpoint was made (its samples, vocabulary and optimizer carry them on)
RESUME_FIXED = ("model", "prompts", "num_samples", "self_prompts", "max_len", "lr", "draft_vocab_size",
                "temperatures", "batch_size", "ttt_steps", "hard_label_weight")  # (the head's width: checked by shape)


def train_draft(cfg: TrainConfig) -> dict:
    """Train (or resume) and write the head to cfg.out -> the last epoch's metrics."""
    cfg.check()
    target_config = load_model_config(cfg.model)
    cfg.check_against(target_config.vocab_size)
    init = read_head(cfg.init, target_config) if cfg.init else None
    if init:  # refused before anything is answered
        init.refuse_other(cfg.aux_layer_ids, cfg.head_intermediate_size, cfg.draft_vocab_size)
    aux_ids = init.aux_layer_ids if init else _aux_layer_ids(cfg, target_config.num_layers)
    os.makedirs(cfg.out, exist_ok=True)
    torch.manual_seed(cfg.seed)
    state = _resume_state(cfg) if cfg.resume else None
    samples = [Sample(*s) for s in state["samples"]] if state else _make_samples(cfg)
    train, held_out = _split(cfg, samples, state, init)
    device = torch.device(cfg.device)
    target = load_model(cfg.model, cfg.dtype, device)
    vocab = _draft_vocab(cfg, state, init, train, target.config.vocab_size)
    width = init.intermediate_size if init else cfg.head_intermediate_size
    config = head_config(target.config, int(vocab.target_ids.numel()), aux_ids, width)
    head = _new_head(config, target, vocab, aux_ids, device)
    if init:
        init.load_into(head)
    draft_ids = vocab.target_ids.to(device)
    coverage = vocab.coverage([s.token_ids[s.answer_start:] for s in held_out])  # the same every epoch
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr)
    # The batch count of an epoch depends only on the training samples and batch_size, not on the shuffle.
    scheduler = lr_schedule(optimizer, cfg.epochs * len(_batches(train, cfg.batch_size, random.Random(0))))
    first_epoch, best = _resumed(state, aux_ids, config, target, head, optimizer, scheduler) if state else (0, -math.inf)
    start_log(cfg.out, first_epoch, len(train))
    metrics: dict = {}
    with options.activated(reference_paths()):
        for epoch in range(first_epoch, cfg.epochs):
            metrics = _epoch(cfg, epoch, train, target, head, draft_ids, optimizer, scheduler)
            metrics, best = _validate_and_publish(cfg, epoch, metrics, held_out, target, head, draft_ids, config, best,
                                                  coverage)
            save_checkpoint(cfg.out, {"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                                      "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best,
                                      "validation_fraction": cfg.validation_fraction, "seed": cfg.seed,
                                      "aux_layer_ids": aux_ids, "made_with": _made_with(cfg),
                                      "held_out_prompts": sorted(map(prompt_key, held_out)),
                                      "samples": [dataclasses.astuple(s) for s in samples],
                                      "vocab": vocab.target_ids, "metrics": metrics})
            plot_log(cfg.out)
    # A resume with nothing left to train still writes the layout; with a held-out set the best head was written
    # before the checkpoint that counts its epoch, and the checkpoint's (last) head must not replace it.
    if first_epoch >= cfg.epochs and not held_out:
        save_head(cfg.out, config, head, next(target.parameters()).dtype)
    return metrics


def _resumed(state: dict, aux_ids: tuple[int, ...], config: dict, target, head: Eagle3Head, optimizer,
             scheduler) -> tuple[int, float]:
    """The checkpoint's head, optimizer and schedule into this run's -> (the first epoch left, the best score)."""
    trained_ids = tuple(state.get("aux_layer_ids", default_aux_layer_ids(target.config.num_layers)))  # older ones
    if trained_ids != aux_ids:
        raise ValueError(f"--resume: aux_layer_ids {list(aux_ids)} differ from the checkpoint's {list(trained_ids)}")
    trained_width = state["head"]["midlayer.mlp.down_proj.weight"].shape[1]
    if trained_width != config["intermediate_size"]:
        raise ValueError(f"--resume: head_intermediate_size {config['intermediate_size']} differs from the "
                         f"checkpoint's {trained_width}")
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["epoch"] + 1, state["best"]


def _split(cfg: TrainConfig, samples: list[Sample], state: dict | None,
           init: PublishedHead | None) -> tuple[list[Sample], list[Sample]]:
    """(training, held out): a resumed run's recorded split; an --init run's, the prompts its head held out (so none
    it trained on is scored as unseen); else the seeded split. Recorded beside the head for later --init runs."""
    recorded = state.get("held_out_prompts") if state else None  # None: a checkpoint from before the record
    if recorded is None and init is not None and cfg.validation_fraction > 0:
        recorded = init.held_out
        if recorded is None:
            logger.warning("--init: the head records no held-out prompts (trained before they were recorded), so this "
                           "run's split may hold out prompts it trained on, and their scores read high")
    if recorded is not None:
        train, held_out = split_by_prompts(samples, frozenset(recorded))
        if not held_out and cfg.validation_fraction > 0:
            logger.warning("none of this run's prompts is among the --init head's held-out ones: nothing is held out")
    else:
        train, held_out = split_samples(samples, cfg.validation_fraction, cfg.seed)
    write_held_out(cfg.out, frozenset(map(prompt_key, held_out)))
    return train, held_out


def _draft_vocab(cfg: TrainConfig, state: dict | None, init: PublishedHead | None, train: list[Sample],
                 vocab_size: int) -> DraftVocab:
    """The checkpoint's (--resume), the --init head's, or the training answers' most frequent tokens."""
    if state:
        return DraftVocab(state["vocab"])
    if init:
        return init.vocab
    return frequent_tokens([s.token_ids[s.answer_start:] for s in train], vocab_size,
                           cfg.draft_vocab_size or vocab_size)


def reference_paths() -> options.RuntimeOptions:
    """The current options with every Triton and CUDA kernel off: autograd cannot go through them, so the target and
    the head train on the torch reference paths."""
    return dataclasses.replace(options.current(), fused_kernels=False, gemv=False, cuda_kernels=False)


def _aux_layer_ids(cfg: TrainConfig, num_layers: int) -> tuple[int, ...]:
    """The head's aux layers: three distinct outputs of layers 0 .. num_layers - 2. The last layer's output is left
    out because SGLang's target forward never captures it (it captures layer inputs inside its layer loop), so a head
    reading it would not load there."""
    if cfg.aux_layer_ids is None:
        return default_aux_layer_ids(num_layers)
    ids = tuple(sorted(cfg.aux_layer_ids))
    if len(ids) != 3 or len(set(ids)) != 3 or not all(0 <= i <= num_layers - 2 for i in ids):
        raise ValueError(f"aux_layer_ids {list(cfg.aux_layer_ids)}: give 3 distinct layers in [0, {num_layers - 2}] "
                         f"(the target has num_layers={num_layers})")
    return ids


def _resume_state(cfg: TrainConfig) -> dict:
    state = load_checkpoint(cfg.out)
    if "scheduler" not in state:
        raise ValueError(f"--resume: {cfg.out}'s checkpoint predates the lr schedule and the held-out split: train "
                         "again without --resume (the stored answers, samples*.jsonl, are reused)")
    for name in ("validation_fraction", "seed"):  # either would move prompts between the held-out and trained sides
        if state[name] != getattr(cfg, name):
            raise ValueError(f"--resume: {name} {getattr(cfg, name)} differs from the checkpoint's {state[name]} (the "
                             "held-out prompts would change)")
    # A resumed run continues the checkpoint's samples, vocabulary and optimizer: another value of these would be
    # ignored without a word. (Checkpoints before session 37 recorded none of them.)
    for name, value in state.get("made_with", {}).items():
        if _as_recorded(getattr(cfg, name)) != _as_recorded(value):
            raise ValueError(f"--resume: {name} {getattr(cfg, name)!r} differs from the checkpoint's {value!r}: the "
                             "run continues with the checkpoint's; give its value, or start a new run")
    return state


def _made_with(cfg: TrainConfig) -> dict:
    return {name: _as_recorded(getattr(cfg, name)) for name in RESUME_FIXED}


def _as_recorded(value):
    """A path that exists as its absolute path (a resume given the same file by a relative path is the same run)."""
    return os.path.abspath(value) if isinstance(value, str) and os.path.exists(value) else value


def _make_samples(cfg: TrainConfig) -> list[Sample]:
    llm = EngineOnDemand(cfg.model, cfg.device, cfg.dtype)
    try:
        # The file's prompts keep their indices in the answer store, so a run that adds written prompts to an
        # earlier file-only run answers only the new ones.
        written = cfg.self_prompts if cfg.prompts is not None else cfg.num_samples
        prompts = load_prompts(cfg.prompts)[: cfg.num_samples] if cfg.prompts is not None else []
        if written:
            prompts += self_written_prompts(llm, written, cfg.seed, os.path.join(cfg.out, SELF_PROMPTS))
        refuse_evaluation_prompts(prompts)
        samples: list[Sample] = []
        for c, temperature in enumerate(cfg.temperatures):  # copy c's seeds follow copy c - 1's: no answer shares one
            store = SampleStore(os.path.join(cfg.out, SAMPLES if c == 0 else SAMPLES_COPY.format(c)),
                                dict(model=cfg.model, temperature=temperature, max_len=cfg.max_len, seed=cfg.seed))
            samples += answer(llm, prompts, cfg.max_len, temperature, cfg.seed + c * len(prompts), store)
    finally:
        llm.shutdown()
    if not samples:
        raise ValueError("no training samples: every prompt was too long for --max-len, or every answer was empty")
    return samples


def _new_head(config: dict, target, vocab: DraftVocab, aux_ids, device) -> Eagle3Head:
    cfg = eagle_config_from_dict(config)
    head = Eagle3Head(cfg, target, own_embed=False, own_lm_head=True, aux_layer_ids=aux_ids).to(device)
    with torch.no_grad():
        head.d2t.copy_(vocab.d2t)
        head.t2d.copy_(vocab.t2d(cfg.vocab_size))
        # Start from the target's own output rows: the head regresses (normed) states the target's lm_head reads.
        head.lm_head.weight.copy_(target.lm_head.weight[vocab.target_ids.to(device)].float())
    head.finish_loading()
    return head.float().train()


def _epoch(cfg: TrainConfig, epoch: int, samples: list[Sample], target, head: Eagle3Head, draft_ids: torch.Tensor,
           optimizer, scheduler) -> dict:
    from tqdm import tqdm

    whole, window = _Totals(cfg.ttt_steps), _Totals(cfg.ttt_steps)
    bar = tqdm(total=len(samples), desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not cfg.progress)
    done = 0
    for batch in _batches(samples, cfg.batch_size, random.Random(cfg.seed + epoch)):
        loss, correct, counted = _batch_loss(batch, target, head, draft_ids, cfg.ttt_steps, cfg.hard_label_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), GRAD_CLIP)
        optimizer.step()
        lr = scheduler.get_last_lr()[0]  # the lr this step ran at
        scheduler.step()
        for totals in (whole, window):
            totals.add(float(loss.detach()), correct, counted)
        done += len(batch)
        bar.update(len(batch))
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
        if window.samples * cfg.batch_size >= LOG_EVERY or done == len(samples):  # the curves' points: window means
            append_log(cfg.out, {"kind": "window", "step": epoch * len(samples) + done, **window.means(), "lr": lr})
            window = _Totals(cfg.ttt_steps)
    return {"epoch": epoch + 1, "step": (epoch + 1) * len(samples), **whole.means()}


def _validate_and_publish(cfg: TrainConfig, epoch: int, metrics: dict, held_out: list[Sample], target,
                          head: Eagle3Head, draft_ids: torch.Tensor, config: dict, best: float,
                          vocab_coverage: float) -> tuple[dict, float]:
    """Score the epoch's head on the held-out samples (vocab_coverage: the share of their answer tokens the draft
    vocabulary holds); publish it when it beats every earlier epoch's (with nothing held out, always: a run stopped
    by a time limit leaves a usable head behind); log the epoch.
    -> (the epoch's metrics, the best score so far)."""
    published = True
    if held_out:
        validation = {**_validate(cfg, held_out, target, head, draft_ids), "vocab_coverage": vocab_coverage}
        append_log(cfg.out, {"kind": "validation", "epoch": epoch + 1, "step": metrics["step"],
                       **validation})
        published = validation["accept_length_estimate"] > best
        best = max(best, validation["accept_length_estimate"])
        metrics = {**metrics, "validation": validation}
    metrics = {**metrics, "published": published}
    if published:
        save_head(cfg.out, config, head, next(target.parameters()).dtype)
    append_log(cfg.out, {"kind": "epoch", **metrics})
    return metrics, best


def _validate(cfg: TrainConfig, held_out: list[Sample], target, head: Eagle3Head, draft_ids: torch.Tensor) -> dict:
    totals = _Totals(cfg.ttt_steps)
    ordered = sorted(held_out, key=lambda s: len(s.token_ids))  # less padding; a sample's loss ignores its batch
    with torch.no_grad():
        for start in range(0, len(ordered), cfg.batch_size):
            batch = ordered[start:start + cfg.batch_size]
            loss, correct, counted = _batch_loss(batch, target, head, draft_ids, cfg.ttt_steps,
                                                 cfg.hard_label_weight)
            totals.add(float(loss), correct, counted, weight=len(batch))  # the mean over samples, not batches
    means = totals.means()
    return {**means, "accept_length_estimate": accept_length_estimate(means["accuracy_by_step"])}


class _Totals:
    def __init__(self, steps: int):
        self.loss, self.samples = 0.0, 0  # samples: the weights' sum (batches, while training)
        self.correct, self.counted = [0.0] * steps, [0.0] * steps

    def add(self, loss: float, correct: list[float], counted: list[float], weight: int = 1) -> None:
        self.loss, self.samples = self.loss + loss * weight, self.samples + weight
        self.correct = [a + b for a, b in zip(self.correct, correct)]
        self.counted = [a + b for a, b in zip(self.counted, counted)]

    def means(self) -> dict:
        return {"loss": self.loss / max(1, self.samples),
                "accuracy_by_step": [c / max(1.0, n) for c, n in zip(self.correct, self.counted)]}


def _batches(samples: list[Sample], size: int, rng: random.Random) -> list[list[Sample]]:
    """The epoch's batches: a shuffled order, cut into groups of 8 batches whose samples are sorted by length (less
    padding), the batches shuffled again."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    group = 8 * size
    batches = []
    for g in range(0, len(order), group):
        chunk = sorted(order[g:g + group], key=lambda i: len(samples[i].token_ids))
        batches += [[samples[i] for i in chunk[b:b + size]] for b in range(0, len(chunk), size)]
    rng.shuffle(batches)
    return batches


def _batch_loss(batch: list[Sample], target, head: Eagle3Head, draft_ids: torch.Tensor, steps: int,
                hard_weight: float):
    """-> (the batch's mean weighted loss, correct drafts per step, counted positions per step)."""
    device, b = draft_ids.device, len(batch)
    lens = torch.tensor([len(s.token_ids) for s in batch], device=device)[:, None]  # [B, 1]
    length = max(len(s.token_ids) for s in batch)
    ids = torch.tensor([s.token_ids + [0] * (length - len(s.token_ids)) for s in batch], device=device)  # [B, L]
    with torch.no_grad():
        final, captured = target(ids.flatten(), torch.arange(length, device=device).repeat(b), causal_within(b),
                                 target_capture_layers(head))
        labels = target.compute_logits(final).view(b, length, -1)[:, 1:length - 1]  # [B, n, V]
    n = length - 2  # head position i predicts t_{i+2}: labelled by the target's logits at i + 1
    soft = torch.softmax(labels[..., draft_ids], dim=-1)  # [B, n, Vd]
    target_top = labels.argmax(-1)  # [B, n]
    top, top_ok = draft_index(draft_ids, target_top)
    rows = torch.arange(n, device=device)
    answer_start = torch.tensor([s.answer_start for s in batch], device=device)[:, None]
    in_answer = (rows + 2 >= answer_start) & (rows + 2 < lens)  # [B, n]: answer tokens, not padding
    tokens, positions = ids[:, 1:length - 1].flatten(), rows.repeat(b)
    # The head's fp32 matmuls, which get no tensor cores, dominated GPU training time; under a bf16 target they run
    # in bf16 (parameters and AdamW stay fp32). Not for fp16: its gradients would need a GradScaler against
    # underflow. Not for fp32: that path stays exact.
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=next(target.parameters()).dtype == torch.bfloat16):
        hidden = head.project_target_hidden(torch.cat(captured, -1).view(b, length, -1)[:, :n].flatten(0, 1).float())
        attention = UnrollAttention(b)
        loss = torch.zeros((), device=device)
        correct, counted = [], []
        for s in range(steps):
            out = head(tokens, positions, hidden, attention)  # [B * n, H]
            log_q = F.log_softmax(head.compute_draft_logits(out).float(), dim=-1).view(b, n, -1)
            valid = in_answer & (rows >= s)
            weight = valid.float() / valid.sum(1, keepdim=True).clamp_min(1)  # each sample's positions average to 1
            loss = loss + STEP_DECAY ** s * (step_loss(soft, log_q, top, top_ok, hard_weight) * weight).sum() / b
            correct.append(((draft_ids[log_q.argmax(-1)] == target_top) & valid).sum())
            counted.append(valid.sum())
            out = out.view(b, n, -1)  # step s + 1 at i is fed step s at i - 1
            hidden = torch.cat([out.new_zeros(b, 1, out.shape[-1]), out[:, :-1]], dim=1).flatten(0, 1)
    return loss, torch.stack(correct).tolist(), torch.stack(counted).tolist()


def causal_within(batch: int):
    """The teacher's attention over `batch` whole sequences of one length packed back to back (no paged cache)."""

    def attend(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope=None) -> torch.Tensor:
        q, k = rotated(q, k, rope)
        q, k, v = (t.view(batch, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).flatten(0, 1)

    return attend

