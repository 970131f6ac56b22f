"""Shared fixtures for the CPU / fp32 test suite.

- tiny random checkpoints, built once per session (one per architecture kind);
- make_llm: creates LLMs and, at teardown, checks the "KV pool fully free, no request left" invariant;
- hf_greedy: transformers' own greedy generation, the reference for token equality;
- random_prompts: deterministic random token-id prompts.
"""

from __future__ import annotations

import functools
import random
import signal
import threading

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model

KINDS = ("llama", "qwen2", "qwen3", "mqa", "mistral")
VOCAB_SIZE = 384  # hyperdraft.testing.tiny.make_tokenizer's default; checked in the tiny_models fixture

# One intra-op thread: these models are tiny, and with 2 threads on a 2-core box any other busy process makes
# OpenMP synchronisation stall for seconds at a time (measured: 0.03 s -> 3 s for the same generate call).
torch.set_num_threads(1)


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True, **kw)


TEST_TIME_LIMIT_S = 120


@pytest.fixture(autouse=True)
def _fail_instead_of_hanging():
    """A scheduler that never admits a request makes generate() loop forever: turn that into a test failure."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"test ran over {TEST_TIME_LIMIT_S} s: the engine is probably stuck")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TEST_TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="session")
def _private_cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hyperdraft-cache"))


@pytest.fixture(autouse=True)
def _private_cache(request, _private_cache_dir, monkeypatch):
    """CPU tests never write to the user's cache (~/.cache/hyperdraft): every tiny GGUF a test loads left its
    converted tokenizer there, keyed by a temporary path, for good (117 of them after a few runs). GPU tests keep the
    real cache: they read the default model from it."""
    if "gpu" not in request.node.path.parts:
        monkeypatch.setenv("HYPERDRAFT_CACHE", _private_cache_dir)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    paths = {kind: make_tiny_model(str(root / kind), kind) for kind in KINDS}
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(paths["llama"]).vocab_size == VOCAB_SIZE
    return paths


@pytest.fixture(scope="session")
def llama_path(tiny_models) -> str:
    return tiny_models["llama"]


def assert_kv_accounted(engine) -> None:
    """Every page is free, the prefix cache's, or one running request's own, and no cached page that nothing
    references is counted as referenced (or the other way round)."""
    table = engine.page_table
    assert engine.kv_free_slots + engine.kv_cached_slots + table.num_private_slots == engine.kv_capacity_slots, (
        f"KV pages unaccounted for: free {engine.kv_free_slots} + cached {engine.kv_cached_slots} + in use "
        f"{table.num_private_slots} != {engine.kv_capacity_slots}")
    cache = table.cache
    if cache is not None:
        nodes = cache.nodes()
        assert sum(len(n.pages) for n in nodes) == cache.num_pages
        assert sum(len(n.pages) for n in nodes if n.refs == 0) == cache.evictable_pages
        locks = [r.cache_node for r in engine.scheduler.running if r.cache_node is not None]
        for n in nodes:  # a node's references are exactly the running requests whose locked node is it or below it
            assert n.refs == sum(1 for lock in locks if _on_path(lock, n)), "prefix-cache references out of step"


def _on_path(node, ancestor) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def assert_engine_clean(llm: LLM) -> None:
    """The invariant every test must leave behind: no request queued or running, every page accounted for, nothing
    in the prefix cache referenced, and every KV slot free once the cache is flushed."""
    engine = llm.engine
    sched = engine.scheduler
    assert not sched.running, f"requests left running: {[r.rid for r in sched.running]}"
    assert not sched.waiting, f"requests left waiting: {[r.rid for r in sched.waiting]}"
    assert not sched.live_rids, f"rids of ended requests still counted live: {sorted(sched.live_rids)[:8]}"
    assert_kv_accounted(engine)
    assert engine.page_table.num_private_slots == 0, "a finished request still holds pages of its own"
    assert engine.flush_cache(), "flush_cache refused with nothing running"
    assert engine.kv_cached_slots == 0, f"{engine.kv_cached_slots} cached slots still referenced after a flush"
    assert engine.kv_free_slots == engine.kv_capacity_slots, (
        f"KV pool leak: {engine.kv_capacity_slots - engine.kv_free_slots} of {engine.kv_capacity_slots} slots still held"
    )
    snapshots = engine.prefix_cache.snapshots if engine.prefix_cache is not None else None
    assert snapshots is None or snapshots.num_free == snapshots.count, "state snapshots held after a flush"
    # a hybrid model's state slots follow the rows: every row free is every state slot free
    assert engine.page_table.num_free_rows == engine.page_table.max_rows, "page-table rows (and state slots) leaked"


@pytest.fixture
def make_llm():
    """make_llm(path, **engine_args) -> LLM on CPU in fp32; every LLM made is checked clean at teardown."""
    created: list[LLM] = []

    def factory(path: str, **engine_args) -> LLM:
        engine_args.setdefault("device", "cpu")
        engine_args.setdefault("dtype", "float32")
        llm = LLM(path, **engine_args)
        created.append(llm)
        return llm

    yield factory
    for llm in created:
        assert_engine_clean(llm)


def run_until_done(llm: LLM, reqs, max_steps: int = 5000) -> None:
    """Drive engine.step() until every request in reqs is finished; fail (instead of hanging) if it never ends."""
    for _ in range(max_steps):
        if all(r.finished for r in reqs):
            return
        llm.engine.step()
    pytest.fail(f"requests not finished after {max_steps} steps: "
                f"{[(r.rid, r.num_computed, len(r.output_ids)) for r in reqs if not r.finished]}")


def generate_ids(llm: LLM, prompts, params) -> list:
    return llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)


# ---- the transformers reference --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # The engine's ignore_eos only means "EOS does not stop": EOS stays a candidate token. HF's min_new_tokens
    # instead masks EOS out of the logits, which would change the argmax whenever EOS is the top token. With
    # no EOS configured, min_new_tokens is inert and HF generates exactly max_new_tokens plain greedy tokens.
    model.generation_config.eos_token_id = None
    return model


@functools.lru_cache(maxsize=None)
def _hf_greedy_one(path: str, prompt: tuple[int, ...], n: int) -> tuple[int, ...]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return tuple(out[0, len(prompt):].tolist())


def hf_greedy(path: str, prompts, n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, run individually (no padding), exactly n tokens each."""
    return [list(_hf_greedy_one(path, tuple(p), n)) for p in prompts]


def hf_logits(path: str, ids) -> torch.Tensor:
    """[len(ids), V] fp32 logits of transformers' forward over ids."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([list(ids)])).logits[0].float()


def random_prompts(lengths, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
