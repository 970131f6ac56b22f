"""benchmarks: MT-bench taken a few turns per category (real_accept --per-category), and head_ab's rounds that end
at the answer's EOS (--stop-at-eos)."""

from __future__ import annotations

from benchmarks.common import first_per_category
from benchmarks.probes.head_ab import rounds_to_end


def test_per_category_takes_the_first_questions_of_every_category_in_order():
    # MT-bench's file lists its categories in blocks (the first ten are all writing); interleaved here too
    questions = [f"q{i}" for i in range(12)]
    categories = ["writing"] * 5 + ["math", "roleplay", "math", "math", "roleplay", "roleplay", "coding"]
    assert first_per_category(questions, categories, 2) == ["q0", "q1", "q5", "q6", "q7", "q9", "q11"]
    assert first_per_category(questions, categories, 1) == ["q0", "q5", "q6", "q11"]
    assert first_per_category(questions, categories, 9) == questions


def test_rounds_stop_at_the_answers_end_even_when_drafts_would_go_on():
    prompt, answer, steps = [1, 2], [5, 6, 7], 3
    # a round anchored at ids[m] proposes ids[m + 1 + s] as drafts[s][m - 1 + s]: every draft here is "right", past
    # the answer too (ids 8, 9, ...)
    ids = prompt + answer + list(range(8, 8 + steps + 1))
    drafts = [[ids[i + 2] for i in range(len(ids) - 2)] for _ in range(steps)]
    # one round anchored at answer[0] (the prefill's token) accepts 6 and 7; 8 lies past the end
    assert rounds_to_end(drafts, prompt, answer, steps) == [2]
    # a miss inside the answer ends the round there: 6 accepted, 7 is the round's own token
    drafts[1][len(prompt)] = 0
    assert rounds_to_end(drafts, prompt, answer, steps) == [1]
