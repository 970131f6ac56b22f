"""The push all-reduce (kernels/all_reduce.py, distributed/push_all_reduce.py) against its reference.

- Under Triton's interpreter (TRITON_INTERPRET=1, CPU): the kernel's protocol with 2 and 3 ranks as processes sharing
  memory, over many calls of changing sizes (every slot reused many times), ranks started out of step, parts
  holding -0.0: every rank returns the reference sum, bit for bit.
- On two GPUs: PushAllReduce through torch's symmetric memory equals NCCL's all-reduce (bit for bit but for the sign
  of a zero that both parts hold as -0.0: the reference sum starts from +0.0), eagerly and replayed inside a CUDA
  graph; a peer that never arrives traps instead of hanging.

- The engine at TP 2 on the CPU with the kernel (interpreter, shared-memory files for buffers): plain decoding,
  NGRAM, EAGLE-3 (a chain; adaptive trees), a split STANDALONE draft, a Qwen3.5 hybrid with its MTP head and a
  Qwen3-Next sparse model give TP 1's output, so every rank makes the same all-reduces in the same order (else a part
  never arrives and the run hangs).
- Wherever triton is installed (not under the interpreter): its sm_90 compile moves the buffers' data 16 bytes per
  access.

`python3 -m pytest tests/gpu/test_push_all_reduce.py -q` (two GPUs), or with TRITON_INTERPRET=1 on the CPU.
"""

from __future__ import annotations

import os
import random
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from hyperdraft.kernels.all_reduce import BLOCK, INT_OF, SENTINEL, SLOTS, all_reduce_reference, push_all_reduce

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _parts(world: int, dtype: torch.dtype, shapes: list[tuple[int, ...]], seed: int) -> list[list[torch.Tensor]]:
    """Per call, each rank's part: random values with some exact zeros of both signs."""
    g = torch.Generator().manual_seed(seed)
    calls = []
    for shape in shapes:
        parts = []
        for _ in range(world):
            x = torch.randn(shape, generator=g)
            x[torch.rand(shape, generator=g) < 0.05] = -0.0
            x[torch.rand(shape, generator=g) < 0.05] = 0.0
            parts.append(x.to(dtype))
        calls.append(parts)
    return calls


def _interpreted_rank(rank, world, recv, counters, calls, outs):
    time.sleep(0.05 * rank)  # out of step: the later rank's parts land while the earlier one polls
    buffers = torch.tensor([b.data_ptr() for b in recv], dtype=torch.int64)
    slot = recv[0].numel() // (SLOTS * world)
    rng = random.Random(rank)
    for c, parts in enumerate(calls):
        if rng.random() < 0.2:
            time.sleep(0.01)
        outs[c][rank].copy_(push_all_reduce(parts[rank], buffers, slot, counters[rank], rank, world))


@pytest.mark.skipif(not INTERPRET, reason="runs the kernel under Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bf16 by truncation
def test_protocol_under_interpreter(world, dtype):
    width = torch.empty(0, dtype=dtype).element_size()
    slot = 4 * BLOCK
    shapes = [(1, 100), (3, 1300), (2, 2048), (1, 7), (4, 1024)] * 4  # 20 calls: each chunk's slots reused 6+ times
    calls = _parts(world, dtype, shapes, seed=world)
    recv = [torch.full((SLOTS * world * slot,), SENTINEL[width], dtype=INT_OF[width]).share_memory_()
            for _ in range(world)]
    counters = [torch.zeros(4, dtype=torch.int64).share_memory_() for _ in range(world)]
    outs = [[torch.full_like(parts[0], float("nan")).share_memory_() for _ in range(world)] for parts in calls]
    procs = [mp.get_context("fork").Process(target=_interpreted_rank, args=(r, world, recv, counters, calls, outs))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    for c, parts in enumerate(calls):
        want = all_reduce_reference(parts)
        for rank in range(world):
            assert torch.equal(outs[c][rank].view(INT_OF[width]), want.view(INT_OF[width])), (c, rank)
    assert all(torch.equal(counters[0], k) for k in counters)
    assert counters[0][:2].tolist() == [20, 12]  # chunk 0 in every call, chunk 1 in the 12 wider than BLOCK


# ---- the engine with it, on the CPU under the interpreter ----------------------------------------------------------
ENGINE_CASES = {
    "plain": {},
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1),
    "standalone-tree": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=2,
                            speculative_num_draft_tokens=6),
    "eagle3-tree-adaptive": dict(speculative_algorithm="EAGLE3", speculative_adaptive=True),
    "hybrid-mtp": dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2,
                       speculative_num_draft_tokens=5),
    "moe": {},
}
TARGETS = {"hybrid-mtp": "qwen3_5", "moe": "qwen3_next"}  # the rest: the 4-layer Llama


