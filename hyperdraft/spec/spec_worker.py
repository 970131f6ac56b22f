"""SpecWorker: one speculative step for the whole batch.

  draft    the proposer drafts up to K tokens for every decoding request
  verify   one target forward: decoding requests feed [last token, drafts] (TARGET_VERIFY rows), prefill
           chunks ride along in the same forward
  accept   verify_chain picks the accepted drafts plus one recovered/bonus token per request
  commit   the scheduler keeps K/V by length (last token + accepted drafts) and releases the rest; the
           drafter records how much of its own K/V is still valid
One device-to-host copy per step carries every request's tokens, accept counts and logprobs.
"""

from __future__ import annotations

import torch

from hyperdraft.engine.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.engine.model_runner import ModelRunner
from hyperdraft.engine.model_worker import forward_input, sampling_batch
from hyperdraft.engine.scheduler import RequestResult, ScheduledBatch
from hyperdraft.sample.logits_ops import penalised_logits, probs_from_logits
from hyperdraft.sample.sampler import Sampler
from hyperdraft.spec.metrics import SpecMetrics
from hyperdraft.spec.proposal import Proposal
from hyperdraft.spec.rejection import verify_chain
from hyperdraft.spec.spec_config import SpecConfig


class SpecWorker:
    def __init__(self, runner: ModelRunner, proposer, spec: SpecConfig):
        self.runner, self.proposer, self.spec = runner, proposer, spec
        self.sampler = Sampler()
        self.decode_reserve = spec.max_verify_tokens  # the scheduler reserves the widest verify, never less
        self.metrics = SpecMetrics(spec.num_steps)
        self.vocab_size = runner.config.vocab_size

    def run(self, batch: ScheduledBatch) -> list[RequestResult]:
        decodes, prefills = batch.decodes, batch.prefills
        assert all(a is b for a, b in zip(batch.items, decodes + prefills)), "the scheduler puts decodes first"
        reqs = [it.req for it in decodes]
        device = self.runner.device
        steps = self.spec.num_steps
        sb = sampling_batch(decodes, self.vocab_size, device) if decodes else None
        proposal = self.proposer.propose(reqs, steps, sb) if decodes else None
        if decodes:  # never verify past the reserved room (narrower than the full width only when the pool is full)
            room = [self.runner.page_table.num_slots(r.row) - r.num_computed - 1 for r in reqs]
            proposal.lens = [min(k, m) for k, m in zip(proposal.lens, room)]
        self.proposer.prefill(prefills)

        # ---- verify: one target forward over [last, drafts] per decode plus the prefill chunks ----
        inputs = [ForwardInput(r.row, r.num_computed, [0] * (1 + k), 1 + k) for r, k in zip(reqs, proposal.lens)] if decodes else []
        inputs += [forward_input(it) for it in prefills]
        ids, flat_index = self._packed_ids(reqs, proposal, inputs[len(reqs):])
        mode = ForwardMode.TARGET_VERIFY if not prefills else ForwardMode.EXTEND
        out = self.runner.forward(build_forward_batch(mode, inputs, self.runner.page_table, device, input_ids=ids))
        num_verify_rows = flat_index.shape[0] if decodes else 0

        pieces = []
        if decodes:
            pieces += self._accept(reqs, proposal, sb, out.logits[:num_verify_rows], flat_index)
        sampling_prefills = [it for it in prefills if it.samples]
        if sampling_prefills:
            sbp = sampling_batch(sampling_prefills, self.vocab_size, device)
            pieces += list(self.sampler.sample(out.logits[num_verify_rows:], sbp))
        host = torch.cat([x.double().flatten() for x in pieces]).tolist() if pieces else []  # the one D2H copy
        return self._results(batch, proposal, host)

    def _packed_ids(self, reqs, proposal: Proposal | None, prefill_inputs: list[ForwardInput]):
        """Verify ids stay on the device: gather [last, d_0 .. d_{len-1}] of each request from a [B, K+1] grid."""
        device = self.runner.device
        prefill_ids = torch.tensor([t for inp in prefill_inputs for t in inp.token_ids], dtype=torch.int64, device=device)
        if not reqs:
            return prefill_ids, None
        k1 = proposal.max_len + 1
        flat_index = torch.tensor([b * k1 + j for b, k in enumerate(proposal.lens) for j in range(k + 1)], dtype=torch.int64, device=device)
        last = torch.tensor([r.token_ids(r.seq_len - 1, r.seq_len)[0] for r in reqs], dtype=torch.int64, device=device)
        grid = torch.cat([last[:, None], proposal.tokens], 1)  # [B, K+1]
        return torch.cat([grid.flatten()[flat_index], prefill_ids]), flat_index

    def _accept(self, reqs, proposal: Proposal, sb, verify_logits, flat_index) -> list[torch.Tensor]:
        bsz, k = len(reqs), proposal.max_len
        grid = verify_logits.new_zeros(bsz * (k + 1), verify_logits.shape[1])
        grid[flat_index] = verify_logits  # [B*(K+1), V]; rows past a request's drafts stay unused
        sbv = sb.for_verify(proposal.tokens)
        logits = penalised_logits(grid, sbv)
        p = probs_from_logits(logits, sbv).view(bsz, k + 1, -1)
        lens = torch.tensor(proposal.lens, dtype=torch.int64, device=grid.device)
        num_accepted, tokens = verify_chain(p, proposal.tokens, lens, proposal.q, sb.seeds, sb.positions)
        logprobs = torch.log_softmax(logits, -1).gather(1, tokens.view(-1, 1)).view(bsz, k + 1)
        return [num_accepted, tokens, logprobs]

    def _results(self, batch: ScheduledBatch, proposal: Proposal | None, host: list[float]) -> list[RequestResult]:
        results, pos = [], 0
        decodes = batch.decodes
        if decodes:
            bsz, k1 = len(decodes), proposal.max_len + 1
            accepted = [int(a) for a in host[:bsz]]
            tokens = host[bsz : bsz + bsz * k1]
            logprobs = host[bsz + bsz * k1 : bsz + 2 * bsz * k1]
            pos = bsz + 2 * bsz * k1
            for b, a in enumerate(accepted):
                row = slice(b * k1, b * k1 + a + 1)
                results.append(RequestResult(a + 1, [int(t) for t in tokens[row]], logprobs[row], proposal.lens[b], a))
            self.proposer.commit([it.req for it in decodes], proposal.max_len, accepted)
            self.metrics.observe(proposal.lens, accepted)
        n_sampling = sum(it.samples for it in batch.prefills)
        sampled, sampled_lp = host[pos : pos + n_sampling], host[pos + n_sampling :]
        i = 0
        for it in batch.prefills:
            res = RequestResult(it.num_tokens)
            if it.samples:
                res.new_tokens, res.logprobs = [int(sampled[i])], [sampled_lp[i]]
                i += 1
            results.append(res)
        return results
