"""Where the host's time goes in a batch-1 speculative round on a small model (SmolLM2-135M shape, random bf16
weights, EAGLE-3 head with an 8k draft vocabulary, real greedy verification), section by section.

round_timeline.py showed the GPU idle for about half of each chain-5 round on this shape: the host takes ~2.4 ms per
round against ~1.5 ms of GPU work. This probe wraps the round's host stages with wall-clock timers (no syncs, so the
GPU runs as in a real run) and counts the Triton launches made inside each, so the stages worth cutting stand out.
Times are inclusive (a stage's time contains the stages it calls) and are means per engine step in us.

  python -m benchmarks.probes.round_host [--steps 5] [--topk 1] [--rounds 300] [--plain] [--count-ops]
      [--deterministic] [--out $OUT]

--count-ops also counts the torch operators each stage dispatches itself (exclusive of the stages it calls; a
TorchDispatchMode, which slows every op, so its times are not the real ones). On a GPU each is a launch or a host
tensor op of a few microseconds; on CPU (`--device cpu`) the same Python runs, so the counts outside the target
forward are the GPU run's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import tempfile
import time

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import SMOLLM2, eagle3_spec, make_engine, write_configs
from hyperdraft.sampling_params import SamplingParams


class Sections:
    """Inclusive host time and Triton launches per named stage."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()  # (stage, operator) -> dispatches, --count-ops
        self.open: list[str] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            self.open.append(name)
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                self.open.pop()

        setattr(owner, attr, timed)

    def count_launches(self) -> None:
        from triton.runtime.jit import JITFunction

        run = JITFunction.run

        def counted(jit_self, *a, **kw):
            for name in self.open:
                self.launches[name] += 1
            self.launches["(all)"] += 1
            return run(jit_self, *a, **kw)

        JITFunction.run = counted

    def count_ops(self):
        """A dispatch mode that charges each torch operator to the innermost open stage."""
        from torch.utils._python_dispatch import TorchDispatchMode

        sections = self

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                stage = sections.open[-1] if sections.open else "(outside)"
                sections.ops[(stage, str(func.overloadpacket.__name__))] += 1
                return func(*args, **(kwargs or {}))

        return Counting()

    def op_report(self, steps: int) -> str:
        per_stage: collections.Counter = collections.Counter()
        for (stage, _), n in self.ops.items():
            per_stage[stage] += n
        lines = [f"{'stage (torch ops, exclusive)':<34} {'ops/step':>9}  most frequent"]
        for stage, n in per_stage.most_common():
            top = sorted(((c, op) for (s, op), c in self.ops.items() if s == stage), reverse=True)[:6]
            lines.append(f"{stage:<34} {n / steps:9.1f}  " + ", ".join(f"{op} {c / steps:.1f}" for c, op in top))
        return "\n".join(lines)

    def report(self, steps: int) -> str:
        lines = [f"{'stage':<34} {'us/step':>9} {'calls/step':>10} {'launches/step':>13}"]
        for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name:<34} {1e6 * s / steps:9.1f} {self.calls[name] / steps:10.2f} "
                         f"{self.launches[name] / steps:13.2f}")
        lines.append(f"{'(all Triton launches)':<34} {'':9} {'':10} {self.launches['(all)'] / steps:13.2f}")
        return "\n".join(lines)


def instrument(engine, sections: Sections) -> None:
    import hyperdraft.core.host_copy as host_copy
    import hyperdraft.speculative.worker as worker_module
    from hyperdraft.speculative.verify.chain import ChainRound
    from hyperdraft.speculative.verify.tree import TreeRound

    worker = engine.worker
    sections.wrap(engine, "step", "Engine.step")
    sections.wrap(engine.scheduler, "schedule", "scheduler.schedule")
    sections.wrap(engine.scheduler, "commit", "scheduler.commit")
    sections.wrap(worker, "run", "worker.run")
    sections.wrap(worker.runner, "forward", "target forward (verify)")
    sections.wrap(host_copy.HostCopy, "wait", "HostCopy.wait (the sync)")
    proposer = getattr(worker, "proposer", None)
    if proposer is None:
        return
    sections.wrap(worker, "_propose", "worker._propose")
    sections.wrap(worker, "_draft_ahead", "worker._draft_ahead")
    sections.wrap(worker.verify_ahead, "queue", "verify_ahead.queue (round-ahead)")
    sections.wrap(worker, "_commit", "worker._commit")
    sections.wrap(worker_module, "verify_batch", "verify_batch")
    sections.wrap(worker_module, "HostCopy", "HostCopy(...) (queue the copy)")
    sections.wrap(proposer, "propose", "proposer.propose")
    sections.wrap(proposer, "target_hidden", "proposer.target_hidden")
    sections.wrap(proposer, "extend", "proposer.extend")
    sections.wrap(proposer, "draft_ahead", "proposer.draft_ahead")
    for cls in (ChainRound, TreeRound):
        sections.wrap(cls, "__init__", f"{cls.__name__}.__init__")
        sections.wrap(cls, "accept", f"{cls.__name__}.accept")
        sections.wrap(cls, "pieces", f"{cls.__name__}.pieces")
        sections.wrap(cls, "decode", f"{cls.__name__}.decode")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--alpha", type=float, default=None, help="simulated acceptance (default: real greedy verification)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (emulated graphs, fp32)")
    ap.add_argument("--plain", action="store_true", help="plain decoding instead of a speculative round")
    ap.add_argument("--count-ops", action="store_true", help="count torch operators per stage (slows the run)")
    ap.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (as real_accept runs on a GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.device == "cuda":
        require_cuda()
    target, head = write_configs(tempfile.mkdtemp(), SMOLLM2, 8192)
    width = a.draft_tokens or a.steps + 1
    spec = None if a.plain else eagle3_spec(head, steps=a.steps, topk=a.topk, num_draft_tokens=width, alpha=a.alpha)
    engine, _ = make_engine(target, a.device, 8, spec, 8 * 4096, deterministic=a.deterministic)
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0.0, max_new_tokens=(a.rounds + 40) * (a.steps + 1), ignore_eos=True)
    engine.add_request(input_ids=torch.randint(10, SMOLLM2["vocab_size"] - 10, (512,)).tolist(), params=params)
    for _ in range(30):
        engine.step()
    sync()
    sections = Sections()
    instrument(engine, sections)
    if a.device == "cuda":
        sections.count_launches()
    counting = sections.count_ops() if a.count_ops else contextlib.nullcontext()
    start = time.perf_counter()
    with counting:
        for _ in range(a.rounds):
            engine.step()
    sync()
    wall = (time.perf_counter() - start) / a.rounds
    label = "plain" if a.plain else (f"chain {a.steps}" if a.topk == 1 else f"tree {a.steps}x{a.topk}/{width}")
    label += ", deterministic" if a.deterministic else ""
    text = f"smollm2, {label}, batch 1, {a.rounds} steps: wall {wall * 1e6:.1f} us/step\n" + sections.report(a.rounds)
    if a.count_ops:
        text += "\n" + sections.op_report(a.rounds)
    print(text)
    with open(os.path.join(a.out, f"round_host_{label.replace(' ', '_').replace('/', '-').replace(',', '')}.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
