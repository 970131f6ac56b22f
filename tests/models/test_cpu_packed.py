"""models/cpu_packed.py: CPU verifies of 3..16 rows through blocked (oneDNN) copies of the fp32 weights.

The product equals F.linear up to float32 rounding and gives a row the same bits at every row count (so a token's
logits do not depend on the verify width); pack_for_verify packs what a verify runs (each fused group's buffer once,
every other projection alone, a shared module once) and nothing where no verify reaches 3 rows; an engine with the
copies decodes what it decodes without them and what plain decoding does."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.spec_fixtures import _single_torch_thread, llm_factory, mixed_prompts, spec_models  # noqa: F401
from hyperdraft.models.cpu_linear import FusedRows, Linear, fuse_rows, pack_for_verify, project
from hyperdraft.models.cpu_packed import PACKED_MAX_ROWS, PACKED_MIN_ROWS, pack_weight, packed_product, uses_packed_path

SHAPES = [(960, 576), (576, 1536), (100, 36), (4096, 64)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
def test_packed_product_is_the_linear_and_row_count_invariant(out_features, in_features):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(PACKED_MAX_ROWS, in_features, generator=g)
    pack = pack_weight(weight)
    full = packed_product(x, pack, bias, out_features)
    torch.testing.assert_close(full, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    for rows in range(2, PACKED_MAX_ROWS):
        assert torch.equal(packed_product(x[:rows].contiguous(), pack, bias, out_features), full[:rows]), rows
    batched = packed_product(x[:12].view(3, 4, in_features), pack, bias, out_features)  # [..., in] keeps its shape
    assert batched.shape == (3, 4, out_features) and torch.equal(batched.reshape(12, -1), full[:12])


def test_which_inputs_take_the_packed_path():
    w = torch.zeros(4, 8)
    assert [uses_packed_path(torch.zeros(m, 8), w) for m in (1, 2, 3, 16, 17)] == [False, False, True, True, False]
    assert not uses_packed_path(torch.zeros(4, 8, dtype=torch.bfloat16), w)
    assert uses_packed_path(torch.zeros(2, 3, 8), w)  # six rows in a batch dimension
    assert not uses_packed_path(torch.zeros(4, 8), w.requires_grad_())  # autograd: the copy has no gradient
    with torch.no_grad():
        assert uses_packed_path(torch.zeros(4, 8), w)
    assert (PACKED_MIN_ROWS, PACKED_MAX_ROWS) == (3, 16)


class _Layer(nn.Module):
    def __init__(self, shared: Linear):
        super().__init__()
        self.q, self.k, self.o = Linear(16, 16), Linear(16, 8), Linear(16, 16, bias=False)
        self.head = shared
        fuse_rows(self.q, self.k)


@torch.no_grad()
def test_pack_for_verify_packs_each_weight_a_verify_runs_once():
    torch.manual_seed(0)
    shared = Linear(16, 32, bias=False)
    model, other = _Layer(shared), nn.ModuleList([shared, Linear(16, 4)])
    x = torch.randn(5, 16)
    want_q, want_k = project(x, model.q, model.k)
    want_o = model.o(x)
    assert pack_for_verify([model, other], verify_rows=2, device=torch.device("cpu")) == 0  # a 2-row verify: MKL
    assert model.o.verify_pack is None and model.q.fused_rows.verify_pack is None
    packed = pack_for_verify([model, None, other], verify_rows=6, device=torch.device("cpu"))
    fused: FusedRows = model.q.fused_rows
    assert fused.verify_pack is not None and model.q.verify_pack is None and model.k.verify_pack is None
    assert all(m.verify_pack is not None for m in (model.o, shared, other[1]))
    assert packed == 4 * (24 * 16 + 16 * 16 + 32 * 16 + 4 * 16)  # the shared head once, the group's buffer once
    assert pack_for_verify([model, other], verify_rows=6, device=torch.device("cpu")) == 0  # nothing left to pack
    got_q, got_k = project(x, model.q, model.k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.o(x), want_o, rtol=1e-5, atol=1e-5)
    # what runs is the copy (for 3..16 rows only): a copy of 2W doubles 5 rows' products, not 2 rows'
    model.o.verify_pack = pack_weight(2 * model.o.weight)
    torch.testing.assert_close(model.o(x), 2 * want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.o(x[:2]), want_o[:2], rtol=1e-5, atol=1e-5)
    fused.verify_pack = pack_weight(2 * fused.weight)
    torch.testing.assert_close(project(x, model.q, model.k)[1], 2 * want_k - model.k.bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["chain", "tree"])
def test_engine_with_packed_verifies_decodes_as_plain(spec_models, llm_factory, monkeypatch, spec):
    """Speculation on a CPU fp32 target (verifies of 6 and 8 rows) with the blocked copies equals speculation without
    them and plain decoding, token for token, on an unsharpened random model (near ties are real there)."""
    from hyperdraft import SamplingParams

    prompts = mixed_prompts(6, seed=11, max_len=30)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    draft = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models["draft_wide_noisy"])
    draft.update(dict(speculative_num_steps=5) if spec == "chain" else
                 dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8))

    def run(packed: bool, **spec_args):
        monkeypatch.setenv("HYPERDRAFT_DISABLE_PACKED_VERIFY", "0" if packed else "1")
        llm = llm_factory(spec_models["target"], **spec_args)
        outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
        target = llm.engine.runner.model
        return outs, sum(m.verify_pack is not None for m in target.modules() if isinstance(m, Linear))

    with_packs, packed_linears = run(True, **draft)
    assert packed_linears > 0
    without, none_packed = run(False, **draft)
    assert none_packed == 0
    plain, plain_packed = run(True)
    assert plain_packed == 0  # no verify: no copies
    assert with_packs == without == plain
