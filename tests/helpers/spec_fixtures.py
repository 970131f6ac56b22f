"""Fixtures and helpers for the speculative-decoding tests (tests/test_spec_*.py).

Import what a test module needs from here (fixtures included: pytest finds fixtures in the importing module).

- spec_models: tiny checkpoints built once per session (cached across modules):
    target        llama kind, hidden 64, 2 layers, 4 heads / 2 KV heads, tied embeddings, with the tiny tokenizer
    draft_small   qwen3 kind, hidden 32, 1 layer, 2 heads / 1 KV head, head_dim 16: a draft that differs from the
                  target in hidden size, layer count and head counts (same 384-token vocabulary)
    draft_wide    computes the target's function exactly, in a different shape (hidden 80, 3 layers, 8 heads / 4 KV
                  heads): greedy drafts are always accepted
    draft_wide_noisy  draft_wide with perturbed weights: agrees with the target often but not always, so verification
                  accepts runs of every length and rejects at every depth (rollbacks of both KV pools)
    draft_vocab300  a draft whose vocabulary differs from the target's
    sv_target / sv_draft  small-vocabulary (12 tokens) target and an unrelated draft, no tokenizer
- llm_factory: creates LLMs on CPU/fp32 and, at teardown, asserts that every one of them is clean (no request
  running or waiting, every KV slot free).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil

import pytest
import torch

from tests.conftest import assert_engine_clean, assert_kv_accounted
from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model

VOCAB = 384  # the tiny tokenizer's vocabulary
SMALL_VOCAB = 12

DRAFT_SMALL_CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16)

_MODELS: dict[str, str] = {}


def _widened_copy(src: str, dst: str, rel_noise: float = 0.0, seed: int = 0) -> str:
    """A draft that computes the same function as the llama-kind target src (so greedy drafts agree with the
    target) but has a different shape: hidden 64 -> 80, heads 4/2 -> 8/4 (head_dim 16 kept), layers 2 -> 3.

    - extra hidden dims are zero everywhere (zero embedding columns; every projection reads zeros from them and
      writes zeros into them); RMSNorm over 80 dims sees mean(x^2) * 64/80, so norm weights are scaled by
      sqrt(64/80) and eps by 64/80, which gives back the 64-dim result exactly (up to rounding);
    - the extra query heads and KV heads have zero weights and zero o_proj columns: they add nothing (the GQA map
      h -> h // 2 sends the original 4 query heads to the original 2 KV heads, as in the target);
    - the extra (last) layer has all-zero projections, so it adds zero to the residual stream.
    rel_noise > 0 then perturbs the original (non-embedding) weights, for partial agreement.
    """
    from safetensors.torch import load_file, save_file

    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, layers = cfg["head_dim"], cfg["num_hidden_layers"]
    assert cfg["tie_word_embeddings"] and cfg["model_type"] == "llama"
    H, NH, NKV = h + 16, 2 * nh, 2 * nkv
    scale = math.sqrt(h / H)
    cfg.update(hidden_size=H, num_attention_heads=NH, num_key_value_heads=NKV, num_hidden_layers=layers + 1,
               rms_norm_eps=cfg["rms_norm_eps"] * h / H)
    gen = torch.Generator().manual_seed(seed)

    def noisy(t):
        return t + rel_noise * t.std() * torch.randn(t.shape, generator=gen) if rel_noise else t

    def pad(t, rows, cols):
        out = torch.zeros(rows, cols)
        out[: t.shape[0], : t.shape[1]] = t
        return out

    def norm(w):
        return torch.cat([w * scale, torch.ones(H - h)])

    src_t = load_file(os.path.join(src, "model.safetensors"))
    out = {"model.embed_tokens.weight": pad(src_t["model.embed_tokens.weight"], cfg["vocab_size"], H),
           "model.norm.weight": norm(src_t["model.norm.weight"])}
    inter = cfg["intermediate_size"]
    for i in range(layers + 1):
        pre, old = f"model.layers.{i}.", (lambda n: src_t[f"model.layers.{i}.{n}.weight"]) if i < layers else None
        get = (lambda n: noisy(old(n))) if old else (lambda n: torch.zeros(0, 0))
        out[pre + "input_layernorm.weight"] = norm(old("input_layernorm")) if old else torch.ones(H)
        out[pre + "post_attention_layernorm.weight"] = norm(old("post_attention_layernorm")) if old else torch.ones(H)
        out[pre + "self_attn.q_proj.weight"] = pad(get("self_attn.q_proj"), NH * hd, H)
        out[pre + "self_attn.k_proj.weight"] = pad(get("self_attn.k_proj"), NKV * hd, H)
        out[pre + "self_attn.v_proj.weight"] = pad(get("self_attn.v_proj"), NKV * hd, H)
        out[pre + "self_attn.o_proj.weight"] = pad(get("self_attn.o_proj"), H, NH * hd)
        out[pre + "mlp.gate_proj.weight"] = pad(get("mlp.gate_proj"), inter, H)
        out[pre + "mlp.up_proj.weight"] = pad(get("mlp.up_proj"), inter, H)
        out[pre + "mlp.down_proj.weight"] = pad(get("mlp.down_proj"), H, inter)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def with_eos(src: str, dst: str, eos_token_id: int) -> str:
    """A copy of checkpoint src whose config names eos_token_id as its EOS (same weights)."""
    if not os.path.exists(dst):
        shutil.copytree(src, dst)
        for name in ("config.json", "generation_config.json"):
            path = os.path.join(dst, name)
            if os.path.exists(path):
                with open(path) as f:
                    cfg = json.load(f)
                cfg["eos_token_id"] = eos_token_id
                with open(path, "w") as f:
                    json.dump(cfg, f)
    return dst


def build_spec_models(root) -> dict[str, str]:
    if not _MODELS:  # one build per session, however many test modules import the fixture
        def path(name):
            return os.path.join(str(root), name)

        small_no_head_dim = {k: v for k, v in DRAFT_SMALL_CFG.items() if k != "head_dim"}
        target = make_tiny_model(path("target"), "llama", seed=0)
        _MODELS.update(
            target=target,
            draft_small=make_tiny_model(path("draft_small"), "qwen3", seed=1, with_tokenizer=False, **DRAFT_SMALL_CFG),
            draft_wide=_widened_copy(target, path("draft_wide")),
            draft_wide_noisy=_widened_copy(target, path("draft_wide_noisy"), rel_noise=0.06, seed=2),
            draft_vocab300=make_tiny_model(path("draft_vocab300"), "qwen2", seed=3, with_tokenizer=False, vocab_size=300,
                                           **small_no_head_dim),
            sv_target=make_tiny_model(path("sv_target"), "llama", seed=4, with_tokenizer=False, vocab_size=SMALL_VOCAB,
                                      eos_token_id=None),
            sv_draft=make_tiny_model(path("sv_draft"), "qwen2", seed=5, with_tokenizer=False, vocab_size=SMALL_VOCAB,
                                     eos_token_id=None, **small_no_head_dim),
        )
    return dict(_MODELS)


# Greedy, penalised and seeded-sampling requests: what the step-0 tests (a plain worker's decodes, a parked head, a
# step-0 round's next verify) run over.
STEP_ZERO_PARAMS = pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True),
    SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=32, ignore_eos=True, seed=11),
], ids=["greedy", "penalised", "sampled"])

@pytest.fixture(scope="session")
def spec_models(tmp_path_factory) -> dict[str, str]:
    return build_spec_models(tmp_path_factory.mktemp("spec_models")) if not _MODELS else dict(_MODELS)


assert_clean = assert_engine_clean  # the suite-wide invariant: pool fully free, nothing left running


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """These models are tiny: one intra-op thread is as fast as two, and far faster when another process keeps a
    core busy (two OpenMP threads then wait on each other at every op). Restored afterwards, so the setting never
    leaks into other test modules."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def llm_factory(make_llm):
    """llm_factory(path, **engine_args) -> LLM (CPU, fp32), checked clean at teardown (conftest's make_llm)."""
    return make_llm


# ---- helpers --------------------------------------------------------------------------------------------------------


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw)


