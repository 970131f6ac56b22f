"""EAGLE-1 / EAGLE-3 draft heads: published checkpoint layouts, shapes, vocab mapping, validation, config isolation."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hyperdraft.models.config import load_model_config
from hyperdraft.kernels.rope import rotate_half
from hyperdraft.models.decoder import rotated
from hyperdraft.models.eagle import (
    Eagle3Head,
    EagleHead,
    aux_layer_ids,
    default_aux_layer_ids,
    load_eagle_config,
    target_capture_layers,
)
from hyperdraft.models.eagle_loader import load_eagle_head
from hyperdraft.models.loader import load_model
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model

CPU = torch.device("cpu")
L = 6  # target layers: default aux ids (1, 2, 4) are distinct and exclude the last layer
V = 384
DRAFT_V = 100

EAGLE3_NAMES = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}
EAGLE1_NAMES = {
    "fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


@pytest.fixture(scope="module")
def target_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("eagle_target")), "llama", num_hidden_layers=L, with_tokenizer=False)


@pytest.fixture(scope="module")
def target(target_path):
    return load_model(target_path, "float32", CPU)


def causal_attn(layer_id, q, k, v, rope=None):
    q, k = rotated(q, k, rope)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def write(tmp_path, target_path, name="draft", **kw) -> str:
    return write_random_eagle_checkpoint(str(tmp_path / name), target_path, **kw)


def edit_weights(path, drop=(), add=None):
    f = os.path.join(path, "model.safetensors")
    w = {k: t for k, t in load_file(f).items() if k not in drop}
    save_file({**w, **(add or {})}, f)


# ---- layout round trip ----

@pytest.mark.parametrize("kind,with_embed,names", [
    ("eagle3", False, EAGLE3_NAMES), ("eagle3", True, EAGLE3_NAMES | {"embed_tokens.weight"}),
    ("eagle", False, EAGLE1_NAMES), ("eagle", True, EAGLE1_NAMES | {"embed_tokens.weight"}),
])
def test_layout_round_trip(tmp_path, target_path, target, kind, with_embed, names):
    path = write(tmp_path, target_path, kind=kind, draft_vocab_size=DRAFT_V if kind == "eagle3" else None, with_embed=with_embed)
    ckpt = load_file(os.path.join(path, "model.safetensors"))
    assert set(ckpt) == names  # the writer emits exactly the published names
    head = load_eagle_head(path, target)
    state = head.state_dict()
    assert set(state) == names  # every name consumed, nothing missing or extra
    for name, tensor in ckpt.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    shared = {"embed_tokens"} if not with_embed else set()
    shared |= {"lm_head"} if kind == "eagle" else set()
    assert set(head._shared) == shared
    own_ids = {id(p) for p in head.parameters()}
    assert all(id(p) not in own_ids for p in target.parameters())  # target weights are shared, never adopted


def test_model_prefix_and_eagle1_alias(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle", architectures=["LlamaForCausalLM"])
    w = load_file(os.path.join(path, "model.safetensors"))
    save_file({"model." + k: t for k, t in w.items()}, os.path.join(path, "model.safetensors"))
    head = load_eagle_head(path, target)
    assert isinstance(head, EagleHead) and torch.equal(head.fc.weight, w["fc.weight"])


def test_pytorch_bin_checkpoint(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle3", draft_vocab_size=DRAFT_V)  # SafeAILab ships pytorch_model.bin
    w = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save(w, os.path.join(path, "pytorch_model.bin"))
    head = load_eagle_head(path, target)
    assert torch.equal(head.d2t, w["d2t"]) and torch.equal(head.lm_head.weight, w["lm_head.weight"])


def test_shared_lm_head_for_full_vocab_eagle3(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle3")
    edit_weights(path, drop=("lm_head.weight", "d2t", "t2d"))
    head = load_eagle_head(path, target)
    assert head._shared["lm_head"] is target.lm_head and head.identity_vocab
    h = torch.randn(3, 64)
    torch.testing.assert_close(head.compute_logits(h), target.lm_head(head.norm(h)).float())


# ---- shapes and numerics against an independent reference ----

def rms(x, w, eps=1e-6):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def ref_attn(x, w, prefix, target, positions):
    t = x.shape[0]
    q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(t, 4, 16)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(t, 2, 16)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(t, 2, 16)
    cos, sin = target.rope(positions, x.dtype)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return causal_attn(0, q, k, v).reshape(t, 64) @ w[prefix + "self_attn.o_proj.weight"].T


def ref_mlp(x, w, prefix):
    return (F.silu(x @ w[prefix + "mlp.gate_proj.weight"].T) * (x @ w[prefix + "mlp.up_proj.weight"].T)) @ w[prefix + "mlp.down_proj.weight"].T


@torch.no_grad()
def test_eagle3_shapes_and_reference(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle3", draft_vocab_size=DRAFT_V)
    head = load_eagle_head(path, target)
    w = load_file(os.path.join(path, "model.safetensors"))
    assert isinstance(head, Eagle3Head) and (head.num_layers, head.num_kv_heads, head.head_dim) == (1, 2, 16)
    assert aux_layer_ids(head) == (1, 2, 4) and target_capture_layers(head) == (2, 3, 5)
    T = 9
    ids, pos = torch.randint(0, V, (T + 1,)), torch.arange(T)
    _, captured = target(ids[:T], pos, causal_attn, target_capture_layers(head))
    # capture index i + 1 is the output of target layer i
    x, cos, sin = target.model.embed_tokens(ids[:T]), *target.rope(pos, torch.float32)
    outs, residual = [], None
    for layer in target.model.layers:
        x, residual = layer(x, residual, cos, sin, causal_attn)
        outs.append(x + residual)
    for got, i in zip(captured, aux_layer_ids(head)):
        torch.testing.assert_close(got, outs[i])
    h = head.project_target_hidden(captured)
    assert h.shape == (T, 64)
    torch.testing.assert_close(h, head.project_target_hidden(torch.cat(captured, -1)))
    out = head(ids[1:], pos, h, causal_attn)  # position i: (target hidden i, token i + 1)
    assert out.shape == (T, 64)
    # reference: residual = hidden, attention over concat(input_layernorm(embedding), hidden_norm(hidden))
    emb = target.model.embed_tokens(ids[1:])
    ref_h = torch.cat(captured, -1) @ w["fc.weight"].T
    a_in = torch.cat((rms(emb, w["midlayer.input_layernorm.weight"]), rms(ref_h, w["midlayer.hidden_norm.weight"])), -1)
    r = ref_h + ref_attn(a_in, w, "midlayer.", target, pos)
    r = r + ref_mlp(rms(r, w["midlayer.post_attention_layernorm.weight"]), w, "midlayer.")
    torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
    logits = head.compute_logits(out)
    assert logits.shape == (T, V) and logits.dtype == torch.float32
    # next draft step: the head's own output is fed back as hidden, without fc
    assert head(ids[-1:], torch.tensor([T]), out[-1:], causal_attn).shape == (1, 64)
    with pytest.raises(ValueError, match="project_target_hidden"):
        head(ids[1:], pos, torch.cat(captured, -1), causal_attn)
    with pytest.raises(ValueError, match="target_hidden_size"):
        head.project_target_hidden(captured[:2])


@torch.no_grad()
def test_eagle1_shapes_and_reference(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle")
    head = load_eagle_head(path, target)
    w = load_file(os.path.join(path, "model.safetensors"))
    assert (head.num_layers, head.num_kv_heads, head.head_dim) == (1, 2, 16)
    assert aux_layer_ids(head) == () and target_capture_layers(head) == ()
    T = 7
    ids, pos = torch.randint(0, V, (T + 1,)), torch.arange(T)
    hidden, _ = target(ids[:T], pos, causal_attn)  # EAGLE-1 consumes the target's final normed hidden
    h = head.project_target_hidden(hidden)
    assert h is hidden
    out = head(ids[1:], pos, h, causal_attn)
    emb = target.model.embed_tokens(ids[1:])
    x = torch.cat((emb, hidden), -1) @ w["fc.weight"].T + w["fc.bias"]  # embedding first, then hidden
    r = x + ref_attn(x, w, "layers.0.", target, pos)  # no input_layernorm on layer 0
    r = r + ref_mlp(rms(r, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.")
    torch.testing.assert_close(out, r, rtol=1e-4, atol=1e-4)
    # no final norm: the target's lm_head straight on the head's output
    torch.testing.assert_close(head.compute_logits(out), target.lm_head(r).float(), rtol=1e-4, atol=1e-4)
    assert head.compute_logits(out).shape == (T, V)


def test_eagle1_multi_layer_has_input_norms_after_layer0(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle", num_hidden_layers=2)
    head = load_eagle_head(path, target)
    assert head.num_layers == 2 and "layers.1.input_layernorm.weight" in head.state_dict()
    assert "layers.0.input_layernorm.weight" not in head.state_dict()
    out = head(torch.arange(4), torch.arange(4), torch.randn(4, 64), causal_attn)
    assert out.shape == (4, 64)


# ---- draft vocabulary mapping ----

@torch.no_grad()
def test_compute_logits_maps_draft_vocab_with_d2t_offsets(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle3", draft_vocab_size=DRAFT_V, seed=3)
    head = load_eagle_head(path, target)
    w = load_file(os.path.join(path, "model.safetensors"))
    d2t, t2d = w["d2t"], w["t2d"]
    target_ids = torch.arange(DRAFT_V) + d2t
    assert (d2t != 0).any() and torch.equal(t2d.nonzero().flatten(), target_ids)  # a real offset table
    hidden = torch.randn(5, 64)
    draft_logits = rms(hidden, w["norm.weight"]) @ w["lm_head.weight"].T
    logits = head.compute_logits(hidden)
    assert torch.isinf(logits[:, ~t2d]).all() and (logits[:, ~t2d] < 0).all()
    assert torch.isfinite(logits[:, t2d]).all()
    torch.testing.assert_close(logits[:, target_ids], draft_logits, rtol=1e-5, atol=1e-5)
    best_draft = draft_logits.argmax(-1)
    assert torch.equal(logits.argmax(-1), best_draft + d2t[best_draft])
    assert torch.isclose(torch.softmax(logits, -1).sum(-1), torch.ones(5)).all()


@torch.no_grad()
def test_head_forward_output_keeps_draft_vocab_logits(tmp_path, target_path, target):
    """The head's ForwardOutput carries [N, Vd] draft logits and the head's VocabMap: target_logits() is
    compute_logits(), and greedy_tokens() is its argmax, written into a strided destination column when given."""
    from hyperdraft.runner.model_runner import ForwardOutput

    path = write(tmp_path, target_path, kind="eagle3", draft_vocab_size=DRAFT_V, seed=4)
    head = load_eagle_head(path, target)
    assert head.vocab_map is not None and head.vocab_map.vocab == V
    hidden = torch.randn(6, 64)
    draft_logits = head.compute_draft_logits(hidden)
    assert draft_logits.shape == (6, DRAFT_V)
    out = ForwardOutput(draft_logits, hidden, [], head.vocab_map)
    full = head.compute_logits(hidden)
    assert torch.equal(out.target_logits(), full)
    assert torch.equal(out.greedy_tokens(), full.argmax(-1))
    grid = torch.full((6, 3), -1, dtype=torch.int64)
    out.greedy_tokens(grid[:, 1])
    assert torch.equal(grid[:, 1], full.argmax(-1)) and bool((grid[:, [0, 2]] == -1).all())
    # ties go to the smallest target id, whatever the draft order (the argmax of the spread row)
    top = head.vocab_map.draft_to_target.argsort(descending=True)[:2]  # the later one has the smaller target id
    tied = torch.zeros(1, DRAFT_V)
    tied[0, top] = 1.0
    assert int(ForwardOutput(tied, hidden[:1], [], head.vocab_map).greedy_tokens()) == int(
        head.vocab_map.draft_to_target[top].min())


def test_bad_d2t_and_t2d_are_rejected(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle3", draft_vocab_size=DRAFT_V)
    d2t = load_file(os.path.join(path, "model.safetensors"))["d2t"].clone()
    d2t[-1] = V  # maps past the target vocabulary
    edit_weights(path, add={"d2t": d2t})
    with pytest.raises(ValueError, match="d2t"):
        load_eagle_head(path, target)
    path = write(tmp_path, target_path, "b", kind="eagle3", draft_vocab_size=DRAFT_V)
    edit_weights(path, add={"t2d": torch.ones(V, dtype=torch.bool)})
    with pytest.raises(ValueError, match="t2d"):
        load_eagle_head(path, target)


# ---- validation errors name the field ----

@pytest.mark.parametrize("kind,overrides,match", [
    ("eagle3", {"target_hidden_size": 48}, r"target_hidden_size=48 .*hidden_size=64"),
    ("eagle", {"hidden_size": 96, "head_dim": 24}, r"hidden_size=96 .*hidden_size=64"),
    ("eagle3", {"vocab_size": 500}, r"vocab_size=500 .*vocab_size=384"),
    ("eagle", {"vocab_size": 500}, r"vocab_size=500"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 6]}}, r"eagle_aux_hidden_state_layer_ids=\[1, 2, 6\].*\[0, 6\)"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 2, 3]}}, r"eagle_aux_hidden_state_layer_ids"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, r"eagle_aux_hidden_state_layer_ids.*exactly 3"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 2]}}, r"exactly 3 distinct"),
    # int() of the string's characters failed without naming the field
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,2,3"}},
     r"eagle_config.eagle_aux_hidden_state_layer_ids must be a list of layer indices, got '1,2,3'"),
    ("eagle3", {"architectures": ["MistralForCausalLM"]}, r"'MistralForCausalLM'.*LlamaForCausalLMEagle, .*LlamaForCausalLMEagle3"),
    ("eagle3", {"architectures": None}, r"draft architecture None"),
    ("eagle3", {"num_hidden_layers": 2}, r"num_hidden_layers=2"),
    ("eagle3", {"draft_vocab_size": 1000}, r"draft_vocab_size=1000"),
])
def test_bad_checkpoint_errors_name_the_field(tmp_path, target_path, target, kind, overrides, match):
    path = write(tmp_path, target_path, kind=kind, **overrides)
    with pytest.raises(ValueError, match=match):
        load_eagle_head(path, target)


def test_weights_the_layout_does_not_use_are_skipped_with_a_warning(tmp_path, target_path, target, caplog):
    """As SGLang's loader skips them; the head is what the checkpoint without them gives."""
    path = write(tmp_path, target_path, "b", kind="eagle")
    clean = load_eagle_head(path, target)
    edit_weights(path, add={"layers.0.input_layernorm.weight": torch.ones(64)})  # EAGLE-1 layer 0 has none
    with caplog.at_level("WARNING"):
        head = load_eagle_head(path, target)
    assert "layers.0.input_layernorm.weight" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(clean.state_dict().values(), head.state_dict().values()))


