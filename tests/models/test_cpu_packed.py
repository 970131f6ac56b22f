"""models/cpu_packed.py: CPU verifies of 3..16 rows through blocked (oneDNN) copies of the fp32 weights.

The product equals F.linear up to float32 rounding and gives a row the same bits at every row count (so a token's
logits do not depend on the verify width); pack_for_verify copies what a verify runs (each fused group's buffer once,
every other projection alone, a shared module once) and nothing where no verify reaches 3 rows; an engine with the
copies decodes what it decodes without them and what plain decoding does."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.spec_fixtures import _single_torch_thread, llm_factory, mixed_prompts, spec_models  # noqa: F401
from hyperdraft.models.cpu_linear import FusedRows, Linear, fuse_rows, pack_for_verify, project
from hyperdraft.models.cpu_packed import PACKED_MAX_ROWS, PACKED_MIN_ROWS, BlockedWeight

SHAPES = [(960, 576), (576, 1536), (100, 36), (4096, 64)]
CPU = torch.device("cpu")


def _weights(out_features, in_features):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    return weight, torch.randn(out_features, generator=g), torch.randn(PACKED_MAX_ROWS, in_features, generator=g)


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_fp32_copy_is_the_linear_and_row_count_invariant(out_features, in_features):
    weight, bias, x = _weights(out_features, in_features)
    blocked = BlockedWeight.of(weight, bias)
    full = blocked.product(x)
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    for rows in range(2, PACKED_MAX_ROWS):
        assert torch.equal(blocked.product(x[:rows].contiguous()), full[:rows]), rows
    batched = blocked.product(x[:12].view(3, 4, in_features))  # [..., in] keeps its shape
    assert batched.shape == (3, 4, out_features) and torch.equal(batched.reshape(12, -1), full[:12])


def test_which_inputs_take_a_copy():
    w = torch.zeros(4, 8)
    verify = BlockedWeight.of(w, None)
    assert [verify.takes(torch.zeros(m, 8), w) for m in (1, 2, 3, 16, 17)] == [False, False, True, True, False]
    assert not verify.takes(torch.zeros(4, 8, dtype=torch.bfloat16), w)
    assert verify.takes(torch.zeros(2, 3, 8), w)  # six rows in a batch dimension
    assert not verify.takes(torch.zeros(4, 8), w.clone().requires_grad_())  # autograd: the copy has no gradient
    with torch.no_grad():
        assert verify.takes(torch.zeros(4, 8), w.clone().requires_grad_())
    assert (PACKED_MIN_ROWS, PACKED_MAX_ROWS) == (3, 16)


class _Layer(nn.Module):
    def __init__(self, shared: Linear):
        super().__init__()
        self.q, self.k, self.o = Linear(16, 16), Linear(16, 8), Linear(16, 16, bias=False)
        self.head = shared
        fuse_rows(self.q, self.k)


@torch.no_grad()
def test_pack_for_verify_copies_each_weight_a_verify_runs_once():
    torch.manual_seed(0)
    shared = Linear(16, 32, bias=False)
    target, draft = _Layer(shared), nn.ModuleList([shared, Linear(16, 4)])
    x = torch.randn(5, 16)
    want_q, want_k = project(x, target.q, target.k)
    want_o = target.o(x)
    assert pack_for_verify([target, draft], verify_rows=2, device=CPU) == 0  # a 2-row verify: MKL
    assert target.o.blocked is None and target.q.fused_rows.blocked is None
    made = pack_for_verify([target, None, draft], verify_rows=6, device=CPU)
    fused: FusedRows = target.q.fused_rows
    assert fused.blocked is not None and target.q.blocked is None and target.k.blocked is None
    assert all(m.blocked is not None for m in (target.o, shared, draft[1]))
    assert made == 4 * (24 * 16 + 16 * 16 + 32 * 16 + 4 * 16)  # the shared module once, the group's buffer once
    assert pack_for_verify([target, draft], verify_rows=6, device=CPU) == 0  # nothing left to copy
    got_q, got_k = project(x, target.q, target.k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.o(x), want_o, rtol=1e-5, atol=1e-5)
    # what runs is the copy (for the rows it takes): a copy of 2W doubles 5 rows' products, not 2 rows'
    target.o.blocked = BlockedWeight.of(2 * target.o.weight, None)
    torch.testing.assert_close(target.o(x), 2 * want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.o(x[:2]), want_o[:2], rtol=1e-5, atol=1e-5)
    fused.blocked = BlockedWeight.of(2 * fused.weight, fused.bias)
    torch.testing.assert_close(project(x, target.q, target.k)[1], 2 * want_k - target.k.bias, rtol=1e-5, atol=1e-5)


def test_no_copies_off_the_cpu_path():
    target = _Layer(Linear(16, 32, bias=False))
    assert pack_for_verify([target], verify_rows=6, device=torch.device("meta")) == 0
    half = _Layer(Linear(16, 32, bias=False)).to(torch.bfloat16)  # a bf16 model keeps torch's products
    assert pack_for_verify([half], verify_rows=6, device=CPU) == 0


@pytest.mark.parametrize("spec", ["chain", "tree"])
def test_engine_with_blocked_copies_decodes_as_plain(spec_models, llm_factory, monkeypatch, spec):
    """Speculation on a CPU fp32 target (verifies of 6 and 8 rows) with the blocked copies (the draft model's too, for
    its catch-ups) equals speculation without them and plain decoding, token for token, on an unsharpened random
    model (near ties are real there)."""
    from hyperdraft import SamplingParams

    prompts = mixed_prompts(6, seed=11, max_len=30)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    draft = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models["draft_wide_noisy"])
    draft.update(dict(speculative_num_steps=5) if spec == "chain" else
                 dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8))

    def run(blocked: bool, **spec_args):
        monkeypatch.setenv("HYPERDRAFT_DISABLE_PACKED_VERIFY", "0" if blocked else "1")
        llm = llm_factory(spec_models["target"], **spec_args)
        outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
        worker = llm.engine.worker
        models = [llm.engine.runner.model, worker.proposer.runner.model if spec_args else None]
        counts = [0 if model is None else sum(m.blocked is not None for m in model.modules() if isinstance(m, Linear))
                  for model in models]
        return outs, counts

    with_copies, counts = run(True, **draft)
    assert min(counts) > 0
    without, none = run(False, **draft)
    assert none == [0, 0]
    plain, plain_counts = run(True)
    assert plain_counts == [0, 0]  # no verify, no drafter: no copies
    assert with_copies == without == plain


@pytest.mark.parametrize("free", [None, 1000])
def test_no_copies_without_the_memory_for_them(monkeypatch, free):
    """Copies are made only when they fit in half the free memory, and never where the platform cannot say how much
    is free: the engine then keeps MKL for every product."""
    import hyperdraft.models.cpu_linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "_free_memory", lambda: free)
    target = _Layer(Linear(16, 32, bias=False))
    assert pack_for_verify([target], verify_rows=6, device=CPU) == 0
    assert all(m.blocked is None for m in target.modules() if isinstance(m, Linear))
    monkeypatch.setattr(cpu_linear, "_free_memory", lambda: 10**9)
    assert pack_for_verify([target], verify_rows=6, device=CPU) > 0


@torch.no_grad()
def test_a_row_parallel_projection_adds_its_bias_once():
    """A row-split projection adds its bias after the partial products are summed, so its copy carries none."""
    from hyperdraft.distributed.tensor_parallel import SINGLE
    from hyperdraft.models.tensor_parallel import RowParallelLinear

    torch.manual_seed(1)
    proj = RowParallelLinear(24, 16, bias=True, tp=SINGLE)
    x = torch.randn(5, 24)
    want = F.linear(x, proj.weight, proj.bias)
    assert pack_for_verify([proj], verify_rows=6, device=CPU) > 0 and proj.blocked.bias is None
    torch.testing.assert_close(proj(x), want, rtol=1e-5, atol=1e-5)
