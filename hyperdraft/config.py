"""EngineArgs: the single definition of every engine option.

The same frozen dataclass backs `LLM(**kwargs)` and the CLI flags (one flag
per field, `--page-size` for `page_size`), with SGLang's server-arg names.
It is validated once in __post_init__ and never mutated afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field, fields
from typing import Any

ALIASES = {"model": "model_path", "tokenizer": "tokenizer_path", "speculative_draft_model": "speculative_draft_model_path",
           "tensor_parallel_size": "tp_size"}
ATTENTION_BACKENDS = ("torch", "triton")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# SGLang's other spellings of the same values (its --dtype choices and its name for the reference attention)
VALUE_ALIASES = {"dtype": {"half": "float16", "float": "float32"}, "attention_backend": {"torch_native": "torch"}}
LOAD_FORMATS = ("auto", "dummy")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SPECULATIVE_SAMPLING_MODES = ("coupled", "rejection")
SPECULATIVE_ATTENTION_MODES = ("prefill", "decode")  # SGLang's; one attention kernel serves both here
NGRAM_MATCH_WINDOWS = (1, 12)  # the prompt-lookup chain's default (min, max) suffix lengths


@dataclass(frozen=True)
class AlgorithmTraits:
    """What a speculative algorithm's drafts can be; the option checks and help texts read these."""

    draft_model: bool  # runs a draft model or head (speculative_draft_model_path)
    trees: bool  # can draft trees (speculative_eagle_topk > 1) and draw drafts from q (rejection sampling)
    own_mtp: bool = False  # without speculative_draft_model_path, drafts with the target's own MTP module
    head: bool = False  # drafts with a head over the target's hidden states (split under TP by split_draft_head)


# SGLang's algorithm names. speculative/proposers/__init__.py registers one Proposer class under each.
SPECULATIVE_ALGORITHMS = {
    "NGRAM": AlgorithmTraits(draft_model=False, trees=False),
    "STANDALONE": AlgorithmTraits(draft_model=True, trees=True),
    "EAGLE": AlgorithmTraits(draft_model=True, trees=True, own_mtp=True, head=True),
    "EAGLE3": AlgorithmTraits(draft_model=True, trees=True, head=True),
}
SPECULATIVE_ALIASES = {"NEXTN": "EAGLE", "MTP": "EAGLE"}  # NEXTN / MTP: the target's own MTP module
SPECULATIVE_NOT_YET: tuple[str, ...] = ()


def _algorithm_help() -> str:
    names = ", ".join(SPECULATIVE_ALGORITHMS)
    aliases = ", ".join(f"{alias} = {name}" for alias, name in SPECULATIVE_ALIASES.items())
    mtp = ", ".join(name for name, traits in SPECULATIVE_ALGORITHMS.items() if traits.own_mtp)
    not_yet = f"; not yet: {', '.join(SPECULATIVE_NOT_YET)}" if SPECULATIVE_NOT_YET else ""
    return (f"{names} ({aliases}; {mtp} without a draft path drafts with a hybrid model's own MTP module)"
            f"{not_yet}")


def _draft_path_help() -> str:
    users = ", ".join(name for name, traits in SPECULATIVE_ALGORITHMS.items() if traits.draft_model)
    return f"draft model directory ({users}: a draft LM for STANDALONE, a head for the EAGLE family) (alias: --speculative-draft-model)"