def test_an_eagle3_checkpoint_may_ship_d2t_without_t2d(tmp_path, target_path, target):
    """SGLang reads d2t alone (t2d follows from it); the loader refused such checkpoints for lacking t2d."""
    path = write(tmp_path, target_path, "a", kind="eagle3", draft_vocab_size=DRAFT_V)
    full = load_eagle_head(path, target)
    edit_weights(path, drop=("t2d",))
    head = load_eagle_head(path, target)
    assert torch.equal(head.t2d, full.t2d) and torch.equal(head.draft_to_target, full.draft_to_target)
    edit_weights(path, add={"d2t": full.d2t + target.config.vocab_size})  # maps outside the vocabulary
    with pytest.raises(ValueError, match="d2t maps draft ids outside"):
        load_eagle_head(path, target)


def test_missing_unexpected_and_misshapen_weights(tmp_path, target_path, target):
    path = write(tmp_path, target_path, "a", kind="eagle3", draft_vocab_size=DRAFT_V)
    edit_weights(path, drop=("midlayer.hidden_norm.weight",))
    with pytest.raises(ValueError, match="lacks weights.*midlayer.hidden_norm.weight"):
        load_eagle_head(path, target)
    path = write(tmp_path, target_path, "c", kind="eagle3", draft_vocab_size=DRAFT_V)
    edit_weights(path, drop=("lm_head.weight",))  # a reduced vocabulary cannot borrow the target's lm_head
    with pytest.raises(ValueError, match="lm_head.weight.*draft_vocab_size"):
        load_eagle_head(path, target)
    path = write(tmp_path, target_path, "d", kind="eagle3", hidden_size=96, head_dim=24, target_hidden_size=64)  # no embedding
    with pytest.raises(ValueError, match="embed_tokens.weight.*hidden_size=96"):
        load_eagle_head(path, target)
    path = write(tmp_path, target_path, "e", kind="eagle3")
    edit_weights(path, add={"norm.weight": torch.ones(32)})
    with pytest.raises(ValueError, match=r"norm.weight has shape \(32,\)"):
        load_eagle_head(path, target)
    path = write(tmp_path, target_path, "f", kind="eagle3")
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        load_eagle_head(path, target, dtype="fp8")
    with pytest.raises(ValueError, match="no config.json"):
        load_eagle_head(str(tmp_path / "nowhere"), target)


