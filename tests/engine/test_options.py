"""RuntimeOptions: one frozen object for every runtime switch, built from EngineArgs and the environment, held and
activated by the engine; kernel dispatch reads the active one, and outside an engine the process environment's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hyperdraft import options
from hyperdraft.config import EngineArgs
from hyperdraft.models.cpu_linear import uses_skinny_path
from hyperdraft.options import _SWITCHES, RuntimeOptions, activated, current
from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_models  # noqa: F401


@pytest.mark.parametrize("field", sorted(_SWITCHES))
def test_each_variable_flips_its_field_alone(field):
    var, flip = _SWITCHES[field]
    default = RuntimeOptions()
    got = RuntimeOptions.from_env({var: flip})
    assert getattr(got, field) == (not getattr(default, field))
    assert dataclasses.replace(got, **{field: getattr(default, field)}) == default
    assert RuntimeOptions.from_env({var: "something else"}) == default  # only the documented value flips it


@pytest.mark.parametrize("field", sorted(_SWITCHES))
def test_each_variable_is_documented(field):
    """The README's table and the options module's own table name every switch with the value that flips it."""
    var, flip = _SWITCHES[field]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"`{var}={flip}`" in readme, f"README.md: no row for {var}={flip}"
    assert f"{var}={flip}" in options.__doc__, f"hyperdraft/options.py's docstring: no row for {var}={flip}"


def test_defaults_are_the_fast_path_and_overrides_win():
    assert RuntimeOptions.from_env({}) == RuntimeOptions()
    assert RuntimeOptions().fused_kernels and not RuntimeOptions().emulate_cuda_graphs
    env = {"HYPERDRAFT_DISABLE_PDL": "1"}
    assert RuntimeOptions.from_env(env, pdl=True).pdl and not RuntimeOptions.from_env(env).pdl


@pytest.mark.parametrize("text", ["often", "1.5", "-0.1"])
def test_a_bad_simulated_rate_names_the_variable(text):
    with pytest.raises(ValueError, match="HYPERDRAFT_SIMULATE_ACCEPT_RATE"):
        RuntimeOptions.from_env({"HYPERDRAFT_SIMULATE_ACCEPT_RATE": text})
    with pytest.raises(ValueError, match="simulate_accept_rate"):
        RuntimeOptions(simulate_accept_rate=2.0)


def test_engine_args_come_before_the_environment():
    env = {"HYPERDRAFT_SIMULATE_ACCEPT_RATE": "0.3"}
    args = EngineArgs(model_path="m", speculative_algorithm="NGRAM")
    assert RuntimeOptions.from_args(args, env).simulate_accept_rate == 0.3
    args = args.replace(speculative_simulate_accept_rate=0.7)
    assert RuntimeOptions.from_args(args, env).simulate_accept_rate == 0.7


def test_activated_nests_and_restores():
    outside = current()
    a, b = RuntimeOptions(pdl=False), RuntimeOptions(gemv=False)
    with activated(a):
        assert current() is a
        with activated(b):
            assert current() is b
        assert current() is a
    assert current() is outside


def test_kernel_dispatch_reads_the_active_options():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    assert uses_skinny_path(x, w)
    with activated(RuntimeOptions(skinny_cpu_linear=False)):
        assert not uses_skinny_path(x, w)
    assert uses_skinny_path(x, w)


def test_the_engine_holds_its_options_and_activates_them_for_its_steps(spec_models, llm_factory):
    """Two engines in one process, each stepping under its own options; nothing leaks outside a step."""
    mine = RuntimeOptions(skinny_cpu_linear=False, record_step_time=True)
    llm = llm_factory(spec_models["target"], runtime_options=mine, speculative_algorithm="NGRAM")
    other = llm_factory(spec_models["target"])
    assert llm.engine.options is mine and other.engine.options == RuntimeOptions.from_args(other.args)
    seen = []
    run = llm.engine.worker.run

    def observe(batch):  # records, then runs the real step
        seen.append(options.current())
        return run(batch)

    llm.engine.worker.run = observe
    prompts, params = mixed_prompts(4, seed=3, max_len=30), [greedy(6)] * 4
    assert [o.token_ids for o in gen(llm, prompts, params)] == [o.token_ids for o in gen(other, prompts, params)]
    assert seen and all(s is mine for s in seen)
    assert current() is not mine
    assert llm.engine.worker.timer.enabled  # record_step_time took effect
    assert llm.get_server_info()["internal_states"][0]["spec_phase_seconds"]["verify"] > 0


@pytest.mark.parametrize("ahead", [True, False])
def test_decode_ahead_is_an_option(spec_models, llm_factory, ahead):
    """Emulated graphs with decode-ahead on or off: the same tokens, and the queued decodes serve steps only when on."""
    opts = RuntimeOptions(emulate_cuda_graphs=True, decode_ahead=ahead)
    llm = llm_factory(spec_models["target"], runtime_options=opts, cuda_graph_max_bs=8)
    ref = llm_factory(spec_models["target"])
    prompts, params = mixed_prompts(6, seed=9, max_len=30), [greedy(12)] * 6
    assert [o.token_ids for o in gen(llm, prompts, params)] == [o.token_ids for o in gen(ref, prompts, params)]
    assert llm.engine.runner.graphs is not None and ref.engine.runner.graphs is None
    assert (llm.engine.worker.ahead_used > 0) == ahead


def test_the_simulated_rate_comes_from_the_args_first_then_the_options(spec_models, llm_factory):
    """Explicit options without a rate must not drop the one EngineArgs carry (benchmarks pass both)."""
    kw = dict(speculative_algorithm="NGRAM")
    given = llm_factory(spec_models["target"], runtime_options=RuntimeOptions(), speculative_simulate_accept_rate=0.5, **kw)
    assert given.engine.spec.simulate_accept_rate == 0.5
    from_options = llm_factory(spec_models["target"], runtime_options=RuntimeOptions(simulate_accept_rate=0.4), **kw)
    assert from_options.engine.spec.simulate_accept_rate == 0.4
    assert llm_factory(spec_models["target"], runtime_options=RuntimeOptions(), **kw).engine.spec.simulate_accept_rate is None
