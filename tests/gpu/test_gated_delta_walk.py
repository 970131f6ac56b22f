"""The Gated DeltaNet walk kernels (kernels/gated_delta_walk.py) against walk_reference, a token-by-token torch
recurrence: one packed batch holding a fresh prefill, a continued chunk, a decode, a chain verify, a tree verify
whose nodes branch from earlier siblings, draft steps that start from scratch entries, and a padding request; the
outputs, the committed slots and every scratch entry must agree. The batched commit kernel against StatePool's torch
commit. Then the engine: the Triton backend equals the torch backend (fp32, greedy, with and without MTP), and the
scratch is read through its own strides when a larger pool holds it (seed 000's stride bug)."""

from __future__ import annotations

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.kernels.gated_delta import GdnGates
from hyperdraft.kernels.gated_delta_walk import Walk, commit_states, conv_walk, delta_walk, walk_reference
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import with_mtp_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (slot, fresh, parents, targets) per request; -2 continue, -1 committed, p >= 0 scratch p; target -1: advance slot
REQUESTS = [
    (4, 0, [-1, 0, 1, 2], [0, 1, 2, 3]),  # chain verify
    (5, 0, [-1, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]),  # tree verify: nodes 2, 4, 5 branch from earlier ones
    (6, 0, [1, 1, 3], [2, 3, 4]),  # draft steps: parents are scratch entries written by an earlier forward
    (1, 1, [-1] + [-2] * 8, [-1] * 9),  # a fresh prefill: zeros, whatever slot 1 holds
    (2, 0, [-1, -2, -2], [-1] * 3),  # a continued chunk
    (3, 0, [-1], [-1]),  # a decode
    (0, 0, [-1], [-1]),  # padding: slot 0
]


def _walk(device) -> Walk:
    lens = [len(r[2]) for r in REQUESTS]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    i32 = dict(dtype=torch.int32, device=device)
    return Walk(len(REQUESTS), torch.tensor(starts, **i32), torch.tensor(lens, **i32),
                torch.tensor([r[0] for r in REQUESTS], dtype=torch.int64, device=device),
                torch.tensor([r[1] for r in REQUESTS], **i32),
                torch.tensor([p for r in REQUESTS for p in r[2]], **i32),
                torch.tensor([t for r in REQUESTS for t in r[3]], **i32))


