"""TensorParallel: one rank's place in a tensor-parallel group, and the collectives a split model calls.

A model split over `size` ranks (Megatron's layout, as SGLang and vLLM split it):
  column-parallel   q/k/v and gate/up keep 1/size of their output rows: heads and MLP columns are local
  row-parallel      o_proj and down_proj keep 1/size of their input columns; their partial products are summed
                    over the group (all_reduce), then the bias is added once
  vocab-parallel    the embedding and the lm_head keep 1/size of the vocabulary rows; a token's embedding row lives
                    on one rank (the others contribute zeros to a sum), the logits are gathered along the vocabulary
With size 1 every collective is the identity, so one code path serves split and whole models.

Two groups over the same ranks: `group` carries the model's tensors (NCCL on CUDA, gloo on the CPU), `control` the
host-side agreements (gloo: rank 0's step commands, the pool sizes every rank must share, rank 0's step time), so a
control message never waits behind, or occupies, the GPU's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from hyperdraft.distributed.push_all_reduce import PushAllReduce


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the model's tensor collectives (None: the default group, or no group at size 1)
    control: Any = None  # host values and objects (None: the default group, which is gloo on the CPU)
    push: "PushAllReduce | None" = None  # small all-reduces in one launch through symmetric memory (one node, CUDA)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} must lie in [0, tp_size={self.size})")

    def split(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's part of n items split evenly (n a multiple of size)."""
        assert n % self.size == 0, f"{n} does not split over {self.size} ranks"
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def padded_split(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's ceil(n / size) items, the last part padded past n (vocabulary rows)."""
        part = -(-n // self.size)
        return self.rank * part, (self.rank + 1) * part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group: in place through NCCL or gloo, a new tensor through `push` (use the result)."""
        if self.size == 1:
            return x
        if self.push is not None and self.push.fits(x):
            return self.push(x)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_first_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] per rank -> [size * n, ...], rank order."""
        return self.gather_last_dim(x.movedim(0, -1)).movedim(-1, 0).contiguous()

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value. Sizes measured from each GPU's free memory (the K/V budget, the largest
        captured batch) must agree, or the ranks' schedulers would diverge."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.control)
        return int(box.item())

    def first_rank_value(self, value: float) -> float:
        """Rank 0's value on every rank: a measurement (a step's wall time) that steers a decision every rank must
        make alike."""
        if self.size == 1:
            return value
        box = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(box, src=0, group=self.control)
        return float(box.item())


SINGLE = TensorParallel()  # an unsplit model
