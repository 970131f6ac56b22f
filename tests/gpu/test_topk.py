"""kernels/topk.py against torch.log_softmax(row).topk(k): each row's k largest log-probabilities and their ids, over
a plain vocabulary and through an EAGLE-3 head's draft-to-target map. Run on a GPU machine:
`python3 -m pytest tests/gpu/test_topk.py` (with TRITON_INTERPRET=1 and triton installed, also on the CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from hyperdraft.kernels.topk import top_logprobs_kernel, top_logprobs_reference
from hyperdraft.kernels.vocab_map import spread_logits_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width,k", [(1, 32000, 4), (16, 5000, 1), (4, 4096, 8), (3, 131, 5), (2, 9000, 10)])
def test_top_logprobs(rows, width, k, dtype):
    g = torch.Generator().manual_seed(rows * width + k)
    x = (torch.randn(rows, width, generator=g) * 4).to(dtype)
    values, ids = top_logprobs_kernel(x.to(DEVICE), k)
    ref_values, ref_ids = top_logprobs_reference(x.float(), k)
    torch.testing.assert_close(values.cpu(), ref_values, rtol=0, atol=2e-5)
    if dtype == torch.float32:  # random float32 rows have no ties among their top k
        assert torch.equal(ids.cpu(), ref_ids)
    else:  # bf16 rows do: the kernel takes equal values smallest id first
        assert torch.equal(x.float().gather(1, ids.cpu()), x.float().gather(1, ref_ids))


def test_ties_go_to_the_smaller_id():
    x = torch.zeros(2, 10000)
    x[:, [9000, 17, 4500, 8191, 4096]] = 3.0
    values, ids = top_logprobs_kernel(x.to(DEVICE), 4)
    assert ids.cpu().tolist() == [[17, 4096, 4500, 8191]] * 2
    assert torch.allclose(values.cpu(), top_logprobs_reference(x, 1)[0].expand(2, 4))


@pytest.mark.parametrize("k", [1, 4])
def test_top_logprobs_through_a_draft_vocabulary(k):
    """With column ids the rows are draft logits and the ids target ids: the top k of the row spread over the target
    vocabulary, which is never built."""
    g = torch.Generator().manual_seed(k)
    vocab, draft_vocab = 20000, 9000
    draft_to_target = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    x = torch.randn(3, draft_vocab, generator=g) * 3
    values, ids = top_logprobs_kernel(x.to(DEVICE), k, draft_to_target.to(DEVICE))
    ref_values, ref_ids = top_logprobs_reference(spread_logits_reference(x, draft_to_target, vocab), k)
    torch.testing.assert_close(values.cpu(), ref_values, rtol=0, atol=2e-5)
    assert torch.equal(ids.cpu(), ref_ids)
