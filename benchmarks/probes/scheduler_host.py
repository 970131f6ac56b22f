"""Host time of the scheduler's per-step bookkeeping for B running decodes, no model: schedule (room for every
decode), the room a decode queued ahead asks for (PageTable.reserve_ahead), and the commit of each request's tokens.

On an H100 a plain SmolLM2 step at 256 requests is host-bound (cProfile on the device: page-table reserves, the
commit and the stop check are its largest Python costs), and a speculative round at 64 requests spends ~38 us of
host time per request outside its GPU phases (real_accept_h100.md, seventh run). This isolates the part that does not
depend on the drafter. Two shapes: a plain step (one token a step, room for one, a decode queued ahead) and a chain
round (room for 6, 3 tokens committed, the rejected drafts' room released). Page size 1 is the default (SGLang's):
every decode takes a page a step. Median us per step over turns, and per request.

  python -m benchmarks.probes.scheduler_host [--batch 64 256] [--steps 400] [--turns 5] [--out $OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hyperdraft.core.schedule import RequestResult
from hyperdraft.engine.scheduler import Scheduler
from hyperdraft.engine.stop import StopChecker
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request
from hyperdraft.sampling_params import SamplingParams

PROMPT_LEN = 16
SHAPES = {  # name -> (decode reserve, tokens committed per step, drafts verified per step or None, queued ahead)
    "plain step": (1, 1, None, True),
    "chain round (5 drafts, 2 accepted)": (6, 3, 5, False),
}


def started(batch: int, steps: int, page_size: int, reserve: int, per_step: int) -> Scheduler:
    max_tokens = PROMPT_LEN + (steps + 2) * per_step + reserve + 8
    pages_per_row = -(-max_tokens // page_size)
    table = PageTable(batch * pages_per_row + 1, page_size, batch, pages_per_row, torch.device("cpu"))
    scheduler = Scheduler(table, StopChecker(None, (2,), 1 << 30), batch, prefill_budget=1 << 30,
                          chunked_prefill=False, decode_reserve=reserve)
    params = SamplingParams(temperature=0, max_new_tokens=(steps + 2) * per_step)
    for i in range(batch):
        scheduler.add(Request(str(i), list(range(10, 10 + PROMPT_LEN)), params, seed=i))
    prefill = scheduler.schedule()
    scheduler.commit(prefill, [RequestResult(it.num_tokens, [7]) for it in prefill.items])
    return scheduler


def step_us(scheduler: Scheduler, steps: int, per_step: int, drafted: int | None, ahead: bool) -> float:
    tokens = [7] * per_step
    table = scheduler.page_table
    start = time.perf_counter()
    for _ in range(steps):
        batch = scheduler.schedule()
        reqs = [it.req for it in batch.items]
        if ahead:
            table.reserve_ahead([r.row for r in reqs], [r.num_computed + 2 for r in reqs])
        result = RequestResult(per_step, tokens, num_drafted=drafted, num_accepted=per_step - 1,
                               keeps_room=drafted is None)
        scheduler.commit(batch, [result] * len(reqs))
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    lines = ["| shape | page size | batch | us per step | us per request | turns |", "|---|---|---|---|---|---|"]
    for name, (reserve, per_step, drafted, ahead) in SHAPES.items():
        for page_size in a.page_size:
            for batch in a.batch:
                runs = []
                for _ in range(a.turns):
                    scheduler = started(batch, a.steps, page_size, reserve, per_step)
                    runs.append(step_us(scheduler, a.steps, per_step, drafted, ahead))
                median = statistics.median(runs)
                lines.append(f"| {name} | {page_size} | {batch} | {median:.0f} | {median / batch:.2f} | "
                             f"{' '.join(f'{r:.0f}' for r in runs)} |")
                print(lines[-1], flush=True)
    with open(os.path.join(a.out, "scheduler_host.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