def test_wider_eagle3_head_with_own_embedding(tmp_path, target_path, target):
    path = write(tmp_path, target_path, kind="eagle3", draft_vocab_size=DRAFT_V, with_embed=True, hidden_size=96,
                 head_dim=24, target_hidden_size=64)
    head = load_eagle_head(path, target)
    assert head.config.hidden_size == 96 and head.config.target_hidden_size == 64 and head.fc.weight.shape == (96, 192)
    h = head.project_target_hidden(torch.randn(5, 192))
    out = head(torch.arange(5), torch.arange(5), h, causal_attn)
    assert out.shape == (5, 96) and head.compute_logits(out).shape == (5, V)


# ---- aux layer ids ----

def test_default_aux_layer_ids():
    assert default_aux_layer_ids(32) == (1, 15, 28)  # SGLang's capture list [2, 16, 29], as layer outputs
    assert default_aux_layer_ids(80) == (1, 39, 76)
    assert default_aux_layer_ids(7) == (1, 2, 3)
    assert [default_aux_layer_ids(n) for n in (3, 4, 5, 6)] == [(0, 1, 2), (0, 1, 2), (1, 2, 3), (1, 2, 4)]
    for n in range(3, 100):
        ids = default_aux_layer_ids(n)
        assert len(set(ids)) == 3 and list(ids) == sorted(ids) and 0 <= ids[0] and ids[-1] < n
    with pytest.raises(ValueError, match="num_layers=2"):
        default_aux_layer_ids(2)