@pytest.mark.parametrize("dims", [(2, 4, 16, 16, 4), (2, 4, 128, 128, 4), (1, 3, 32, 64, 3)],
                         ids=["small", "qwen-heads", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_walk_kernels_equal_the_reference(dims, dtype):
    hk, hv, dk, dv, kernel = dims
    gen = torch.Generator(device="cuda").manual_seed(0)
    key_dim, channels, slots, width = hk * dk, 2 * hk * dk + hv * dv, 7, 6
    walk = _walk("cuda")
    tokens = walk.parent.shape[0]

    def rand(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dt)

    mixed, weight = rand(tokens, channels), rand(channels, kernel, scale=0.5)
    # a and b as column blocks of one projection output (row stride 3 * hv), as a layer hands them over; a spans
    # softplus' pass-through (> 20) and its tiny-value range
    ab = rand(tokens, 3 * hv, scale=3.0)
    ab[0, :hv] = torch.linspace(-30, 30, hv, device="cuda").to(dtype)
    gates = GdnGates(ab[:, :hv], ab[:, hv : 2 * hv], rand(hv, scale=0.5), rand(hv))
    g, beta = gates.decay_and_beta()
    pools = [rand(slots, channels, kernel - 1), rand(slots, width, channels, kernel - 1),
             rand(slots, hv, dk, dv, scale=0.3, dt=torch.float32), rand(slots, width, hv, dk, dv, scale=0.3,
                                                                         dt=torch.float32)]
    mine = [p.clone() for p in pools]
    ref = walk_reference(mixed, weight, g, beta, *pools, walk, key_dim, dk)
    qkv = conv_walk(mixed, weight, mine[0], mine[1], walk)
    out = delta_walk(qkv, gates, mine[2], mine[3], walk, key_dim, dtype)
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    for name, a, b in zip(("conv", "conv_scratch", "recurrent", "recurrent_scratch"), mine, pools):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=name)


def test_commit_kernel_equals_the_torch_commit():
    gen = torch.Generator(device="cuda").manual_seed(1)
    committed = torch.randn(3, 9, 4, 8, 8, generator=gen, device="cuda")
    scratch = torch.randn(3, 9, 5, 4, 8, 8, generator=gen, device="cuda")
    slots = torch.tensor([2, 5, 7, 8], device="cuda")
    index = torch.tensor([0, -1, 4, 2], device="cuda")
    want = committed.clone()
    for s, i in zip(slots.tolist(), index.tolist()):
        if i >= 0:
            want[:, s] = scratch[:, s, i]
    commit_states(committed, scratch, slots, index)
    assert torch.equal(committed, want)


def test_kernels_read_the_scratch_through_its_own_strides():
    """A scratch that is a slice of a wider buffer (as an adaptive pool's widest tier would leave it): its width stride
    is the buffer's, not the walk's; a kernel that assumed a packed [S, W_round, ...] layout would read wrong states."""
    hk, hv, dk, dv, kernel = 2, 4, 16, 16, 4
    gen = torch.Generator(device="cuda").manual_seed(2)
    key_dim, channels = hk * dk, 2 * hk * dk + hv * dv
    walk = _walk("cuda")
    tokens = walk.parent.shape[0]
    mixed = torch.randn(tokens, channels, generator=gen, device="cuda")
    weight = torch.randn(channels, kernel, generator=gen, device="cuda") * 0.5
    gates = GdnGates(*torch.randn(2, tokens, hv, generator=gen, device="cuda"), torch.randn(hv, generator=gen, device="cuda"),
                     torch.randn(hv, generator=gen, device="cuda"))
    g, beta = gates.decay_and_beta()
    conv = torch.randn(7, channels, kernel - 1, generator=gen, device="cuda")
    rec = torch.randn(7, hv, dk, dv, generator=gen, device="cuda") * 0.3
    wide_conv = torch.randn(7, 11, channels, kernel - 1, generator=gen, device="cuda")
    wide_rec = torch.randn(7, 11, hv, dk, dv, generator=gen, device="cuda") * 0.3
    pools = [conv.clone(), wide_conv[:, :6].clone(), rec.clone(), wide_rec[:, :6].clone()]
    ref = walk_reference(mixed, weight, g, beta, *pools, walk, key_dim, dk)
    qkv = conv_walk(mixed, weight, conv, wide_conv[:, :6], walk)
    out = delta_walk(qkv, gates, rec, wide_rec[:, :6], walk, key_dim, torch.float32)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(wide_rec[:, :6], pools[3], atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("walk_engine")
    return with_mtp_weights(make_tiny_model(str(root / "t"), "qwen3_5", seed=0), str(root / "m"))


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    return [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]


@pytest.mark.parametrize("extra", [dict(), dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
                                   dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                        speculative_eagle_topk=2, speculative_num_draft_tokens=5)],
                         ids=["plain", "mtp-chain", "mtp-tree"])
def test_triton_backend_equals_torch_backend(mtp_model, extra):
    from hyperdraft.attention.linear_backend import TorchLinearBackend, TritonLinearBackend

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (1, 7, 33, 64, 5, 90)]
    base = dict(device="cuda", dtype="float32", max_running_requests=8, max_total_tokens=4096,
                chunked_prefill_size=32, **extra)
    torch_llm = LLM(mtp_model, runtime_options=RuntimeOptions(fused_kernels=False), **base)
    triton_llm = LLM(mtp_model, **base)
    assert isinstance(torch_llm.engine.runner.linear_backend, TorchLinearBackend)
    assert isinstance(triton_llm.engine.runner.linear_backend, TritonLinearBackend)
    assert _greedy(triton_llm, prompts) == _greedy(torch_llm, prompts)


@pytest.mark.parametrize("extra", [dict(), dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
                                   dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                        speculative_eagle_topk=2, speculative_num_draft_tokens=5),
                                   dict(speculative_algorithm="NEXTN", speculative_adaptive=True),
                                   dict(speculative_algorithm="NGRAM", speculative_num_steps=3)],
                         ids=["plain", "mtp-chain", "mtp-tree", "mtp-adaptive", "ngram"])
def test_cuda_graphs_on_equal_off_for_a_hybrid_target(mtp_model, extra):
    """Decode and verify graphs of a hybrid target (the walk planned on the device inside the graph, padding rows in
    slot 0) give the eager output; the graphs did run."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (3, 7, 33, 64, 5, 90, 12)]
    base = dict(device="cuda", dtype="float32", max_running_requests=8, max_total_tokens=4096, **extra)
    eager = _greedy(LLM(mtp_model, disable_cuda_graph=True, **base), prompts)
    llm = LLM(mtp_model, **base)
    assert llm.engine.runner.graphs is not None
    assert _greedy(llm, prompts) == eager
    assert llm.engine.runner.graphs.num_replays > 0
