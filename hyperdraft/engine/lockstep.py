"""Lockstep: the engines of a tensor-parallel group, one per rank, kept making the same decisions.

Rank 0 is the engine the caller drives (LLM, the server). Every call that changes engine state (a request added, an
abort, a cache flush) is recorded there, and at each step the record goes to the other ranks in one broadcast, with
the step itself. Each follower replays it on an engine built from the same arguments, so its scheduler admits,
retracts and commits exactly as rank 0's does (SGLang's tensor-parallel schedulers work the same way), sampling
draws the same numbers from the same seeds, and the forward's collectives meet. Rank 0 alone returns outputs.

A rank that dies stops the engine with an error instead of a hang: rank 0 checks its followers before every
broadcast, and every collective gives up after dist_timeout seconds.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from hyperdraft.config import EngineArgs
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel


@dataclass(frozen=True)
class Command:
    """One engine call to replay: add (a Request's fields), abort (rid), flush, step, or stop."""

    kind: str
    payload: Any = None


def init_group(args: EngineArgs, rank: int, address: str) -> TensorParallel:
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=args.tp_size,
                            timeout=datetime.timedelta(seconds=args.dist_timeout))
    return TensorParallel(rank, args.tp_size)


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
    def lead(cls, args: EngineArgs, follow: Callable, options) -> "Lockstep":
        """Rank 0: start ranks 1.. as processes running follow(rank, args, options, address), then join the group."""
        if dist.is_initialized():
            raise ValueError(f"tp_size={args.tp_size}: this process already belongs to a tensor-parallel group (another "
                             "engine with tp_size > 1 runs here); shut it down first (LLM.shutdown())")
        address = args.dist_init_addr or free_address()
        ctx = mp.get_context("spawn")
        followers = [ctx.Process(target=follow, args=(rank, args, options, address), daemon=True)
                     for rank in range(1, args.tp_size)]
        for p in followers:
            p.start()
        return cls(init_group(args, 0, address), followers)

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
        dist.broadcast_object_list([commands], src=0)

    def receive(self) -> list[Command]:
        """A follower: the next batch of calls to replay."""
        box: list = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, state: dict) -> list[dict]:
        """Rank 0: every rank's `state` (its engine's own, the followers' through report()), rank order."""
        if not self.leads:
            return [state]
        self._check_followers()
        dist.broadcast_object_list([[Command("report")]], src=0)
        states: list = [None] * self.tp.size
        dist.gather_object(state, states, dst=0)
        return states

    def report(self, state: dict) -> None:
        """A follower's half of gather()."""
        dist.gather_object(state, None, dst=0)

    def close(self) -> None:
        """Rank 0: stop the followers, wait for them to exit, and leave the group. A follower (told to stop): meet
        rank 0 at a barrier; its process then exits without tearing the group down (engine.follow), because gloo's
        threads can abort a process whose peers are already gone."""
        if self.tp.size == 1:
            return
        if not self.leads:
            dist.barrier()
            return
        if all(p.is_alive() for p in self.followers):
            dist.broadcast_object_list([[Command("stop")]], src=0)
            dist.barrier()
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

    def _check_followers(self) -> None:
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.followers, 1) if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel rank {dead[0][0]} exited (code {dead[0][1]}): the engine cannot go on")
