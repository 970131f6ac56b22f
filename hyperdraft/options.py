"""RuntimeOptions: every runtime switch of the engine in one frozen object, and the one module that reads the process
environment.

Each switch defaults to the fast path; turning one off exists for A/B measurements and for tests. An Engine builds
its options once (`RuntimeOptions.from_args`: EngineArgs, then the environment variables below as overrides), holds
them, and activates them (`activated`) around everything it runs. Kernel dispatch deep inside a forward reads the
active options (`current`) instead of module globals, so two engines in one process can differ and a benchmark
passes options instead of patching modules.

  environment variable                  field                      when set
  HYPERDRAFT_DISABLE_FUSED_KERNELS=1    fused_kernels=False        torch ops (and cuBLAS) instead of the Triton kernels
  HYPERDRAFT_DISABLE_GEMV=1             gemv=False                 cuBLAS for projections of at most 16 rows
  HYPERDRAFT_DISABLE_CUDA_KERNELS=1     cuda_kernels=False         Triton instead of the nvcc-built tensor-core GEMV
  HYPERDRAFT_DISABLE_FUSED_NORM_GEMV=1  fused_norm_gemv=False      separate RMSNorm launches before a one-row decode
                                                                   layer's q/k/v and gate/up GEMVs (kernels/norm_gemv)
  HYPERDRAFT_DISABLE_PDL=1              pdl=False                  plain launches (no programmatic dependent launch)
  HYPERDRAFT_DISABLE_SKINNY_LINEAR=1    skinny_cpu_linear=False    F.linear for few-row fp32 products on the CPU
  HYPERDRAFT_DISABLE_PACKED_VERIFY=1    packed_cpu_verify=False    no blocked weight copies for 3..16-row CPU verifies
                                                                   (models/cpu_packed.py)
  HYPERDRAFT_GRAPH_SEGMENTS=0           graph_segments=False       one CUDA graph per captured forward or draft round
  HYPERDRAFT_DECODE_AHEAD=0             decode_ahead=False         no plain decode, nor a step-0 round's next verify,
                                                                   queued before the host reads
  HYPERDRAFT_MOVE_AHEAD_BATCH=0         move_ahead_batch=False     a plain decode queued ahead is packed on the host
                                                                   (runner/next_token.py) instead of moved on from the
                                                                   step's own batch on the device
  HYPERDRAFT_DRAFT_AHEAD=0              draft_ahead=False          no draft queued before the host reads
  HYPERDRAFT_ROUND_AHEAD=0              round_ahead=False          no verify of a draft queued ahead, queued with it
                                                                   (a drafted round's next verify waits for the host,
                                                                   speculative/verify_ahead.py)
  HYPERDRAFT_PARK_HEAD=0                park_head=False            adaptive step 0 of an EAGLE head as rounds of one-row
                                                                   verifies (default: plain decodes, the head's inputs
                                                                   kept by slot until it drafts again)
  HYPERDRAFT_DRAFT_LOOP_GRAPH=0         draft_loop_graphs=False    per-step draft graphs only, no whole-round graphs
  HYPERDRAFT_SAMPLING_ROUND_GRAPH=0     sampling_round_graphs=False
                                                                   whole-round draft graphs for greedy, unpenalised
                                                                   drafts only; rounds that draw drafts from q or
                                                                   apply penalties run step by step
  HYPERDRAFT_EMULATE_CUDA_GRAPH=1       emulate_cuda_graphs=True   on CPU: graph bookkeeping with eager forwards
  HYPERDRAFT_RECORD_STEP_TIME=1         record_step_time=True      per-phase wall time of speculative steps (syncs)
  HYPERDRAFT_SPLIT_DRAFT_MODEL=0        split_draft_model=False    under tensor parallelism a STANDALONE draft model is
                                                                   whole on every rank (default: split over the ranks
                                                                   like the target, when its heads divide)
  HYPERDRAFT_SPLIT_DRAFT_HEAD=1         split_draft_head=True      under tensor parallelism an EAGLE / EAGLE-3 head's
                                                                   layers split over the ranks like the target's
                                                                   (default: whole on every rank, the measured layout)
  HYPERDRAFT_PUSH_ALL_REDUCE=0          push_all_reduce=False      under tensor parallelism every all-reduce through
                                                                   NCCL (default: on one node of GPUs that reach each
                                                                   other's memory, small ones pushed through symmetric
                                                                   memory in one launch, kernels/all_reduce.py; the
                                                                   user's flag is EngineArgs' disable_custom_all_reduce)
  HYPERDRAFT_KV_IN_ATTENTION=0          kv_in_attention=False      the new K/V of decodes, verifies and draft steps
                                                                   stored (q and k rotated) by a launch of their own
                                                                   before attention (default: by the Triton attention
                                                                   launch itself, one launch a layer less; same bits)
  HYPERDRAFT_AHEAD_AFTER_EMPTY=0        ahead_after_empty=False    an NGRAM round whose lookups, queued ahead, drafted
                                                                   nothing anywhere drops the lookup and verify queued
                                                                   behind it, so the next step looks up on the host
                                                                   and may run as a plain decode (default: keeps them)
  HYPERDRAFT_SIMULATE_ACCEPT_RATE=a     simulate_accept_rate=a     BENCHMARK ONLY, lossy (speculative/verify/simulated.py)

`deterministic` has no variable: it is EngineArgs' enable_deterministic_inference (batch-invariant kernels only,
docs/numerics.md).

Not switches, but environment too, and read here alone: HYPERDRAFT_CACHE (`cache_dir`), TRITON_INTERPRET
(`triton_interpreted`) and CUDA_HOME / CUDA_PATH (`cuda_home`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

SIMULATE_ACCEPT_RATE_ENV = "HYPERDRAFT_SIMULATE_ACCEPT_RATE"

# field -> (environment variable, the value that flips the field away from its default)
_SWITCHES = {
    "fused_kernels": ("HYPERDRAFT_DISABLE_FUSED_KERNELS", "1"),
    "gemv": ("HYPERDRAFT_DISABLE_GEMV", "1"),
    "cuda_kernels": ("HYPERDRAFT_DISABLE_CUDA_KERNELS", "1"),
    "fused_norm_gemv": ("HYPERDRAFT_DISABLE_FUSED_NORM_GEMV", "1"),
    "pdl": ("HYPERDRAFT_DISABLE_PDL", "1"),
    "skinny_cpu_linear": ("HYPERDRAFT_DISABLE_SKINNY_LINEAR", "1"),
    "packed_cpu_verify": ("HYPERDRAFT_DISABLE_PACKED_VERIFY", "1"),
    "graph_segments": ("HYPERDRAFT_GRAPH_SEGMENTS", "0"),
    "decode_ahead": ("HYPERDRAFT_DECODE_AHEAD", "0"),
    "move_ahead_batch": ("HYPERDRAFT_MOVE_AHEAD_BATCH", "0"),
    "draft_ahead": ("HYPERDRAFT_DRAFT_AHEAD", "0"),
    "round_ahead": ("HYPERDRAFT_ROUND_AHEAD", "0"),
    "park_head": ("HYPERDRAFT_PARK_HEAD", "0"),
    "draft_loop_graphs": ("HYPERDRAFT_DRAFT_LOOP_GRAPH", "0"),
    "sampling_round_graphs": ("HYPERDRAFT_SAMPLING_ROUND_GRAPH", "0"),
    "emulate_cuda_graphs": ("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1"),
    "record_step_time": ("HYPERDRAFT_RECORD_STEP_TIME", "1"),
    "split_draft_model": ("HYPERDRAFT_SPLIT_DRAFT_MODEL", "0"),
    "push_all_reduce": ("HYPERDRAFT_PUSH_ALL_REDUCE", "0"),
    "kv_in_attention": ("HYPERDRAFT_KV_IN_ATTENTION", "0"),
    "split_draft_head": ("HYPERDRAFT_SPLIT_DRAFT_HEAD", "1"),
    "ahead_after_empty": ("HYPERDRAFT_AHEAD_AFTER_EMPTY", "0"),
}


@dataclass(frozen=True)
class RuntimeOptions:
    fused_kernels: bool = True
    gemv: bool = True
    cuda_kernels: bool = True
    fused_norm_gemv: bool = True  # SmolLM2 decode graph 661 -> 600 us on an H100; rows <= 1024 only (kernels/norm_gemv.py)
    pdl: bool = True
    skinny_cpu_linear: bool = True
    packed_cpu_verify: bool = True  # 6-row SmolLM2 products 2-3x faster on a 2-core EPYC (models/cpu_packed.py)
    graph_segments: bool = True
    decode_ahead: bool = True
    move_ahead_batch: bool = True  # runner/next_token.py
    draft_ahead: bool = True
    round_ahead: bool = True  # speculative/verify_ahead.py
    park_head: bool = True  # speculative/proposers/slot_hidden.py
    draft_loop_graphs: bool = True
    sampling_round_graphs: bool = True
    emulate_cuda_graphs: bool = False
    record_step_time: bool = False
    split_draft_model: bool = True  # measured faster on two H100s: tp_bench_h100.md
    split_draft_head: bool = False  # whole measured faster: 5.91 against 6.89 ms a chain-5 round (tp_bench_h200.md)
    push_all_reduce: bool = True  # 8B TP 2 step on two H100s 3.69 ms against NCCL's 4.03 (tp_bench_h100.md)
    kv_in_attention: bool = True  # SmolLM2 decode graph 586 -> 568 us on an H100 (plain_step_h100.md)
    ahead_after_empty: bool = True  # NGRAM chain 4 on chat, batch 1: 1.00-1.19x plain against 0.79-0.98x (H200)
    simulate_accept_rate: float | None = None
    deterministic: bool = False

    def __post_init__(self):
        rate = self.simulate_accept_rate
        if rate is not None and not 0 <= rate <= 1:
            raise ValueError(f"simulate_accept_rate must be in [0, 1], got {rate}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "RuntimeOptions":
        """The defaults, then the environment's switches, then `overrides` (field=value)."""
        environ = os.environ if environ is None else environ
        values = {}
        for field, (var, flip) in _SWITCHES.items():
            default = cls.__dataclass_fields__[field].default
            values[field] = (not default) if environ.get(var) == flip else default
        values["simulate_accept_rate"] = _env_rate(environ.get(SIMULATE_ACCEPT_RATE_ENV))
        return cls(**{**values, **overrides})

    @classmethod
    def from_args(cls, args, environ: Mapping[str, str] | None = None) -> "RuntimeOptions":
        """An engine's options: EngineArgs' own fields first (speculative_simulate_accept_rate,
        enable_deterministic_inference, disable_overlap_schedule), the environment for the rest."""
        env = cls.from_env(environ, deterministic=args.enable_deterministic_inference)
        if args.disable_overlap_schedule:  # SGLang's: the host reads every step before anything more is queued
            env = dataclasses.replace(env, decode_ahead=False, draft_ahead=False, round_ahead=False)
        if args.speculative_simulate_accept_rate is None:
            return env
        return dataclasses.replace(env, simulate_accept_rate=args.speculative_simulate_accept_rate)