def mixed_prompts(n: int, seed: int, vocab: int = VOCAB, min_len: int = 1, max_len: int = 100) -> list[list[int]]:
    """n prompts of lengths min_len..max_len: even ones repeat a short random pattern (NGRAM finds matches in
    them), odd ones are random tokens. The first two have the extreme lengths."""
    rng = random.Random(seed)
    lengths = [min_len, max_len] + [rng.randint(min_len, max_len) for _ in range(n - 2)]
    prompts = []
    for i, length in enumerate(lengths[:n]):
        if i % 2 == 0:
            pattern = [rng.randrange(vocab) for _ in range(rng.randint(2, 7))]
            prompts.append((pattern * (length // len(pattern) + 1))[:length])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(length)])
    return prompts


def case_args(models: dict, case: tuple[str, str, dict], **extra) -> tuple[str, dict]:
    """A case of a test's table, (target name, drafter name, engine args), -> (target path, LLM arguments): the
    drafter's path filled in, an adaptive config's file name resolved under models["root"]."""
    target, draft, args = case
    args = dict(args, speculative_draft_model_path=models[draft], skip_tokenizer_init=True, **extra)
    if "speculative_adaptive_config" in args:
        args["speculative_adaptive_config"] = str(models["root"] / args["speculative_adaptive_config"])
    return models[target], args


def run_aborting(engine, prompts, params, victim: int, at_step: int) -> list:
    """Add the requests and step the engine to the end, aborting request `victim` after step `at_step` (between two
    steps, as a server's disconnect would) -> the requests."""
    reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts, params)]
    for step in range(10_000):
        if not engine.has_unfinished():
            return reqs
        engine.step()
        if step == at_step:
            engine.abort(reqs[victim].rid)
    pytest.fail("requests not finished after 10,000 steps")


def assert_aborted_run_like(outs: list[list[int]], ref: list[list[int]], victim: int) -> None:
    """A run_aborting run's outputs against the same requests run to the end: equal, but for the aborted one, which
    is a strict prefix of its own."""
    assert all(o == r for i, (o, r) in enumerate(zip(outs, ref)) if i != victim)
    assert outs[victim] == ref[victim][: len(outs[victim])] and len(outs[victim]) < len(ref[victim])


def gen(llm: LLM, prompts, params):
    return llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)


