"""The one transform from raw logits to a request's sampling distribution p.

Order: penalties -> temperature -> top-k -> top-p -> min-p, each filter
applied to the distribution left by the one before (renormalised), as HF
transformers and vLLM do. Speculative verification computes the target's p
and, when a draft model samples, the draft's q through this same function,
so p and q always mean the same thing.

Rows are independent: row n has its own parameters (a request's verify rows
all share that request's parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperdraft.core.host_copy import to_device_many
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.logprob import token_logprobs_kernel


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [N] float32, 0 for greedy rows
    top_k: torch.Tensor  # [N] int64, vocab size when disabled
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    greedy: torch.Tensor  # [N] bool
    seeds: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, sequence index of the token each row samples
    penalties: "Penalties | None"
    # Host copies of batch-wide facts, so the transform never reads the device to decide which ops to run.
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    all_greedy: bool
    any_greedy: bool
    # Some row's request asked for logprobs (return_logprob): otherwise no step computes them. A log-softmax over
    # the vocabulary costs a small model's round two launches and ~120 us of host time on an H100 machine.
    want_logprobs: bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], positions: list[int], vocab_size: int, device,
              prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None) -> "SamplingBatch":
        """One entry per row. prompts/outputs (per row) are needed only when some row has penalties, and are read
        only for those rows: a row without penalties (repetition 1, frequency and presence 0) gives the same logits
        whatever its counts, so they stay zero. Every value travels in two host-to-device copies (one float32, one
        int64)."""
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        greedy = [p.is_greedy for p in params]
        floats = [[0.0 if g else p.temperature for p, g in zip(params, greedy)], [p.top_p for p in params],
                  [p.min_p for p in params]]
        ints = [top_k, seeds, positions, greedy]
        penalised = any(p.has_penalties for p in params)
        if penalised:
            floats += [[p.frequency_penalty for p in params], [p.presence_penalty for p in params],
                       [p.repetition_penalty for p in params]]
            counted = [p.has_penalties for p in params]
            ints += [flat_token_index([o if c else [] for o, c in zip(outputs, counted)], vocab_size),
                     flat_token_index([p + o if c else [] for p, o, c in zip(prompts, outputs, counted)], vocab_size)]
        f = to_device_many(floats, torch.float32, device)
        i = to_device_many(ints, torch.int64, device)
        penalties = None
        if penalised:
            penalties = Penalties.from_flat(len(params), vocab_size, i[4], i[5], f[3], f[4], f[5])
        return cls(
            temperature=f[0],
            top_k=i[0],
            top_p=f[1],
            min_p=f[2],
            greedy=i[3].bool(),
            seeds=i[1],
            positions=i[2],
            penalties=penalties,
            need_top_k=any(k < vocab_size for k, g in zip(top_k, greedy) if not g),
            need_top_p=any(p.top_p < 1.0 for p, g in zip(params, greedy) if not g),
            need_min_p=any(p.min_p > 0.0 for p, g in zip(params, greedy) if not g),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            want_logprobs=any(p.return_logprob for p in params),
        )

    def _rows(self, rep, penalties: "Penalties | None") -> "SamplingBatch":
        """Every per-row tensor through rep (the host flags are the same for repeated rows)."""
        return replace(self, temperature=rep(self.temperature), top_k=rep(self.top_k), top_p=rep(self.top_p),
                       min_p=rep(self.min_p), greedy=rep(self.greedy), seeds=rep(self.seeds),
                       positions=rep(self.positions), penalties=penalties)

    def for_verify(self, draft: torch.Tensor) -> "SamplingBatch":
        """B request rows -> B*(K+1) verify rows: row (b, j) samples the token after draft j-1 of request b,
        so it sits at position + j and its penalties also count drafts 0..j-1. draft: [B, K]."""
        k1 = draft.shape[1] + 1
        rows = self._rows(lambda t: t.repeat_interleave(k1, 0),
                          self.penalties.for_verify(draft) if self.penalties is not None else None)
        offsets = torch.arange(k1, device=self.positions.device).repeat(self.positions.shape[0])
        rows.positions = rows.positions + offsets
        return rows

    def repeat_rows(self, k: int) -> "SamplingBatch":
        """Each row repeated k times (same position): for k sibling nodes that share a request's parameters."""
        rep = lambda t: t.repeat_interleave(k, 0)  # noqa: E731
        pen = self.penalties
        if pen is not None:
            pen = Penalties(rep(pen.output_counts), rep(pen.seen), rep(pen.frequency), rep(pen.presence), rep(pen.repetition))
        return self._rows(rep, pen)

    def for_tree(self, tokens: torch.Tensor, ancestor_mask: torch.Tensor, depth: torch.Tensor) -> "SamplingBatch":
        """Rows for the N nodes of each request's tree (B*N rows). Node i samples the token after it, at position
        + depth(i); its penalties count the tokens on its path below the root (the root is already in the output).
        tokens: [B, N]; ancestor_mask: [B, N, N] (self included); depth: [B, N]."""
        bsz, n = tokens.shape
        rows = self.repeat_rows(n)
        rows.positions = rows.positions + depth.flatten()
        if self.penalties is not None:
            onehot = torch.zeros(bsz, n, self.penalties.output_counts.shape[1], device=tokens.device)
            onehot[:, 1:].scatter_(2, tokens[:, 1:, None], 1.0)
            counts = rows.penalties.output_counts + (ancestor_mask.float() @ onehot).flatten(0, 1)
            pen = rows.penalties
            rows.penalties = Penalties(counts, pen.seen | (counts > 0), pen.frequency, pen.presence, pen.repetition)
        return rows

    def at_offset(self, draft_prefix: torch.Tensor) -> "SamplingBatch":
        """Rows for the token after draft_prefix ([B, j]): position + j, penalties counting the prefix too."""
        j = draft_prefix.shape[1]
        pen = self.penalties
        if pen is not None and j:
            counts = pen.output_counts.clone().scatter_add_(1, draft_prefix, torch.ones_like(draft_prefix, dtype=torch.float32))
            pen = Penalties(counts, pen.seen | (counts > 0), pen.frequency, pen.presence, pen.repetition)
        return replace(self, positions=self.positions + j, penalties=pen)


