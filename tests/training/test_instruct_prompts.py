"""scripts/instruct_prompts.py: the train-draft prompts of MT-bench's kinds, written from our own templates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "instruct_prompts.py"


def _module():
    spec = importlib.util.spec_from_file_location("instruct_prompts", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prompts_are_distinct_reproducible_of_every_kind_and_avoid_banned_runs():
    m = _module()
    prompts = m.instruct_prompts(400, seed=3)
    assert len(prompts) == 400 and len(set(prompts)) == 400 and prompts == m.instruct_prompts(400, seed=3)
    assert prompts != m.instruct_prompts(400, seed=4)
    math = ["Solve for x", "area of a triangle", "sum of all", "probability", "Simplify", "f(x)", "common multiple",
            "discounted"]
    for markers in (["Write", "Draft", "Rewrite", "titles"], m.PERSONAS, m.CODE_TASKS, m.CONCEPTS, m.EVENTS, math):
        assert sum(any(w in p for w in markers) for p in prompts) >= 400 // 8 // 2, markers[:2]  # a kind's half
    banned = m._six_grams(prompts[0]) | m._six_grams(prompts[1])
    again = m.instruct_prompts(400, seed=3, banned=banned)
    assert prompts[0] not in again and prompts[1] not in again
    assert not any(m._six_grams(p) & banned for p in again)