def _engine_outputs(model: str, extra: dict, tp_size: int, push: bool, out_path: str | None = None):
    from hyperdraft import LLM, SamplingParams
    from hyperdraft.options import RuntimeOptions

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 380, (n,), generator=g).tolist() for n in (3, 17, 40, 9)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (12, 5, 16, 9)]
    llm = LLM(model, device="cpu", dtype="float32", max_running_requests=4, chunked_prefill_size=24, tp_size=tp_size,
              dist_timeout=120, runtime_options=RuntimeOptions.from_env(push_all_reduce=push), **extra)
    try:
        outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
        pushed = llm.engine.lockstep.tp.push is not None
        states = llm.engine.rank_states()
        free = [s["kv_free_tokens"] + s.get("cache_tokens", 0) == s["kv_capacity_tokens"] for s in states]
    finally:
        llm.shutdown()
    if out_path is not None:
        torch.save((outs, pushed, free), out_path)
    return outs


@pytest.fixture(scope="module")
def engine_models(tmp_path_factory):
    from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
    from hyperdraft.testing.tiny import make_tiny_model

    from helpers.hybrid_fixtures import with_mtp_weights

    root = tmp_path_factory.mktemp("push_engine")
    target = make_tiny_model(str(root / "llama"), "llama", seed=2, num_hidden_layers=4)
    return {"target": target, "head": write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3",
                                                                     draft_vocab_size=200),
            "draft": make_tiny_model(str(root / "draft"), "qwen3", seed=1),
            "qwen3_5": with_mtp_weights(make_tiny_model(str(root / "q35"), "qwen3_5", seed=3), str(root / "q35_mtp")),
            "qwen3_next": make_tiny_model(str(root / "qn"), "qwen3_next", seed=4)}


