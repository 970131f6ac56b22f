"""benchmarks/real_accept.row_line: a row's turns against plain's in the same turns (--repeats)."""

from __future__ import annotations

from benchmarks.real_accept import RowRun, row_line

STATE = {"avg_spec_accept_length": 2.5, "spec_acceptance_by_position": [0.75, 0.5],
         "spec_steps_per_tier": {"2": 10}}


def test_one_turn_reads_as_before():
    line = row_line("chain 2", [RowRun([[1, 2]], 150.0, {}, STATE)], [RowRun([[1, 2]], 100.0, {}, {})])
    assert line == "| chain 2 | 150.0 | 1.50x | 2.50 | 0.75 0.50 | 1/1 | 2: 10 |"


def test_turns_give_medians_of_paired_ratios_and_count_every_output():
    plain = [RowRun([[1, 2]], rate, {}, {}) for rate in (100.0, 50.0, 80.0)]
    row = [RowRun([[1, 2]], 150.0, {}, STATE), RowRun([[1, 3]], 100.0, {}, STATE), RowRun([[1, 2]], 90.0, {}, STATE)]
    # ratios 1.5, 2.0, 1.125: the median pairs each turn with its own plain run, not medians of each column
    assert row_line("chain 2", row, plain) == \
        "| chain 2 | 100.0 (90.0-150.0) | 1.50x (1.12-2.00) | 2.50 | 0.75 0.50 | 2/3 | 2: 10 |"
