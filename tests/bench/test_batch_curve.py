"""benchmarks/e2e/batch_curve.py's measurement: every row's engine alive at once and timed in turns, one point per row
and batch size, and a drafter's accept length beside its speed. On CPU with a tiny model (the curve itself is a GPU
benchmark)."""

from __future__ import annotations

import torch

import benchmarks.e2e.batch_curve as batch_curve
from hyperdraft import LLM
from hyperdraft.testing.tiny import make_tiny_model


def test_rows_are_timed_in_turns(tmp_path, monkeypatch):
    model = make_tiny_model(str(tmp_path / "llama"), "llama", seed=3, with_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 17, 9)]
    prompts[2] = prompts[1][:8] * 2  # a repeat, so NGRAM finds something to draft
    order = []
    real = LLM.generate

    def spy(self, *args, **kwargs):
        order.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    common = dict(device="cpu", dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True)
    engines = {"plain": common, "NGRAM, adaptive": dict(common, speculative_algorithm="NGRAM",
                                                        speculative_adaptive=True)}
    points = batch_curve.curves(model, prompts, 6, engines, batches=(1, 3))
    assert list(points) == ["plain", "NGRAM, adaptive"]
    assert all(len(row) == 2 and all(p.tok_s > 0 for p in row) for row in points.values())
    assert all(p.accept_length is None for p in points["plain"])
    assert all(p.accept_length >= 1 for p in points["NGRAM, adaptive"])
    # per batch size: each engine's warm-up, then REPEATS turns in which the two engines alternate
    plain, ngram = order[0], order[1]
    per_batch = [plain, ngram] + [plain, ngram] * batch_curve.REPEATS
    assert order == per_batch * 2
    lines = batch_curve.table(points)
    assert lines[0].startswith("| plain | ") and lines[1].startswith("| NGRAM, adaptive | ")
    assert lines[2].startswith("| NGRAM, adaptive: accept length | ") and len(lines) == 4