@dataclass
class Penalties:
    output_counts: torch.Tensor  # [N, V] float32, occurrences of each token in the output so far
    seen: torch.Tensor  # [N, V] bool, token occurs in prompt or output (repetition penalty)
    frequency: torch.Tensor  # [N]
    presence: torch.Tensor  # [N]
    repetition: torch.Tensor  # [N]

    @classmethod
    def from_flat(cls, n: int, vocab_size: int, outputs: torch.Tensor, seen: torch.Tensor, frequency: torch.Tensor,
                  presence: torch.Tensor, repetition: torch.Tensor) -> "Penalties":
        """outputs / seen: flat indices row * V + token (flat_token_index) of the output tokens / of prompt and
        output tokens, already on the device. Scatters only: no host sync, no data-dependent shape."""
        device = frequency.device
        pen = cls(torch.zeros(n, vocab_size, dtype=torch.float32, device=device),
                  torch.zeros(n, vocab_size, dtype=torch.bool, device=device), frequency, presence, repetition)
        pen.seen.view(-1).index_fill_(0, seen, True)
        pen.add_outputs(outputs)
        return pen

    def add_outputs(self, flat: torch.Tensor) -> None:
        """Count more output tokens (flat indices row * V + token), in place."""
        self.output_counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))
        self.seen.view(-1).index_fill_(0, flat, True)

    def for_verify(self, draft: torch.Tensor) -> "Penalties":
        bsz, k = draft.shape
        onehot = torch.zeros(bsz, k + 1, self.output_counts.shape[1], device=draft.device)
        onehot[:, 1:].scatter_(2, draft[..., None], 1.0)
        counts = (self.output_counts[:, None] + onehot.cumsum(1)).flatten(0, 1)  # [B*(K+1), V]
        rep = lambda t: t.repeat_interleave(k + 1, 0)  # noqa: E731
        return Penalties(counts, rep(self.seen) | (counts > 0), rep(self.frequency), rep(self.presence), rep(self.repetition))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Repetition penalty (CTRL / HF semantics): shrink positive logits, grow negative ones, of seen tokens.
        rep = self.repetition[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(self.seen, penalised, logits)
        # OpenAI semantics: subtract per-occurrence and once-present penalties of output tokens.
        logits = logits - self.frequency[:, None] * self.output_counts
        return logits - self.presence[:, None] * (self.output_counts > 0).float()


def flat_token_index(lists: list[list[int]], vocab_size: int, first_row: int = 0) -> list[int]:
    """Row r's tokens t -> (first_row + r) * vocab_size + t, all rows in one list."""
    return [(first_row + r) * vocab_size + t for r, lst in enumerate(lists) for t in lst]


def penalised_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    return sb.penalties.apply(logits) if sb.penalties is not None else logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """log softmax(logits[rows])[tokens]; tokens, rows: [M] (rows None: every row, M = N) -> [M]. One log-sum-exp
    reduction per row instead of a full [N, V] log_softmax written out and gathered from; on CUDA two Triton
    launches (kernels/logprob.py)."""
    if use_fused_kernels(logits) and logits.stride(-1) == 1 and logits.dtype == torch.float32:
        return token_logprobs_kernel(logits, tokens, rows)
    if rows is None:
        return logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, -1)
    return logits[rows, tokens] - torch.logsumexp(logits, -1)[rows]


def probs_from_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """logits: [N, V] float32, already penalised -> p: [N, V]. Greedy rows become one-hot at the argmax."""
    if sb.all_greedy:
        return torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    temp = torch.where(sb.greedy, torch.ones_like(sb.temperature), sb.temperature)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if sb.need_top_k or sb.need_top_p or sb.need_min_p:
        probs = _filter(probs, sb)
    if sb.any_greedy:  # a host flag: `if sb.greedy.any()` would be a device-to-host sync
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(sb.greedy[:, None], onehot, probs)
    return probs


def _filter(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep = rank < sb.top_k[:, None]
    if sb.need_top_p:
        # top-p acts on the top-k survivors, renormalised: keep the smallest head whose mass reaches top_p.
        kept = sorted_p * keep
        mass_before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)
        keep &= (mass_before < sb.top_p[:, None]) | (rank == 0)  # a top_p below float32's tiny rounds to 0
    if sb.need_min_p:
        keep &= sorted_p >= sb.min_p[:, None] * sorted_p[:, :1]
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_p * keep)
    return filtered / filtered.sum(-1, keepdim=True)