def _opt(default: Any, help: str, **extra) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class EngineArgs:
    model_path: str | None = _opt(None, "Hugging Face model directory or a Llama .gguf file (alias: --model); the CLI defaults to the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = _opt(None, "tokenizer directory; defaults to the model directory")
    skip_tokenizer_init: bool = _opt(False, "run from token ids only; no tokenizer is loaded")
    trust_remote_code: bool = _opt(False, "let transformers run tokenizer code that the model directory ships (SGLang's flag); the model itself always runs hyperdraft's own code, and architectures it lacks are refused by name")
    dtype: str = _opt("auto", "weight and activation dtype", choices=DTYPE_CHOICES)
    device: str = _opt("auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    context_length: int | None = _opt(None, "maximum sequence length; defaults to the model's max_position_embeddings")
    page_size: int = _opt(1, "tokens per KV-cache page")
    max_total_tokens: int | None = _opt(None, "KV-pool capacity in tokens; default from mem_fraction_static on GPU")
    mem_fraction_static: float = _opt(0.85, "GPU memory fraction for weights plus KV pools")
    max_running_requests: int | None = _opt(None, "most requests decoding at once (default 256)")
    chunked_prefill_size: int | None = _opt(None, "prefill tokens per step; -1 disables chunking (default 8192)")
    random_seed: int = _opt(0, "seed for requests that set no seed of their own")
    attention_backend: str | None = _opt(None, "attention implementation: triton (the default on CUDA) or torch (the default on CPU, and the reference)", choices=ATTENTION_BACKENDS)
    log_level: str = _opt("warning", "logging level")
    disable_cuda_graph: bool = _opt(False, "run every forward eagerly (no CUDA graphs)")
    disable_radix_cache: bool = _opt(False, "turn prefix caching off: every prompt is computed from scratch (the radix cache shares whole K/V pages of common prefixes between requests; on hybrid models with snapshots of the recurrent state where a cached prefix ends)")
    enable_deterministic_inference: bool = _opt(False, "CUDA: batch-invariant kernels, so a request's tokens never depend on what else runs with it, the verify width, graphs or the prefill split; greedy speculative output is then bit for bit plain decoding's in bf16 (dense attention models; costs some speed, see docs/numerics.md)")
    cuda_graph_max_bs: int | None = _opt(None, "largest batch size captured in CUDA graphs; larger batches run eagerly (default: up to 256 as free GPU memory allows, capped by max_running_requests)")
    cuda_graph_bs: tuple[int, ...] | None = _opt(None, "SGLang's: exactly these batch sizes are captured (a batch runs in the smallest at least its size; larger than all, eagerly), instead of the default ladder up to cuda_graph_max_bs", nargs="+")
    disable_overlap_schedule: bool = _opt(False, "SGLang's: no host/GPU overlap, so nothing is queued on the device before the host has read a step (the decode_ahead, draft_ahead and round_ahead runtime switches off)")
    enable_mixed_chunk: bool = _opt(False, "SGLang's; accepted for its command lines and changes nothing: prefill chunks always share a forward with the decodes here")
    # ---- tensor parallelism (SGLang names) ----
    tp_size: int = _opt(1, "tensor-parallel ranks, one process each, the model split over them (alias: --tensor-parallel-size); on GPUs one GPU per rank (NCCL), on the CPU gloo; dense, Qwen3.5 and Qwen3-Next models")
    dist_init_addr: str | None = _opt(None, "host:port where the ranks meet (default: a free local port)")
    disable_custom_all_reduce: bool = _opt(False, "tensor parallelism: every all-reduce through NCCL (default: on one node of GPUs that reach each other's memory, decode and verify rows go through the one-launch push kernel, kernels/all_reduce.py: 1.61x TP 1's Llama-8B step latency on two H100s against NCCL's 1.48x)")
    dist_timeout: float = _opt(600.0, "seconds a rank waits in a collective before the engine stops with an error")
    nnodes: int = _opt(1, "machines the tensor-parallel ranks run on, tp_size / nnodes on each (with --dist-init-addr)")
    node_rank: int = _opt(0, "this machine's index among nnodes: node 0 runs rank 0 (the engine that serves); another node only hosts its ranks (`hyperdraft serve --node-rank K` blocks until rank 0 stops)")
    # ---- speculative decoding (SGLang names) ----
    speculative_algorithm: str | None = _opt(None, _algorithm_help())
    speculative_draft_model_path: str | None = _opt(None, _draft_path_help())
    speculative_num_steps: int | None = _opt(None, "draft tokens per round (chain depth, tree depth)")
    speculative_eagle_topk: int | None = _opt(None, "branching factor per draft step; > 1 drafts a tree (" + ", ".join(
        name for name, traits in SPECULATIVE_ALGORITHMS.items() if traits.trees) + ")")
    speculative_num_draft_tokens: int | None = _opt(None, "tokens verified per round, the root included (steps + 1 for chains)")
    speculative_use_rejection_sampling: bool | None = _opt(None, "draft models: sample drafts from q and verify with the real q (True, implies --speculative-sampling rejection), or draft greedily / top-k (False); unset = per step, sampled when any request samples (measured better at T>0)")
    speculative_sampling: str | None = _opt(None, "how sampled requests are verified: coupled (the default: a draft is accepted iff it equals the target's own sample keyed by seed and position, so output equals plain decoding's and a seeded request is reproducible whatever else runs) or rejection (the classic accept/reject with residual resampling)", choices=SPECULATIVE_SAMPLING_MODES)
    speculative_attention_mode: str = _opt("prefill", "SGLang's: whether its prefill or decode attention backend runs the verify and the draft's extend; accepted for its command lines and changes nothing: one attention kernel serves every verify here", choices=SPECULATIVE_ATTENTION_MODES)
    speculative_adaptive: bool = _opt(False, "switch the draft tier (steps, or a tree shape) per batch size and measured acceptance")
    speculative_adaptive_config: str | None = _opt(None, "JSON file in SGLang's adaptive format (slots keyed by batch size), or that JSON object inline; default: SGLang's")
    speculative_token_map: str | None = _opt(None, "EAGLE, NEXTN, MTP (heads scoring the whole vocabulary): hot token ids, a torch file of a list or 1-D tensor (SGLang's .pt) or a .json list; the head's lm_head keeps only those rows (FR-Spec), so a draft step over a large vocabulary reads far fewer bytes; verification is unchanged, outputs stay lossless")
    speculative_simulate_accept_rate: float | None = _opt(None, "BENCHMARK ONLY, LOSSY: accept each draft token with this probability instead of verifying it (every kernel still runs); env HYPERDRAFT_SIMULATE_ACCEPT_RATE")
    speculative_simulate_sibling_rate: float | None = _opt(None, "BENCHMARK ONLY, with speculative_simulate_accept_rate, trees: the probability that a node's next-ranked child matches when the children ranked before it did not (rank 0 matches with the accept rate); unset: only the first child can match, so a tree accepts like a chain")
    load_format: str = _opt("auto", "auto: read the checkpoint's weights; dummy: random weights of the checkpoint's shapes (benchmarks)", choices=LOAD_FORMATS)
    speculative_ngram_min_match_window_size: int = _opt(NGRAM_MATCH_WINDOWS[0], "NGRAM: shortest suffix that may match")
    speculative_ngram_max_match_window_size: int = _opt(NGRAM_MATCH_WINDOWS[1], "NGRAM: longest suffix tried first")
    # SGLang 0.5.23's NGRAM: any of these four makes NGRAM draft its trie tree instead of the prompt-lookup chain
    speculative_ngram_min_bfs_breadth: int | None = _opt(None, "NGRAM trie tree: children per node for the longest matches (BFS; default 1)")
    speculative_ngram_max_bfs_breadth: int | None = _opt(None, "NGRAM trie tree: most children per node, for the shortest matches; the tree's topk (default 10)")
    speculative_ngram_match_type: str | None = _opt(None, "NGRAM trie tree: BFS (children by recency, wider for shorter matches) or PROB (by frequency, best first) (default BFS)", choices=("BFS", "PROB"))
    speculative_ngram_max_trie_depth: int | None = _opt(None, "NGRAM trie tree: longest n-gram kept, the matched suffix included (default 18)")

    def __post_init__(self):
        def bad(name: str, allowed: str):
            raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        for name, aliases in VALUE_ALIASES.items():  # canonical before validation; never changed afterwards
            object.__setattr__(self, name, aliases.get(getattr(self, name), getattr(self, name)))
        if self.cuda_graph_bs is not None:
            object.__setattr__(self, "cuda_graph_bs", _graph_sizes(self.cuda_graph_bs, self.cuda_graph_max_bs))
        if self.page_size < 1:
            bad("page_size", "an integer >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            bad("max_total_tokens", "an integer >= 1")
        if not 0 < self.mem_fraction_static < 1:
            bad("mem_fraction_static", "in (0, 1)")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            bad("max_running_requests", "an integer >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            bad("chunked_prefill_size", "-1 (disabled) or an integer >= 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            bad("cuda_graph_max_bs", "an integer >= 1")
        if self.context_length is not None and self.context_length < 2:
            bad("context_length", "an integer >= 2")
        if self.tp_size < 1:
            bad("tp_size", "an integer >= 1")
        if not isinstance(self.random_seed, int) or isinstance(self.random_seed, bool):
            bad("random_seed", "an integer")
        if str(self.log_level).upper() not in LOG_LEVELS:
            bad("log_level", f"one of {', '.join(level.lower() for level in LOG_LEVELS)}")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            bad("nnodes", f"an integer >= 1 dividing tp_size={self.tp_size}")
        if not 0 <= self.node_rank < self.nnodes:
            bad("node_rank", f"an integer in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            bad("dist_init_addr", "node 0's HOST:PORT, the same on every node (required with nnodes > 1)")
        if self.dist_timeout <= 0:
            bad("dist_timeout", "a number of seconds > 0")
        if self.dtype not in DTYPE_CHOICES:
            bad("dtype", f"one of {DTYPE_CHOICES}")
        if self.speculative_simulate_accept_rate is not None and not 0 <= self.speculative_simulate_accept_rate <= 1:
            bad("speculative_simulate_accept_rate", "a probability in [0, 1]")
        if self.speculative_simulate_accept_rate is not None and self.speculative_algorithm is None:
            raise ValueError("speculative_simulate_accept_rate needs speculative_algorithm (it replaces verification)")
        if self.speculative_simulate_sibling_rate is not None and not 0 <= self.speculative_simulate_sibling_rate <= 1:
            bad("speculative_simulate_sibling_rate", "a probability in [0, 1]")
        if self.speculative_simulate_sibling_rate is not None and self.speculative_simulate_accept_rate is None:
            raise ValueError("speculative_simulate_sibling_rate needs speculative_simulate_accept_rate (it shapes the "
                             "simulated acceptance of tree siblings)")
        if self.load_format not in LOAD_FORMATS:
            bad("load_format", f"one of {LOAD_FORMATS}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"one of {ATTENTION_BACKENDS}")
        if self.speculative_sampling is not None and self.speculative_sampling not in SPECULATIVE_SAMPLING_MODES:
            bad("speculative_sampling", f"one of {SPECULATIVE_SAMPLING_MODES}")
        if self.speculative_attention_mode not in SPECULATIVE_ATTENTION_MODES:
            bad("speculative_attention_mode", f"one of {SPECULATIVE_ATTENTION_MODES}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        resolved = {}
        for key, value in kwargs.items():
            name = ALIASES.get(key, key)
            if name not in names:
                raise ValueError(f"unknown engine argument {key!r}; allowed: {sorted(names | set(ALIASES))}")
            if name in resolved:
                raise ValueError(f"engine argument {name!r} given twice (directly and through an alias)")
            resolved[name] = value
        return cls(**resolved)

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)

    @property
    def effective_chunked_prefill_size(self) -> int:
        return 8192 if self.chunked_prefill_size is None else self.chunked_prefill_size

    @property
    def effective_max_running_requests(self) -> int:
        return self.max_running_requests or 256

    def context_length_for(self, max_position_embeddings: int) -> int:
        """The context length over a model that was trained to max_position_embeddings: context_length, warned of
        when longer (positions the model never saw; SGLang and vLLM refuse it unless told to allow it)."""
        if self.context_length is None:
            return max_position_embeddings
        if self.context_length > max_position_embeddings:
            logging.getLogger("hyperdraft").warning(
                "context_length=%d is longer than the model's max_position_embeddings=%d: output past that position "
                "may be wrong", self.context_length, max_position_embeddings)
        return self.context_length


def _graph_sizes(sizes, max_bs: int | None) -> tuple[int, ...]:
    """cuda_graph_bs checked by name, as a sorted tuple without repeats."""
    if (not isinstance(sizes, (list, tuple)) or not sizes
            or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes)):
        raise ValueError(f"cuda_graph_bs must be a non-empty list of integers >= 1, got {sizes!r}")
    sizes = tuple(sorted(set(sizes)))
    if max_bs is not None and max_bs != sizes[-1]:
        raise ValueError(f"cuda_graph_max_bs={max_bs} and cuda_graph_bs={list(sizes)} disagree: with cuda_graph_bs the "
                         "largest captured size is its largest entry (set one of them, or make them agree)")
    return sizes


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One CLI flag per EngineArgs field, named after it."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + [f"--{a.replace('_', '-')}" for a, target in ALIASES.items() if target == f.name]
        kind = _field_type(f)
        if f.metadata.get("nargs"):
            group.add_argument(*names, dest=f.name, type=int, nargs=f.metadata["nargs"], default=None,
                               help=f.metadata["help"])
        elif kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"])
        else:
            aliases = VALUE_ALIASES.get(f.name, {})
            spelled = (lambda text, aliases=aliases: aliases.get(text, text)) if aliases else kind  # before choices
            also = f"; also {', '.join(f'{a} = {c}' for a, c in aliases.items())}" if aliases else ""
            group.add_argument(*names, dest=f.name, type=spelled, default=None,
                               help=f"{f.metadata['help']} (default: {f.default}{also})", choices=f.metadata.get("choices"))


def engine_args_from_namespace(ns: argparse.Namespace, **overrides) -> EngineArgs:
    given = vars(ns)  # the subcommand's flags; None = not given
    values = {f.name: given[f.name] for f in fields(EngineArgs) if given.get(f.name) is not None}
    return EngineArgs.from_kwargs(**{**values, **overrides})


def _field_type(f) -> type:
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str