def test_aux_ids_from_config_absent_and_last_layer(tmp_path, target_path, target):
    head = load_eagle_head(write(tmp_path, target_path, "a", kind="eagle3",
                                 eagle_config={"eagle_aux_hidden_state_layer_ids": [4, 0, 3]}), target)
    assert aux_layer_ids(head) == (4, 0, 3) and target_capture_layers(head) == (1, 4, 5)
    path = write(tmp_path, target_path, "b", kind="eagle3", eagle_config=None)
    assert load_eagle_config(path).eagle_aux_hidden_state_layer_ids is None
    assert aux_layer_ids(load_eagle_head(path, target)) == default_aux_layer_ids(L)
    path = write(tmp_path, target_path, "c", kind="eagle3", eagle_config=None,
                 eagle_aux_hidden_state_layer_ids=[0, 1, 2])  # vLLM-style top-level field
    assert aux_layer_ids(load_eagle_head(path, target)) == (0, 1, 2)
    head = load_eagle_head(write(tmp_path, target_path, "d", kind="eagle3",
                                 eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, L - 1]}), target)
    assert target_capture_layers(head) == (2, 3, L)  # the last layer's output is capture index L
    ids = torch.tensor([3, 1, 4, 1, 5])
    pos = torch.arange(5)
    final, captured = target(ids, pos, causal_attn, target_capture_layers(head))
    assert len(captured) == 3 and torch.allclose(target.model.norm(captured[-1]), final)


