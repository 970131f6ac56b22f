"""Random token stores for NGRAM's device lookup (kernels/ngram.py): rows of random tokens in shuffled pages."""

from __future__ import annotations

import numpy as np
import torch

from hyperdraft.kernels.ngram import SEPARATOR, TokenStore
from hyperdraft.kvcache.page_table import PageTable


def random_store(rng: np.random.Generator, page_size: int, lengths: list[int], vocab: int,
                 device: str = "cpu") -> tuple[TokenStore, list[int], list[list[int]]]:
    """A page table whose rows hold `lengths` tokens (plus room for a round), their pages shuffled so rows
    interleave in the pool, and the store holding each row's random tokens -> (store, rows, sequences)."""
    pages = sum(-(-(n + 8) // page_size) for n in lengths) + 1  # every row's room, and the padding page
    table = PageTable(num_pages=pages, page_size=page_size, max_rows=len(lengths),
                      max_pages_per_row=256 // page_size, device=torch.device(device))
    table._free_pages = rng.permutation(range(1, table.num_pages)).tolist()
    tokens = torch.full((table.num_pages * page_size,), SEPARATOR, dtype=torch.int32, device=device)
    rows, seqs = [], []
    for length in lengths:
        row = table.acquire_row()
        assert table.reserve(row, length + 8)
        seq = rng.integers(0, vocab, length).tolist()
        slots = table.slots(torch.tensor([row], device=device), torch.arange(length, device=device)[None])[0]
        tokens[slots] = torch.tensor(seq, dtype=torch.int32, device=device)
        rows.append(row)
        seqs.append(seq)
    return TokenStore(tokens, table.table, page_size), rows, seqs


def random_history(rng: np.random.Generator, vocab: int, capacity: int, device: str = "cpu"):
    """-> (the host history with separators inside, its device copy padded with separators to capacity)."""
    history = rng.integers(-1, vocab, int(rng.integers(0, capacity))).astype(np.int64)
    padded = torch.full((capacity,), SEPARATOR, dtype=torch.int32)
    padded[: len(history)] = torch.from_numpy(history.astype(np.int32))
    return history, padded.to(device)
