"""benchmarks: MT-bench taken a few turns per category (real_accept --per-category), and head_ab's rounds that end
at the answer's EOS (--stop-at-eos)."""

from __future__ import annotations

import collections

from benchmarks.common import mt_bench_categories, mt_bench_first_turns, mt_bench_per_category
from benchmarks.probes.head_ab import rounds_to_end


def test_per_category_takes_the_first_turns_of_every_category_in_file_order():
    questions = mt_bench_per_category(2)
    category = dict(zip(mt_bench_first_turns(), mt_bench_categories()))
    counts = collections.Counter(category[q] for q in questions)
    assert len(counts) == 8 and set(counts.values()) == {2}
    order = mt_bench_first_turns()
    positions = [order.index(q) for q in questions]
    assert positions == sorted(positions)
    firsts = [next(q for q in order if category[q] == c) for c in counts]
    assert all(q in questions for q in firsts)


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