# ---- the target's config is never touched ----

def test_target_config_unchanged_and_not_shared(tmp_path, target_path, target):
    cfg_before = target.config
    fresh = load_model_config(target_path)
    embed_before = target.model.embed_tokens.weight.detach().clone()
    for kind, dv in (("eagle3", DRAFT_V), ("eagle", None)):
        path = write(tmp_path, target_path, kind, kind=kind, draft_vocab_size=dv,
                     rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        head = load_eagle_head(path, target, dtype=torch.float64)
        assert target.config is cfg_before and target.config == fresh
        assert head.config.layer is not target.config and head.config.layer != target.config
        assert head.config.rms_norm_eps == 1e-5 and head.config.layer.rope_scaling == ()
        assert all(getattr(head.config, f.name) is not target.config for f in dataclasses.fields(head.config))
        with pytest.raises(dataclasses.FrozenInstanceError):
            head.config.vocab_size = 1
        # the head's own dtype conversion never reached the shared target modules
        assert head.fc.weight.dtype == torch.float64
        assert all(p.dtype == torch.float32 for p in target.parameters())
        assert head.inv_freq.dtype == torch.float32
        assert torch.equal(target.model.embed_tokens.weight, embed_before)
        out = head(torch.arange(3), torch.arange(3), torch.randn(3, 64, dtype=torch.float64), causal_attn)
        assert head.compute_logits(out).shape == (3, V)
    assert json.load(open(os.path.join(target_path, "config.json")))["num_hidden_layers"] == L
