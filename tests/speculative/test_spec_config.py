"""Speculative settings: SGLang's defaults and adjustments, and errors that name the offending field."""

from __future__ import annotations

import logging

import pytest

from hyperdraft.config import EngineArgs
from hyperdraft.speculative.config import resolve_spec_config
from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, spec_models  # noqa: F401


def resolve(**kw):
    return resolve_spec_config(EngineArgs(model_path="unused", **kw))


# ---- defaults and adjustments (no model needed) --------------------------------------------------------------------


def test_no_algorithm_means_no_speculation():
    assert resolve() is None
    assert resolve(speculative_num_steps=3) is None


def test_standalone_defaults_to_sglang_3_1_4():
    cfg = resolve(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d")
    assert (cfg.num_steps, cfg.topk, cfg.num_draft_tokens) == (3, 1, 4)
    assert cfg.algorithm == "STANDALONE" and cfg.draft_model_path == "/d" and cfg.max_verify_tokens == 4
    assert cfg.use_rejection_sampling is None  # auto: drafts drawn from q whenever a request samples


def test_algorithm_name_is_case_insensitive():
    assert resolve(speculative_algorithm="standalone", speculative_draft_model_path="/d").algorithm == "STANDALONE"
    assert resolve(speculative_algorithm="ngram").algorithm == "NGRAM"


@pytest.mark.parametrize("algo", ["STANDALONE", "NGRAM"])
@pytest.mark.parametrize("steps,given,expected", [(1, 5, 2), (2, 7, 3), (4, 2, 5), (5, None, 6), (3, 4, 4)])
def test_topk1_forces_num_draft_tokens_to_steps_plus_1(algo, steps, given, expected, caplog):
    extra = dict(speculative_draft_model_path="/d") if algo == "STANDALONE" else {}
    with caplog.at_level(logging.WARNING, logger="hyperdraft"):
        cfg = resolve(speculative_algorithm=algo, speculative_num_steps=steps, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=given, **extra)
    assert (cfg.num_steps, cfg.topk, cfg.num_draft_tokens) == (steps, 1, expected)
    adjusted = given is not None and given != steps + 1
    assert any("speculative_num_draft_tokens" in r.getMessage() for r in caplog.records) == adjusted


def test_topk_defaults_to_1_when_steps_given():
    cfg = resolve(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d", speculative_num_steps=2)
    assert (cfg.num_steps, cfg.topk, cfg.num_draft_tokens) == (2, 1, 3)


def test_ngram_without_steps_derives_them_from_num_draft_tokens():
    cfg = resolve(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert (cfg.num_steps, cfg.num_draft_tokens) == (4, 5)
    cfg = resolve(speculative_algorithm="NGRAM")
    assert cfg.num_draft_tokens == cfg.num_steps + 1 and cfg.num_steps >= 1


def test_rejection_sampling_flag_is_kept_for_standalone():
    cfg = resolve(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d",
                  speculative_use_rejection_sampling=True)
    assert cfg.use_rejection_sampling is True


def test_resolved_config_is_frozen():
    cfg = resolve(speculative_algorithm="NGRAM", speculative_num_steps=2)
    with pytest.raises(Exception):
        cfg.num_steps = 5


# ---- errors -------------------------------------------------------------------------------------------------------

BAD = [
    # (engine args, the field the message must name, another fragment the message must contain)
    (dict(speculative_algorithm="STANDALONE"), "speculative_draft_model_path", "STANDALONE"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d", speculative_num_steps=0),
     "speculative_num_steps", ">= 1"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d", speculative_num_steps=-1),
     "speculative_num_steps", ">= 1"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=0), "speculative_num_steps", ">= 1"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=-1), "speculative_num_steps", ">= 1"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d", speculative_num_steps=3,
          speculative_eagle_topk=2, speculative_num_draft_tokens=12), "speculative_num_draft_tokens", "[2, 11]"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d", speculative_num_steps=3,
          speculative_eagle_topk=0), "speculative_eagle_topk", ">= 1"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d", speculative_eagle_topk=1),
     "speculative_num_steps", "must be set"),
    (dict(speculative_algorithm="EAGLE3"), "speculative_draft_model_path", "EAGLE3"),
    (dict(speculative_algorithm="FOO"), "speculative_algorithm", "FOO"),
    (dict(speculative_algorithm="NGRAM", speculative_use_rejection_sampling=True),
     "speculative_use_rejection_sampling", "NGRAM"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=0),
     "speculative_ngram_min_match_window_size", ">= 1"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
          speculative_ngram_max_match_window_size=3), "speculative_ngram_max_match_window_size", ""),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0), "speculative_num_draft_tokens", ">= 2"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1), "speculative_num_draft_tokens", "got 1"),
    (dict(speculative_algorithm="NGRAM", speculative_adaptive=True, speculative_adaptive_config="/no/such.json"),
     "speculative_adaptive_config", "cannot read '/no/such.json'"),
    (dict(speculative_algorithm="NGRAM", speculative_adaptive=True, speculative_adaptive_config='{"1": [1, 3'),
     "speculative_adaptive_config", "the inline JSON is not valid JSON"),
]
BAD_IDS = ["standalone-no-draft", "steps-0", "steps-neg", "ngram-steps-0", "ngram-steps-neg", "topk-2", "topk-0",
           "topk-without-steps", "eagle3-no-head", "unknown", "ngram-rejection-sampling", "ngram-window-0",
           "ngram-window-inverted", "ngram-draft-tokens-0", "ngram-draft-tokens-1", "adaptive-config-missing",
           "adaptive-config-inline-broken"]


