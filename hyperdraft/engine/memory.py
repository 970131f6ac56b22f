"""How much K/V and recurrent state an engine's pools hold: per-token and per-row bytes of each model, from its own
dimensions, and the budget they share."""

from __future__ import annotations

import logging

import torch

from hyperdraft.config import EngineArgs
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.state_pool import StatePool

logger = logging.getLogger("hyperdraft")

CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536


def kv_bytes_per_slot(model) -> int:
    """Per-token K/V bytes of one model, from its OWN dimensions (a draft's are not the target's)."""
    cfg = model.config
    return KVPool.bytes_per_slot(cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, next(model.parameters()).dtype)


def state_bytes_per_row(model, verify_width: int) -> int:
    """A hybrid model's recurrent state per page-table row (its slot and scratch); 0 for a dense model."""
    cfg = model.config
    if not cfg.is_hybrid:
        return 0
    dtype = next(model.parameters()).dtype
    return StatePool.bytes_per_slot(cfg.linear_attention, cfg.num_linear_layers, dtype, verify_width)


def memory_budget_bytes(args: EngineArgs, kv_bytes_per_token: int, device: torch.device) -> int:
    """Bytes for the K/V and the recurrent-state pools together: max_total_tokens (CPU default 65536) K/V tokens'
    worth; on CUDA, mem_fraction_static of the device less what is already resident (the weights)."""
    if args.max_total_tokens is not None or device.type != "cuda":
        return (args.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS) * kv_bytes_per_token
    free, total = torch.cuda.mem_get_info(device)
    return int(free - total * (1 - args.mem_fraction_static))


def kv_capacity_tokens(args: EngineArgs, kv_bytes_per_token: int, budget: int, state_bytes: int, rows: int,
                       device: torch.device) -> int:
    """The K/V tokens the budget holds after the state pools."""
    tokens = (budget - state_bytes) // kv_bytes_per_token
    if tokens >= max(args.page_size * 2, 2):
        return tokens
    field = "max_total_tokens" if args.max_total_tokens is not None or device.type != "cuda" else "mem_fraction_static"
    where = ""
    if field == "mem_fraction_static":  # the usual cause: another process (a second engine) holds the device
        where = (f" (mem_fraction_static={args.mem_fraction_static} of the device, less all memory in use on it, "
                 f"this process's weights and any other process's, leaves {budget / 2**30:.2f} GiB: free the device, "
                 "raise mem_fraction_static or set max_total_tokens)")
    raise ValueError(f"{field} leaves no room for the K/V cache" + where
                     + (f" after the recurrent state of max_running_requests={rows} requests "
                        f"({state_bytes / 2**20:.1f} MiB): raise {field} or lower max_running_requests"
                        if state_bytes else ""))


def fitting_rows(args: EngineArgs, budget: int, state_per_row: int) -> int:
    """Rows (running requests): max_running_requests, or, when the user left it unset and a hybrid model's states
    for that many would take more than half the budget, as many as fit in half of it."""
    rows = args.effective_max_running_requests
    if args.max_running_requests is not None or not state_per_row:
        return rows
    fit = max(1, budget // 2 // state_per_row - 1)
    if fit < rows:
        logger.info("max_running_requests defaults to %d: the recurrent state of more would take over half of the "
                    "memory budget", fit)
    return min(rows, fit)


def checked_rows(args: EngineArgs, capacity: int, rows: int, state_per_row: int, context_len: int) -> int:
    """Rows capped at the K/V cache's pages (each running request holds a page at least: more rows only cost memory),
    with a warning where the recurrent states leave the cache shorter than the context (the budget is max_total_tokens
    tokens' worth, states included, so a small one can leave little K/V)."""
    if state_per_row and capacity < context_len:
        logger.warning("the recurrent state of %d running requests leaves the K/V cache %d tokens, fewer than "
                       "context_length=%d: longer requests are refused or stop there (raise max_total_tokens or "
                       "mem_fraction_static, or lower max_running_requests)", rows, capacity, context_len)
    pages = capacity // args.page_size
    if rows > pages:
        logger.warning("max_running_requests=%d is more than the K/V cache's %d pages: capped there", rows, pages)
    return min(rows, pages)
