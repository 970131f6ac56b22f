"""Lockstep: the engines of a tensor-parallel group, one per rank, kept making the same decisions.

Rank 0 is the engine the caller drives (LLM, the server). Every call that changes engine state (a request added, an
abort, a cache flush) is recorded there, and at each step the record goes to the other ranks in one broadcast, with
the step itself. Each follower replays it on an engine built from the same arguments, so its scheduler admits,
retracts and commits exactly as rank 0's does (SGLang's tensor-parallel schedulers work the same way), sampling
draws the same numbers from the same seeds, and the forward's collectives meet. Rank 0 alone returns outputs.

On CUDA rank r runs on its node's r-th GPU from the engine's device (cuda:N + local rank); the model's collectives
go over NCCL and these commands over a gloo group beside it (TensorParallel.control). Over several machines
(nnodes, SGLang's flags) node k hosts ranks k*L .. k*L + L-1 (L = tp_size / nnodes): node 0 runs rank 0's engine and
starts its other local ranks; every other node only starts its ranks (host_ranks), which reach rank 0 at
dist_init_addr.

A rank that dies stops the engine with an error instead of a hang: rank 0 checks its followers before every
broadcast, and every collective gives up after dist_timeout seconds.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hyperdraft.config import EngineArgs
from hyperdraft.distributed.push_all_reduce import PushAllReduce
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.options import RuntimeOptions, triton_interpreted


@dataclass(frozen=True)
class Command:
    """One engine call to replay: add (a Request's fields), abort (rid), flush, step, or stop."""

    kind: str
    payload: Any = None


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank` when rank 0 runs on `device`: the next GPUs in order; the CPU for every rank."""
    if rank == 0 or device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def ranks_per_node(args: EngineArgs) -> int:
    return args.tp_size // args.nnodes


def local_rank(args: EngineArgs, rank: int) -> int:
    """A rank's index among its node's ranks (its GPU from the node's first)."""
    return rank % ranks_per_node(args)


def node_ranks(args: EngineArgs) -> range:
    """The ranks this node hosts."""
    per_node = ranks_per_node(args)
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def check_devices(args: EngineArgs, device: torch.device) -> None:
    """Before any process starts: one GPU per local rank."""
    if device.type == "cuda" and (device.index or 0) + ranks_per_node(args) > torch.cuda.device_count():
        raise ValueError(f"tp_size={args.tp_size} over nnodes={args.nnodes} needs one GPU per rank from {device}: "
                         f"this machine has {torch.cuda.device_count()} (lower tp_size or pick another device)")


# What a CPU follower's process has imported before it forks (start_followers): torch, torch._dynamo (loading a
# tokenizer imports transformers' model-loading modules, which import it: 1.4-3.4 s of a follower's start), the
# tokenizer classes every engine loads, and the engine.
FOLLOWER_PRELOAD = ["torch", "torch._dynamo", "transformers.models.auto.tokenization_auto", "hyperdraft.engine.engine"]


def rank_threads(tp_size: int) -> int:
    """Intra-op threads for each rank of a group started from this process: its share of this process's. Every rank
    runs the same count: a draft head (and a STANDALONE draft) runs whole on every rank, and CPU products round
    differently at different thread counts, so ranks with different counts drafted different tokens at a near-tie,
    fell out of step, and the group failed (rank 0 had kept all its threads, the followers half)."""
    return max(1, torch.get_num_threads() // tp_size)


def start_followers(args: EngineArgs, follow: Callable, options, ranks, address: str, device: torch.device) -> list:
    """Start a process running follow(rank, args, options, address, threads) for each rank (threads: rank_threads).

    CUDA ranks start as fresh interpreters (spawn): nothing of this process's CUDA state can reach them. CPU ranks fork
    from a server process that imported torch and the engine once (forkserver, FOLLOWER_PRELOAD): spawn re-imports
    them in every follower, ~6 s of each tp_size-2 CPU engine's start on a 2-core machine, against well under a second
    forked. A forked rank takes this process's environment as it is now (the server's dates from its own start)."""
    if device.type == "cuda":
        ctx, target, head = mp.get_context("spawn"), follow, ()
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(FOLLOWER_PRELOAD)  # takes effect when the server first starts
        target, head = _follow_in_environment, (dict(os.environ), follow)
    threads = rank_threads(args.tp_size)
    followers = [ctx.Process(target=target, args=(*head, rank, args, options, address, threads), daemon=True)
                 for rank in ranks]
    for p in followers:
        p.start()
    return followers


def _follow_in_environment(environ: dict[str, str], follow: Callable, *follow_args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    follow(*follow_args)


def push_wanted(args: EngineArgs, options: RuntimeOptions, rank: int, device: torch.device) -> bool:
    """Whether the small all-reduces go through the push kernel: on one node whose GPUs all reach each other's
    memory (the kernel writes into its peers' buffers), unless turned off; on the CPU only under Triton's interpreter,
    which runs the kernel there (tests). Every rank of a node computes the same answer: the ranks must agree."""
    if not options.push_all_reduce or args.disable_custom_all_reduce or args.nnodes > 1 or args.tp_size == 1:
        return False
    if device.type != "cuda":
        return triton_interpreted()
    first = (device.index or 0) - local_rank(args, rank)
    gpus = range(first, first + ranks_per_node(args))
    return all(torch.cuda.can_device_access_peer(a, b) for a in gpus for b in gpus if a != b)


def init_group(args: EngineArgs, rank: int, address: str, device: torch.device,
               options: RuntimeOptions) -> TensorParallel:
    """Join the group: NCCL for the model's tensors on CUDA (bound to this rank's GPU), gloo on the CPU; on CUDA a
    gloo group beside it for the control messages; the push all-reduce's buffers where push_wanted."""
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    control = None  # the CPU's one gloo group carries both
    if device.type != "cuda":
        dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=args.tp_size,
                                timeout=timeout)
    else:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://{address}", rank=rank, world_size=args.tp_size,
                                timeout=timeout, device_id=device)
        control = dist.new_group(backend="gloo", timeout=timeout)
    wanted = push_wanted(args, options, rank, device)
    push = PushAllReduce.start(rank, args.tp_size, device, control, args.dist_timeout) if wanted else None
    return TensorParallel(rank, args.tp_size, control=control, push=push)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Lockstep:
    def __init__(self, tp: TensorParallel = SINGLE, followers: list | None = None):
        self.tp = tp
        self.followers = followers or []  # rank 0: the follower processes
        self.pending: list[Command] = []

    @classmethod
    def lead(cls, args: EngineArgs, follow: Callable, options, device: torch.device) -> "Lockstep":
        """Rank 0: start this node's other ranks as processes running follow(rank, args, options, address, threads),
        then join the group."""
        check_devices(args, device)
        if dist.is_initialized():
            raise ValueError(f"tp_size={args.tp_size}: this process already belongs to a tensor-parallel group (another "
                             "engine with tp_size > 1 runs here); shut it down first (LLM.shutdown())")
        address = args.dist_init_addr or free_address()
        followers = start_followers(args, follow, options, node_ranks(args)[1:], address, device)
        if device.type != "cuda":  # the followers' count (rank_threads); on CUDA the heads run on the GPUs
            torch.set_num_threads(rank_threads(args.tp_size))
        return cls(init_group(args, 0, address, device, options), followers)

    @property
    def leads(self) -> bool:
        return self.tp.size > 1 and self.tp.rank == 0

    def record(self, kind: str, payload: Any = None) -> None:
        if self.leads:
            self.pending.append(Command(kind, payload))

    def publish_step(self) -> None:
        """Rank 0, before its step: send what was recorded since the last step, and the step."""
        if not self.leads:
            return
        self._check_followers()
        commands, self.pending = self.pending + [Command("step")], []
        dist.broadcast_object_list([commands], src=0, group=self.tp.control)

    def receive(self) -> list[Command]:
        """A follower: the next batch of calls to replay."""
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.control)
        return box[0]

    def gather(self, state: dict) -> list[dict]:
        """Rank 0: every rank's `state` (its engine's own, the followers' through report()), rank order. What was
        recorded since the last step (a flush, an abort) goes first, so the followers report the state rank 0 is in;
        sent only with the next step, they reported the state before it."""
        if not self.leads:
            return [state]
        self._check_followers()
        commands, self.pending = self.pending + [Command("report")], []
        dist.broadcast_object_list([commands], src=0, group=self.tp.control)
        states: list = [None] * self.tp.size
        dist.gather_object(state, states, dst=0, group=self.tp.control)
        return states

    def report(self, state: dict) -> None:
        """A follower's half of gather()."""
        dist.gather_object(state, None, dst=0, group=self.tp.control)

    def close(self) -> None:
        """Rank 0: stop the followers, wait for them to exit, and leave the group. A follower (told to stop): meet
        rank 0 at a barrier; its process then exits without tearing the group down (engine.follow), because gloo's
        threads can abort a process whose peers are already gone."""
        if self.tp.size == 1:
            return
        if not self.leads:
            dist.barrier(group=self.tp.control)
            return
        if all(p.is_alive() for p in self.followers):
            dist.broadcast_object_list([[Command("stop")]], src=0, group=self.tp.control)
            dist.barrier(group=self.tp.control)
        for p in self.followers:
            p.join(timeout=30)
        dist.destroy_process_group()
        self.tp = SINGLE

    def abandon(self) -> None:
        """Rank 0, when its engine failed to build: end the followers without a word (they may be anywhere in their
        own build) and leave the group, so this process can build another engine."""
        for p in self.followers:
            p.kill()
            p.join(timeout=30)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.tp = SINGLE

    def exited(self, wait: float = 0.0) -> list[tuple[int, int]]:
        """(rank, exit code) of this node's followers that have exited, each given up to `wait` seconds to."""
        for p in self.followers:
            p.join(timeout=wait)
        return [(rank, p.exitcode) for rank, p in enumerate(self.followers, 1) if p.exitcode is not None]

    def failure(self) -> str | None:
        """Why the group cannot step any more (one of this node's followers exited), or None. A rank on another node
        that dies fails rank 0's next collective instead."""
        dead = self.exited()
        return f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]}): the engine cannot go on" if dead else None

    def _check_followers(self) -> None:
        failure = self.failure()
        if failure:
            raise RuntimeError(failure)
