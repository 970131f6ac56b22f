"""Engine: owns the models, the KV cache and the scheduler; step() runs one forward."""

from __future__ import annotations

import dataclasses
import os
import logging
import random

import torch

from hyperdraft.config import SPECULATIVE_ALGORITHMS, EngineArgs
from hyperdraft.core.schedule import StepOutput
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.engine.device import device_lost, resolve_device
from hyperdraft.engine.gc_policy import adopt_serving_policy
from hyperdraft.engine.lockstep import Command, Lockstep, init_group, local_rank, rank_device
from hyperdraft.engine.logs import configure_logging
from hyperdraft.engine.memory import (checked_rows, fitting_rows, kv_bytes_per_slot, kv_capacity_tokens,
                                      memory_budget_bytes, state_bytes_per_row)
from hyperdraft.engine.model_worker import ModelWorker
from hyperdraft.engine.numerics import check_deterministic, numerics_mode
from hyperdraft.engine.scheduler import Scheduler
from hyperdraft.engine.stop import StopChecker
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.kvcache.prefix_cache import PrefixCache
from hyperdraft.kvcache.radix_tree import RadixTree
from hyperdraft.kvcache.state_snapshots import StateSnapshots
from hyperdraft.models.cpu_linear import pack_for_verify
from hyperdraft.models.config import load_model_config
from hyperdraft.models.loader import load_model, load_tokenizer
from hyperdraft.models.tensor_parallel import rank_config
from hyperdraft.options import RuntimeOptions, activated
from hyperdraft.request import Request, check_prompt
from hyperdraft.runner.graph_runner import GraphSettings, default_batch_sizes, default_graph_max_bs
from hyperdraft.runner.model_runner import ModelRunner
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.speculative.adaptive.controller import make_tier_source
from hyperdraft.speculative.config import resolve_spec_config
from hyperdraft.speculative.metrics import PhaseTimer
from hyperdraft.speculative.proposer import Proposer, ProposerContext
from hyperdraft.speculative.proposers import proposer_class
from hyperdraft.speculative.worker import SpecWorker

logger = logging.getLogger("hyperdraft")