def test_mtp_and_nextn_are_eagle_with_the_targets_own_module():
    """MTP and NEXTN resolve to EAGLE; without a draft path the head is the target's own MTP module, which only the
    checkpoint can say it has (checked when the engine loads it: tests/speculative/test_mtp.py)."""
    for name in ("MTP", "NEXTN", "EAGLE"):
        cfg = resolve(speculative_algorithm=name)
        assert cfg.algorithm == "EAGLE" and cfg.draft_model_path is None


@pytest.mark.parametrize("args,field,fragment", BAD, ids=BAD_IDS)
def test_bad_spec_config_raises_naming_the_field(args, field, fragment):
    with pytest.raises(ValueError) as err:
        resolve(**args)
    assert field in str(err.value) and fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("args,field,fragment", [BAD[0], BAD[2], BAD[5], BAD[8], BAD[9],
                                                 (dict(speculative_algorithm="EAGLE"), "speculative_draft_model_path",
                                                  "no MTP module")],
                         ids=["standalone-no-draft", "steps-neg", "topk-2", "eagle3-no-head", "unknown",
                              "eagle-no-head-dense-target"])
def test_bad_spec_config_rejected_by_llm(spec_models, args, field, fragment):
    """The same checks guard LLM(...): a ValueError naming the field, before any request."""
    from hyperdraft import LLM

    with pytest.raises(ValueError) as err:
        LLM(spec_models["target"], device="cpu", dtype="float32", **args)
    assert field in str(err.value) and fragment in str(err.value), str(err.value)


def test_draft_with_other_vocabulary_rejected(spec_models):
    from hyperdraft import LLM

    with pytest.raises(ValueError) as err:
        LLM(spec_models["target"], device="cpu", dtype="float32", speculative_algorithm="STANDALONE",
            speculative_draft_model_path=spec_models["draft_vocab300"])
    msg = str(err.value)
    assert "speculative_draft_model_path" in msg and "300" in msg and "384" in msg, msg


def test_missing_draft_checkpoint_is_an_error(spec_models, tmp_path):
    from hyperdraft import LLM

    with pytest.raises((ValueError, OSError)):
        LLM(spec_models["target"], device="cpu", dtype="float32", speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(tmp_path / "no-such-draft"))


def test_a_draft_of_the_wrong_kind_is_named(spec_models, tmp_path):
    """A whole model as an EAGLE / EAGLE3 head said "draft checkpoint lacks weights: ['fc.bias', 'fc.weight']" after a
    warning about its layers; an EAGLE-3 head, or a missing path, as a STANDALONE draft named a model path and the
    target architectures, not the flag or the algorithm that takes it."""
    from hyperdraft import LLM
    from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
    from hyperdraft.testing.tiny import make_tiny_model

    target = make_tiny_model(str(tmp_path / "deep"), "llama", num_hidden_layers=4)
    head = write_random_eagle_checkpoint(str(tmp_path / "head"), target, kind="eagle3")
    cases = [
        ("EAGLE3", target, r"^speculative_draft_model_path '.*deep' has no fc.weight, so it is not an EAGLE or EAGLE-3 "
                           r"head .*speculative_algorithm STANDALONE"),
        ("EAGLE", target, r"^speculative_draft_model_path '.*deep' has no fc.weight"),
        ("EAGLE3", spec_models["draft_small"], r"draft architecture 'Qwen3ForCausalLM' .*drafts with "
                                               r"speculative_algorithm STANDALONE"),
        ("STANDALONE", head, r"^speculative_draft_model_path: model architecture 'LlamaForCausalLMEagle3' .*give it as "
                             r"speculative_draft_model_path with speculative_algorithm EAGLE or EAGLE3"),
        ("STANDALONE", str(tmp_path / "nowhere"), r"^speculative_draft_model_path: model path '.*nowhere' does not exist"),
    ]
    for algorithm, draft, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(target, device="cpu", dtype="float32", speculative_algorithm=algorithm,
                speculative_draft_model_path=draft)
    with pytest.raises(ValueError, match=r"'LlamaForCausalLMEagle3' is not supported.* \(LlamaForCausalLMEagle3 is an "
                                         r"EAGLE draft head: give it as speculative_draft_model_path"):
        LLM(head, device="cpu", dtype="float32")


def test_resolved_settings_reach_the_engine(spec_models, llm_factory):
    """STANDALONE with nothing set runs with (3, 1, 4), and the verify width sizes the scheduler's KV reservation."""
    llm = llm_factory(spec_models["target"], speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=spec_models["draft_small"])
    state = llm.get_server_info()["internal_states"][0]
    assert (state["speculative_num_steps"], state["speculative_eagle_topk"], state["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert llm.engine.scheduler.decode_reserve == 4
    out = gen(llm, [[1, 2, 3]], greedy(9))[0]
    assert len(out.token_ids) == 9
    assert llm.engine.spec.num_steps == 3