def _env_rate(text: str | None) -> float | None:
    if not text:
        return None
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"{SIMULATE_ACCEPT_RATE_ENV} must be a number in [0, 1], got {text!r}") from None
    if not 0 <= rate <= 1:
        raise ValueError(f"{SIMULATE_ACCEPT_RATE_ENV} must be in [0, 1], got {rate}")
    return rate


# ---- the active options --------------------------------------------------------------------------------------------
_active: contextvars.ContextVar[RuntimeOptions | None] = contextvars.ContextVar("hyperdraft_options", default=None)


@functools.cache
def _process_default() -> RuntimeOptions:
    return RuntimeOptions.from_env()


def current() -> RuntimeOptions:
    """The options of the engine running now, or the process environment's outside any engine (tests that call
    kernels and models directly)."""
    return _active.get() or _process_default()


@contextlib.contextmanager
def activated(options: RuntimeOptions) -> Iterator[RuntimeOptions]:
    """Make `options` the active ones for the enclosed work (in this thread; nesting restores the outer ones)."""
    token = _active.set(options)
    try:
        yield options
    finally:
        _active.reset(token)


# ---- environment that is not a switch -----------------------------------------------------------------------------
def cache_dir() -> Path:
    """`$HYPERDRAFT_CACHE`, or `~/.cache/hyperdraft`: downloaded models and built CUDA kernels."""
    return Path(os.environ.get("HYPERDRAFT_CACHE") or Path.home() / ".cache" / "hyperdraft").expanduser()


@functools.cache
def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels in its CPU interpreter, which lacks libdevice and grid dependencies."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cuda_home() -> str:
    """The CUDA toolkit to find nvcc in."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