def spec_state(llm: LLM) -> dict:
    return llm.get_server_info()["internal_states"][0]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_SPEC_OFF_IDS: dict = {}


def spec_off_ids(path: str, prompts, params) -> list[list[int]]:
    """The target's spec-off tokens for (prompts, params) on CPU in fp32, computed once per session."""
    key = (path, tuple(map(tuple, prompts)), tuple(map(repr, params)))
    if key not in _SPEC_OFF_IDS:
        llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True)
        _SPEC_OFF_IDS[key] = [o.token_ids for o in gen(llm, prompts, params)]
    return _SPEC_OFF_IDS[key]


def spec_off_reference(cache: dict, spec_models, prompts, params, key) -> list:
    """Spec-off outputs of the target for (prompts, params), computed once per key and kept in `cache`."""
    if key not in cache:
        llm = LLM(spec_models["target"], device="cpu", dtype="float32")
        cache[key] = gen(llm, prompts, params)
        assert_clean(llm)
    return cache[key]


def step_until_done(engine, reqs, page_size: int, max_steps: int, check_draft: bool = False) -> tuple[list[int], int]:
    """Step the engine to completion, asserting after every step that each running request holds room for its
    committed tokens and at most the next round's beyond them (room past that, rejected drafts' included, went back
    to the pool), and, with check_draft, that no draft is ahead of its target. -> (retractions seen per request,
    retractions of requests already verified)."""
    seen = [0] * len(reqs)
    while_speculating = 0
    reserve = engine.scheduler.decode_reserve
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step()
        for r in engine.scheduler.running:
            room = engine.page_table.num_slots(r.row)
            assert ceil_div(r.num_computed, page_size) * page_size <= room, "a request lost committed K/V"
            assert room <= ceil_div(r.num_computed + reserve, page_size) * page_size, "room past the next round kept"
        assert_kv_accounted(engine)
        if check_draft:
            for r in engine.scheduler.running:
                assert r.draft_num_computed <= r.num_computed
        for i, r in enumerate(reqs):
            if r.num_retractions > seen[i]:
                seen[i] = r.num_retractions
                while_speculating += r.spec_verify_ct > 0
    assert not engine.has_unfinished(), "engine did not finish"
    return seen, while_speculating


def assert_same_position_distributions(ref, got, vocab: int, alpha: float) -> None:
    """ref, got: [N, steps] token ids of independent samples. Per position a two-sample chi-square test at
    alpha / steps (Bonferroni): the whole check fails falsely with probability at most alpha."""
    import numpy as np
    from scipy.stats import chi2_contingency

    steps = ref.shape[1]
    for j in range(steps):
        table = np.stack([np.bincount(ref[:, j], minlength=vocab), np.bincount(got[:, j], minlength=vocab)])
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table).pvalue > alpha / steps, (j, table.tolist())


MIN_BIN = 20  # position_pvalue's smallest bin


def position_pvalue(a, b, vocab: int = SMALL_VOCAB) -> float:
    """a, b: [N] token ids of two independent samples -> a two-sample chi-square p-value; tokens with fewer than
    MIN_BIN samples in both together are pooled into one bin, so every expected count is at least MIN_BIN / 2."""
    import numpy as np
    from scipy.stats import chi2_contingency

    table = np.stack([np.bincount(a, minlength=vocab), np.bincount(b, minlength=vocab)])
    common, rare = table[:, table.sum(0) >= MIN_BIN], table[:, table.sum(0) < MIN_BIN].sum(1, keepdims=True)
    if rare.sum() >= MIN_BIN:
        common = np.concatenate([common, rare], 1)
    elif rare.sum() > 0 and common.shape[1]:
        common[:, -1:] += rare  # too few to stand alone: pooled into the last bin
    if common.shape[1] < 2:
        return 1.0  # a single token carries all the mass: nothing to compare
    return float(chi2_contingency(common).pvalue)
