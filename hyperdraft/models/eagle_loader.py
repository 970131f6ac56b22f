"""Loading an EAGLE-1 / EAGLE-3 head from its checkpoint (models/eagle.py has the layouts): the config checked against
the target, the weights read (or dummy ones for benchmarks), sliced for a tensor-parallel rank, checked by name and
shape, and the head made ready to draft."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os

import torch

from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.models.cpu_linear import fuse_projections
from hyperdraft.models.decoder import DecoderLM
from hyperdraft.models.eagle import (Eagle3Head, EagleConfig, EagleHead, default_aux_layer_ids,
                                     load_eagle_config)
from hyperdraft.models.loader import DTYPES, read_safetensors
from hyperdraft.models.tensor_parallel import rank_config, rank_part, split_problem

logger = logging.getLogger(__name__)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files and not bins:
        raise ValueError(f"draft model path {path!r} has no *.safetensors or pytorch_model*.bin weights")
    weights = {}
    for f in files or bins:
        weights.update(read_safetensors(f) if files else torch.load(f, map_location="cpu", weights_only=True))
    return {n[len("model."):] if n.startswith("model.") else n: t for n, t in weights.items()}


def load_eagle_head(path: str, target: DecoderLM, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, load_format: str = "auto",
                    hot_ids: torch.Tensor | None = None, tp: TensorParallel = SINGLE) -> EagleHead | Eagle3Head:
    """Load an EAGLE-1/EAGLE-3 head for `target`; dtype/device default to the target's ("auto" = the target's dtype).
    hot_ids: a token map's ids (EAGLE-1 only: an EAGLE-3 head carries its own draft vocabulary, d2t). tp: split the
    head's layers over a tensor-parallel group as the target's are (heads and MLP columns; fc, embedding and lm_head
    whole on every rank), or SINGLE for a whole head on every rank; a head whose heads do not divide stays whole."""
    whole_cfg, tcfg = load_eagle_config(path), target.config
    tp = tp if split_problem(whole_cfg.layer, tp) is None else SINGLE
    cfg = dataclasses.replace(whole_cfg, layer=rank_config(whole_cfg.layer, tp))
    param = next(target.parameters())
    device = torch.device(device) if device is not None else param.device
    if isinstance(dtype, str) and dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed values: auto, {', '.join(DTYPES)}")
    dtype = param.dtype if dtype in (None, "auto") else DTYPES.get(dtype, dtype)
    ids = _check_against_target(cfg, tcfg)
    if hot_ids is not None and cfg.kind == "eagle3":
        raise ValueError("speculative_token_map is for heads that score the whole vocabulary (EAGLE, NEXTN, MTP); "
                         "an EAGLE3 head carries its own draft vocabulary (draft_vocab_size, d2t)")
    weights, own_embed, own_lm_head = _head_weights(path, cfg, tcfg, load_format)
    if weights is not None and tp.size > 1:
        weights = {n: rank_part(n, t, whole_cfg.layer, tp, vocab_parallel=False) for n, t in weights.items()}
    with torch.device("meta"):
        head = (Eagle3Head(cfg, target, own_embed, own_lm_head, ids, tp) if cfg.kind == "eagle3"
                else EagleHead(cfg, target, own_embed, own_lm_head, hot_ids, tp))
    head = head.to_empty(device=device)
    _fill_state(head, path, cfg, weights)
    head.to(dtype)  # floating tensors only: d2t/t2d keep their integer/bool dtypes
    head.finish_loading()
    fuse_projections(head.layers if cfg.kind != "eagle3" else [head.midlayer])
    return head.eval().requires_grad_(False)


def _check_against_target(cfg: EagleConfig, tcfg) -> tuple[int, ...]:
    """Refuse a head that cannot draft for this target -> the target layers an EAGLE-3 head reads (() for EAGLE-1)."""
    if cfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"draft vocab_size={cfg.vocab_size} differs from the target's vocab_size={tcfg.vocab_size}")
    field, size = ("target_hidden_size", cfg.target_hidden_size) if cfg.kind == "eagle3" else ("hidden_size", cfg.hidden_size)
    if size != tcfg.hidden_size:
        raise ValueError(f"draft {field}={size} differs from the target's hidden_size={tcfg.hidden_size}")
    if cfg.kind != "eagle3":
        return ()
    ids = cfg.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(tcfg.num_layers)
    if len(ids) != 3 or len(set(ids)) != 3:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={list(ids)}: EAGLE-3 needs exactly 3 distinct target layers")
    if not all(0 <= i < tcfg.num_layers for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={list(ids)} must lie in [0, {tcfg.num_layers}) "
                         f"(the target has num_layers={tcfg.num_layers})")
    return tuple(ids)


def _head_weights(path: str, cfg: EagleConfig, tcfg, load_format: str) -> tuple[dict | None, bool, bool]:
    """-> (the checkpoint's weights, None for dummy weights; whether the head owns its embedding; its lm_head)."""
    if load_format == "dummy":  # random weights (benchmarks); own embeddings / lm_head only where sharing is impossible
        weights = None
        own_embed = cfg.hidden_size != tcfg.hidden_size
        own_lm_head = (cfg.hidden_size, cfg.draft_vocab_size) != (tcfg.hidden_size, tcfg.vocab_size)
    else:
        weights = _read_weights(path)
        own_embed, own_lm_head = "embed_tokens.weight" in weights, "lm_head.weight" in weights
    if not own_embed and cfg.hidden_size != tcfg.hidden_size:
        raise ValueError(f"the draft has no embed_tokens.weight, and with hidden_size={cfg.hidden_size} it cannot share "
                         f"the target's (hidden_size={tcfg.hidden_size})")
    if not own_lm_head and (cfg.hidden_size, cfg.draft_vocab_size) != (tcfg.hidden_size, tcfg.vocab_size):
        raise ValueError(f"the draft has no lm_head.weight, and with hidden_size={cfg.hidden_size}, draft_vocab_size="
                         f"{cfg.draft_vocab_size} it cannot share the target's ({tcfg.hidden_size}, {tcfg.vocab_size})")
    return weights, own_embed, own_lm_head


def _fill_state(head: EagleHead | Eagle3Head, path: str, cfg: EagleConfig, weights: dict | None) -> None:
    """The checkpoint's tensors into the head's state (random ones for dummy weights), checked by name and shape."""
    state = {n: t for n, t in head.state_dict().items() if not n.startswith("hot_vocab.")}  # copied at finish_loading
    if cfg.kind == "eagle3":
        state["d2t"].zero_()  # identity defaults for a full-vocabulary head that ships no d2t/t2d
        state["t2d"].fill_(True)
    if weights is None:
        from hyperdraft.models.loader import fill_dummy_weights

        fill_dummy_weights(head)
        weights = {}
        if cfg.kind == "eagle3":  # the draft vocabulary is the first draft_vocab_size target ids
            state["t2d"].zero_()
            state["t2d"][: cfg.draft_vocab_size] = True
    else:
        _check_weight_names(path, cfg, state, weights)
    with torch.no_grad():
        for name, tensor in weights.items():
            if name not in state:
                continue
            if tensor.shape != state[name].shape:
                raise ValueError(f"draft weight {name} has shape {tuple(tensor.shape)}, the head expects {tuple(state[name].shape)}")
            state[name].copy_(tensor)
        if cfg.kind == "eagle3" and "d2t" in weights and "t2d" not in weights:  # SGLang reads d2t alone
            targets = torch.arange(cfg.draft_vocab_size) + weights["d2t"].to(torch.int64)
            state["t2d"].zero_()  # finish_loading refuses a d2t that maps outside the vocabulary
            state["t2d"][targets.clamp(0, cfg.vocab_size - 1)] = True


def _check_weight_names(path: str, cfg, state: dict, weights: dict) -> None:
    """Every weight the head needs is there; others are skipped with a warning, as SGLang skips them (t2d follows
    from d2t, so a checkpoint may ship d2t alone)."""
    if "fc.weight" not in weights:  # every EAGLE and EAGLE-3 head has fc; a whole model said only "lacks fc.weight"
        raise ValueError(f"speculative_draft_model_path {path!r} has no fc.weight, so it is not an EAGLE or EAGLE-3 "
                         f"head (a whole {cfg.architecture} model?); a whole model drafts with speculative_algorithm "
                         "STANDALONE")
    optional = {"d2t", "t2d"} if cfg.draft_vocab_size == cfg.vocab_size else {"t2d"} if "d2t" in weights else set()
    unexpected = sorted(n for n in weights if n not in state and not n.endswith("rotary_emb.inv_freq"))
    if unexpected:
        logger.warning("draft checkpoint %r: skipping %d weight(s) the %s layout does not use: %s", path,
                       len(unexpected), cfg.architecture, unexpected[:5])
    missing = sorted(set(state) - set(weights) - optional)
    if missing:
        raise ValueError(f"draft checkpoint {path!r} lacks weights: {missing[:5]}")