@pytest.mark.skipif(not INTERPRET, reason="runs the kernel under Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_the_engine_at_tp2_with_push_equals_tp1(engine_models, case, tmp_path):
    """Every rank must make the same all-reduces, of the same shapes, in the same order, or the push kernel waits
    for a part that never comes (NCCL would not notice a different order of equal sizes). The engine at TP 2 with
    it, on the CPU (gloo for everything else), through plain decoding and each drafter: TP 1's output, pools free."""
    extra = dict(ENGINE_CASES[case])
    if case.startswith("eagle3"):
        extra["speculative_draft_model_path"] = engine_models["head"]
    if case == "standalone-tree":
        extra["speculative_draft_model_path"] = engine_models["draft"]  # split over the ranks too: its own sums
    target = engine_models[TARGETS.get(case, "target")]
    want = _engine_outputs(target, extra, 1, False)
    out_path = str(tmp_path / "tp2.pt")
    proc = mp.get_context("spawn").Process(target=_engine_outputs, args=(target, extra, 2, True, out_path))
    proc.start()
    proc.join(timeout=900)
    if proc.is_alive():
        proc.kill()
        pytest.fail("TP 2 with the push all-reduce hung: the ranks' all-reduces differ")
    assert proc.exitcode == 0
    got, pushed, free = torch.load(out_path)
    assert pushed and all(free)
    assert got == want


# ---- two GPUs ------------------------------------------------------------------------------------------------------
SHAPES = [(1, 4096), (8, 4096), (48, 4096), (1, 576), (3, 1000), (32, 8192)]  # the last fills an fp32 slot


def _gpu_rank(rank: int, port: int, result_path: str) -> None:
    import torch.distributed as dist

    from hyperdraft.distributed.push_all_reduce import PushAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=device)
    push = PushAllReduce.start(rank, 2, device, dist.new_group(backend="gloo"))
    failures = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        calls = _parts(2, dtype, SHAPES * 3, seed=7)
        for c, parts in enumerate(calls):
            x = parts[rank].to(device)
            assert push.fits(x)
            nccl = x.clone()
            dist.all_reduce(nccl)
            if not torch.equal(push(x), nccl):
                failures.append(("eager", str(dtype), c))
        # inside one graph: 50 calls back to back on changing inputs, replayed 3 times
        inputs = [torch.empty(SHAPES[c % len(SHAPES)], dtype=dtype, device=device) for c in range(50)]
        push(inputs[0])  # warm the kernel before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = [push(x) for x in inputs]
        for replay in range(3):
            calls = _parts(2, dtype, [tuple(x.shape) for x in inputs], seed=100 + replay)
            for x, parts in zip(inputs, calls):
                x.copy_(parts[rank])
            graph.replay()
            torch.cuda.synchronize()
            for c, (out, parts) in enumerate(zip(outputs, calls)):
                if not torch.equal(out.cpu(), all_reduce_reference(parts)):
                    failures.append(("graph", str(dtype), replay, c))
    if rank == 0:
        torch.save(failures, result_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices")
def test_equals_nccl_on_two_gpus(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gpu_rank, args=(port, str(tmp_path / "failures.pt")), nprocs=2, join=True)
    assert torch.load(tmp_path / "failures.pt") == []


def _lonely_rank(result_path: str) -> None:
    """A rank whose peer never comes: its own buffers stand in for the peer's, whose slots stay empty."""
    width = 2
    recv = torch.full((SLOTS * 2 * BLOCK,), SENTINEL[width], dtype=INT_OF[width], device="cuda")
    buffers = torch.tensor([recv.data_ptr(), recv.data_ptr()], dtype=torch.int64, device="cuda")
    counters = torch.zeros(1, dtype=torch.int64, device="cuda")
    try:
        push_all_reduce(torch.ones(1, 64, dtype=torch.bfloat16, device="cuda"), buffers, BLOCK, counters, 0, 2,
                        wait_limit_s=2.0)  # pushes into the peer's slot of rank 0's own buffer: waits for rank 1's
        torch.cuda.synchronize()
        outcome = "returned"
    except RuntimeError as error:
        outcome = f"raised: {error}"
    with open(result_path, "w") as f:
        f.write(outcome)


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device")
def test_a_missing_peer_traps_instead_of_hanging(tmp_path):
    path = str(tmp_path / "outcome.txt")
    proc = mp.get_context("spawn").Process(target=_lonely_rank, args=(path,))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode is not None, "the kernel hung"
    assert open(path).read().startswith("raised"), open(path).read()


@pytest.mark.skipif(INTERPRET, reason="compiles the kernel: run without TRITON_INTERPRET")
@pytest.mark.parametrize("dtype,sentinel", [("*bf16", SENTINEL[2]), ("*fp32", SENTINEL[4])])
def test_buffer_accesses_compile_16_bytes_wide(dtype, sentinel):
    """The receive buffers' addresses come from memory, so the kernel states their alignment; without it every push,
    poll and refill compiled to one 2-byte access per element. Compiled for sm_90 (no GPU needed, only triton)."""
    import re

    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hyperdraft.kernels.all_reduce import _push_all_reduce

    names = ("X", "Out", "Buffers", "Counters", "n", "slot_size")
    types = (dtype, dtype, "*i64", "*i64", "i32", "i32")
    consts = dict(SENTINEL=sentinel, RANK=1, WORLD=2, BLOCK=BLOCK, LIMIT_NS=10**9, TRAP=True)
    signature = {**dict(zip(names, types)), **{k: "constexpr" for k in consts}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 4, 5)}  # as a launch specialises them
    source = ASTSource(fn=_push_all_reduce, signature=signature, constexprs=consts, attrs=aligned)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    accesses = set(re.findall(r"(?:st|ld\.volatile)\.global\.[a-z0-9.]+", ptx)) - {"st.global.b64"}  # the counter
    assert accesses == {"ld.volatile.global.v4.b32", "st.global.v4.b32"}, accesses