class Engine:
    def __init__(self, args: EngineArgs, options: RuntimeOptions | None = None, tp: TensorParallel | None = None):
        """options: the runtime switches (default: RuntimeOptions.from_args, i.e. the environment's); active around
        everything the engine runs, from loading and capture to every step. tp: a follower rank's place in its
        tensor-parallel group (engine/lockstep.py); None builds rank 0, which starts the others when tp_size > 1."""
        if args.model_path is None:
            raise ValueError("model_path is required (pass model=PATH)")
        if tp is None and args.node_rank > 0:
            raise ValueError(f"node_rank={args.node_rank}: this machine only hosts tensor-parallel ranks; node 0 runs "
                             "the engine (run `hyperdraft serve --node-rank K ...` here, which blocks until it stops)")
        configure_logging(args.log_level)
        self.args = args
        self.options = options if options is not None else RuntimeOptions.from_args(args)
        with activated(self.options):
            self.device = rank_device(resolve_device(args.device), 0 if tp is None else local_rank(args, tp.rank))
            self.lockstep = self._lockstep(tp)
            try:
                tree = self._build()
            except BaseException as error:
                if self.lockstep.leads:  # followers may be anywhere in their own build: end them
                    self._abandon_group(error)
                raise
        self.prefix_cache = self._prefix_cache(tree)
        self.scheduler = self._make_scheduler()
        self._seed_rng = random.Random(args.random_seed)

    def _build(self) -> RadixTree | None:
        """The models, pools, runners and graphs -> the prefix cache's (empty) tree, or None without a cache."""
        args = self.args
        model = load_model(args.model_path, args.dtype, self.device, args.load_format, self.lockstep.tp)
        self.model_config = model.config
        dtype = next(model.parameters()).dtype
        self.numerics = numerics_mode(self.device, dtype, self.options)  # docs/numerics.md
        self.tokenizer = None if args.skip_tokenizer_init else \
            load_tokenizer(args.tokenizer_path or args.model_path, args.trust_remote_code)
        self.context_len = args.context_length_for(self.model_config.max_position_embeddings)
        self.spec = resolve_spec_config(args, self.model_config.architecture, self.options)
        proposer_cls = proposer_class(self.spec.algorithm) if self.spec is not None else None
        heads = self.spec is not None and SPECULATIVE_ALGORITHMS[self.spec.algorithm].head
        draft_tp = self.lockstep.tp if (self.options.split_draft_head if heads else self.options.split_draft_model) \
            else SINGLE
        draft = proposer_cls.load_draft(self.spec, model, args, self.device, draft_tp) if proposer_cls else None
        tree = None if args.disable_radix_cache else RadixTree(args.page_size)  # stays empty without a cache
        parked_bytes = proposer_cls.parked_bytes_per_slot(draft) if self._parks_head() else 0
        self.max_rows, self.page_table = self._page_table(model, draft, tree, parked_bytes)
        backend = args.attention_backend or ("triton" if self.device.type == "cuda" else "torch")
        check_deterministic(self.model_config, self.device, backend, self.options)
        graphs = self._graph_settings(backend, dtype)
        self.runner = ModelRunner(model, self.page_table, backend, graphs, self._verify_width())
        self.worker = self._make_worker(proposer_cls, draft, backend, graphs)
        if self.options.packed_cpu_verify:  # CPU verifies of 3+ rows via blocked weights, in what the pools left
            pack_for_verify([model, draft], self._verify_width(), self.device)
        if graphs is not None:
            self.worker.capture_graphs(list(graphs.batch_sizes))
        return tree

    def _abandon_group(self, error: BaseException) -> None:
        """Rank 0's build failed: end the followers and leave the group. When a follower's exit is what failed it
        (rank 0 only sees its collective break), say which rank."""
        broken = isinstance(error, Exception) and not isinstance(error, ValueError)  # ValueError: rank 0's own verdict
        dead = self.lockstep.exited(wait=2.0) if broken else []
        self.lockstep.abandon()
        if dead:
            rank, code = dead[0]
            raise RuntimeError(f"tensor-parallel rank {rank} exited (code {code}) while building its engine; its own "
                               "error is in its output") from error

    def _lockstep(self, tp: TensorParallel | None) -> Lockstep:
        if tp is not None or self.args.tp_size == 1:
            return Lockstep(tp or SINGLE)
        rank_config(load_model_config(self.args.model_path), TensorParallel(0, self.args.tp_size))  # before any process
        return Lockstep.lead(self.args, follow, self.options, self.device)

    def _prefix_cache(self, tree: RadixTree | None) -> PrefixCache | None:
        """An EAGLE head's K/V at a position depends on the next token (lookahead 1); a drafter with a pool of its
        own bounds what may be cached by its draft_num_computed; hybrid models' states (the target's, a STANDALONE
        draft's) are snapshot at cached ends, read from their slots, or from where a plain decode queued ahead left
        them."""
        if tree is None:
            return None
        proposer = self.worker.proposer if self.spec is not None else None
        lookahead = 1 if proposer is not None and proposer.capabilities.feeds_hidden else 0
        draft_state = proposer is not None and proposer.capabilities.recurrent_state
        pools = [p for p in (self.runner.state_pool, proposer.runner.state_pool if draft_state else None) if p]
        locate = (lambda row: self.worker.state_at.get(row, -1)) if self.spec is None else (lambda row: -1)
        head = proposer if lookahead else None  # an EagleProposer: its pending hidden state goes with a snapshot
        snapshots = StateSnapshots(pools, self.max_rows, tree, locate, self.runner.pool if head else None,
                                   head.hidden_buf if head else None) if pools else None
        return PrefixCache(tree, self.page_table, lookahead, draft_kv=proposer is not None and proposer.pool is not None,
                           snapshots=snapshots, draft_state=draft_state,
                           parked=proposer.parked_heads() if proposer is not None else None)

    def _page_table(self, model, draft, tree: RadixTree | None, parked_bytes: int) -> tuple[int, PageTable]:
        """(rows, one page table for every pool): the budget goes to the recurrent states of the rows first (hybrid
        models), the rest to K/V pages, split by the target's and the draft's bytes per token (and a parked head's
        inputs, parked_bytes a slot)."""
        args = self.args
        models = [m for m in (model, draft) if m is not None]
        bytes_per_slot = sum(kv_bytes_per_slot(m) for m in models) + parked_bytes
        budget = self.lockstep.tp.agree_min(memory_budget_bytes(args, bytes_per_slot, self.device))
        # each model's scratch at its own width: a draft model's reaches a tree's farthest node, past the verify
        state_per_row = state_bytes_per_row(model, self._verify_width())
        state_per_row += state_bytes_per_row(draft, self.spec.max_verify_tokens) if draft is not None else 0
        if tree is not None:  # the prefix cache's state snapshots, one per row
            state_per_row += sum(state_bytes_per_row(m, 0) for m in models)
        rows = fitting_rows(args, budget, state_per_row)
        capacity = kv_capacity_tokens(args, bytes_per_slot, budget, (rows + 1) * state_per_row, rows, self.device)
        rows = checked_rows(args, capacity, rows, state_per_row, self.context_len)
        return rows, PageTable(
            num_pages=capacity // args.page_size + 1,  # + the reserved padding page
            page_size=args.page_size,
            max_rows=rows,
            # a row never holds more pages than the pool has, and one column more stays the padding page (where
            # token_slots clamps indices past a row's pages): sized by context_length alone, a 1M-token context
            # made a 2 GiB table for a pool of 256 tokens
            max_pages_per_row=min(-(-(self.context_len + self._decode_reserve()) // args.page_size),
                                  capacity // args.page_size + 1),
            device=self.device,
            cache=tree,
        )

    def _verify_width(self) -> int:
        """The most tokens one request verifies in a forward, over every tier (a hybrid model's state scratch); without
        speculation, the one entry a decode queued ahead writes (engine/model_worker.py)."""
        if self.spec is None:
            return 1 if self.options.decode_ahead else 0
        return max(t.num_draft_tokens for t in [self.spec.tier, *self.spec.tiers()])

    def _decode_reserve(self) -> int:
        """K/V room a decoding request needs past its tokens: the widest round any tier can run, or 1."""
        return self.spec.max_verify_tokens if self.spec is not None else 1

    def _make_worker(self, proposer_cls: type[Proposer] | None, draft, backend: str, graphs: GraphSettings | None):
        if self.spec is None:
            return ModelWorker(self.runner, self.options.decode_ahead)
        timer = PhaseTimer(self.device, self.options.record_step_time)
        ctx = ProposerContext(self.spec, self.runner, backend, graphs, self.options, timer, self.max_rows,
                              self._parks_head())
        tiers = make_tier_source(self.spec.tier, self.spec.adaptive, list(graphs.batch_sizes) if graphs else None)
        proposer = proposer_cls.build(ctx, draft)
        sink, caps = proposer.decode_sink(), proposer.capabilities
        # decodes that draft nothing run as plain steps (speculative/worker.py): adaptive step 0 for a drafter idle
        # there or parking there, and an NGRAM round without a match at any tier; never over a hybrid target
        plain_steps = ((self._plain_step_zero() and (caps.idle_at_step_zero or sink is not None))
                       or (caps.may_draft_nothing and not self.model_config.is_hybrid))
        plain = ModelWorker(self.runner, self.options.decode_ahead, sink, as_rounds=True) if plain_steps else None
        return SpecWorker(self.runner, proposer, self.spec, tiers, timer, self.lockstep.tp, plain,
                          verify_ahead=self.options.decode_ahead, round_ahead=self.options.round_ahead,
                          ahead_after_empty=self.options.ahead_after_empty)

    def _plain_step_zero(self) -> bool:
        """Step-0 batches of decodes may run as plain decodes (speculative/worker.py): under adaptive tiers, over a
        dense target (a hybrid model's queued decode keeps states the rounds do not know about)."""
        return self.spec is not None and self.spec.adaptive is not None and not self.model_config.is_hybrid

    def _parks_head(self) -> bool:
        return self._plain_step_zero() and self.options.park_head

    def _graph_settings(self, backend: str, dtype: torch.dtype) -> GraphSettings | None:
        """The batch sizes to capture CUDA graphs for, or None when every forward runs eagerly."""
        emulate = self.device.type == "cpu" and self.options.emulate_cuda_graphs
        if self.args.disable_cuda_graph or not (emulate or self.device.type == "cuda"):
            return None
        if not emulate and backend != "triton":
            logger.warning("CUDA graphs need attention_backend='triton' (the torch backend builds its metadata on "
                           "the host); running eagerly")
            return None
        if self.model_config.is_hybrid and not emulate and not self.options.fused_kernels:
            # The torch state backend plans from the batch's host lists, which a captured graph would freeze (an
            # emulated replay plans again from the refilled static buffers, so CPU tests run hybrids with graphs).
            logger.warning("CUDA graphs of a hybrid (linear-attention) model need the Triton state backend (CUDA, "
                           "fused kernels on); running eagerly")
            return None
        if self.args.cuda_graph_bs is not None:  # SGLang's explicit list: batches past a row count cannot occur
            sizes = sorted({min(size, self.max_rows) for size in self.args.cuda_graph_bs})
        else:
            max_bs = self.args.cuda_graph_max_bs or self.lockstep.tp.agree_min(default_graph_max_bs(
                self.device, self.model_config, dtype, self._verify_width(), emulate))
            sizes = default_batch_sizes(min(max_bs, self.max_rows))
        return GraphSettings(tuple(sizes), emulate=emulate, segments=self.options.graph_segments)

    def _make_scheduler(self) -> Scheduler:
        tokenizer, chunk = self.tokenizer, self.args.effective_chunked_prefill_size
        eos = self.model_config.eos_token_ids or (
            (tokenizer.eos_token_id,) if tokenizer is not None and tokenizer.eos_token_id is not None else ())
        # A request ends with "length" where it would outgrow the whole pool, as SGLang's max_req_len does (it was
        # aborted there: an OpenAI client got finish_reason "abort"); its newest token needs no slot yet.
        longest = min(self.context_len, self.page_table.capacity_slots + 1)
        return Scheduler(self.page_table, StopChecker(tokenizer, eos, longest),
                         max_running_requests=self.max_rows,
                         prefill_budget=chunk if chunk > 0 else self.context_len, chunked_prefill=chunk > 0,
                         decode_reserve=self._decode_reserve(), cache=self.prefix_cache)

    # ---- requests -----------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt text needs a tokenizer, but skip_tokenizer_init=True; pass input_ids instead")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None,
                    input_ids: list[int] | None = None, rid: str | None = None) -> Request:
        """Validate and queue one request. Bad input raises ValueError and leaves the engine untouched."""
        params = SamplingParams() if params is None else params  # {} too is refused by check_request
        if input_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            input_ids = self.tokenize(prompt)
        self.check_request(params, input_ids)
        rid = self.scheduler.rid_for(rid)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = Request(rid, list(input_ids), params, seed)
        self.scheduler.add(req)
        self.lockstep.record("add", (req.rid, req.prompt_ids, params, seed))
        return req

    def check_request(self, params: SamplingParams, ids: list[int]) -> None:
        """Raise ValueError, naming the field, for a request this engine cannot serve as asked."""
        if not isinstance(params, SamplingParams):  # a dict failed as "AttributeError: 'dict' object has no attribute"
            raise ValueError(f"params must be a SamplingParams (LLM.generate also takes a dict of its fields), got "
                             f"{type(params).__name__}")
        params.validate(self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer, which skip_tokenizer_init=True leaves unloaded; "
                             "stop must be None here (stop_token_ids work without it)")
        check_prompt(ids, self.model_config.vocab_size, self.context_len, self.page_table.capacity_slots)

    def abort(self, rid: str) -> Request | None:
        aborted = self.abort_many([rid])
        return aborted[0] if aborted else None

    def abort_many(self, rids: list[str]) -> list[Request]:
        """The requests among rids still waiting or running, aborted (their K/V freed) in one pass."""
        if not rids:
            return []
        self.lockstep.record("abort", list(rids))
        return self.scheduler.abort(set(rids))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -----------------------------------------------------------------------------------------------
    @torch.no_grad()  # products outside the runners' inference mode (EAGLE-3's fc) must not record autograd
    def step(self) -> list[StepOutput]:
        self.lockstep.publish_step()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        with activated(self.options):
            results = self.worker.run(batch)
        return self.scheduler.commit(batch, results)

    # ---- introspection ------------------------------------------------------------------------------------------
    @property
    def kv_free_slots(self) -> int:
        return self.page_table.num_free_slots

    @property
    def kv_capacity_slots(self) -> int:
        return self.page_table.capacity_slots

    @property
    def kv_cached_slots(self) -> int:
        """Slots the prefix cache owns (referenced by running requests or not)."""
        return self.page_table.cache.num_pages * self.page_table.page_size if self.page_table.cache else 0

    def flush_cache(self) -> bool:
        """Free every cached page and empty the drafter's history of earlier requests, as SGLang's flush_cache: only
        while no request is queued or running (their pages are referenced) -> whether it flushed."""
        if self.scheduler.has_unfinished():
            return False
        self.lockstep.record("flush")
        self._flush()
        return True

    def _flush(self) -> None:
        self.page_table.flush_cache()
        if self.spec is not None:  # every rank drafts for itself, so every rank forgets
            self.worker.proposer.flush_history()

    # ---- tensor parallelism -------------------------------------------------------------------------------------
    def replay_until_stopped(self) -> None:
        """A follower rank: replay rank 0's calls, step by step, until it stops the group."""
        while True:
            for command in self.lockstep.receive():
                if command.kind == "stop":
                    return
                self._replay(command)

    def _replay(self, command: Command) -> None:
        if command.kind == "add":
            self.scheduler.add(Request(*command.payload))
        elif command.kind == "abort":
            self.scheduler.abort(set(command.payload))
        elif command.kind == "flush":
            self._flush()
        elif command.kind == "report":
            self.lockstep.report(self._rank_state())
        else:
            self.step()

    def pool_state(self) -> dict:
        """The pools, queues and adaptive tiers: internal_state's part that every rank of a tensor-parallel group has
        of its own (and must agree on)."""
        tiers = {"speculative_adaptive_slots": self.worker.tiers.state()} if self.spec and self.spec.adaptive else {}
        return {"kv_capacity_tokens": self.kv_capacity_slots, "kv_free_tokens": self.kv_free_slots,
                "num_running_reqs": len(self.scheduler.running), "num_waiting_reqs": len(self.scheduler.waiting),
                **self.cache_state(), **tiers}

    def rank_states(self) -> list[dict]:
        """pool_state() of every rank of the tensor-parallel group (this engine's alone without one), with its thread
        count (lockstep.rank_threads)."""
        return self.lockstep.gather(self._rank_state())

    def _rank_state(self) -> dict:
        return {**self.pool_state(), "intra_op_threads": torch.get_num_threads()}

    def close(self) -> None:
        """Destroy the CUDA graphs (their memory goes back; graphs holding NCCL collectives must go before the group),
        then stop the other ranks of a tensor-parallel group (rank 0) and leave it. Later steps would run eagerly."""
        if not device_lost(self.device):  # else a trapped kernel took the context: the graphs cannot be freed
            self.worker.release_graphs()
        self.lockstep.close()

    def cache_state(self) -> dict:
        """The prefix cache's size and counters (internal_state, /metrics)."""
        return self.prefix_cache.report() if self.prefix_cache is not None else {"radix_cache": False}

    def server_args(self) -> dict:
        """The arguments as this engine resolved them, as SGLang's server_info reports its arguments after its hooks
        filled them in: the running-request cap and context length it sized for, and the speculative shape it
        started with (internal_state has the tier in use now)."""
        resolved = {"max_running_requests": self.max_rows, "context_length": self.context_len}
        if self.spec is not None:
            tier = self.spec.tier
            resolved.update(speculative_algorithm=self.spec.algorithm, speculative_num_steps=tier.steps,
                            speculative_eagle_topk=tier.topk, speculative_num_draft_tokens=tier.num_draft_tokens)
        return {**dataclasses.asdict(self.args), **resolved}

    def internal_state(self) -> dict:
        spec = self.worker.state() if self.spec is not None else {}
        return {**spec, **self.pool_state(), "numerics": self.numerics}


def follow(rank: int, args: EngineArgs, options: RuntimeOptions, address: str, threads: int) -> None:
    """A follower rank's process (engine/lockstep.py): its engine replays rank 0's calls until told to stop."""
    torch.set_num_threads(threads)
    tp = init_group(args, rank, address, rank_device(resolve_device(args.device), local_rank(args, rank)), options)
    engine = Engine(args, options, tp)
    adopt_serving_policy()
    engine.replay_until_stopped()
    engine.close()
    os._exit(0)  # without the group's teardown (Lockstep.close says why)
