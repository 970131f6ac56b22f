"""training/plot.running_mean, which draws train-draft's curves."""

from hyperdraft.training.plot import running_mean


def test_running_mean_averages_each_value_with_the_ones_before():
    assert running_mean([1.0, 2.0, 3.0, 4.0, 5.0], 2) == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert running_mean([4.0, 0.0, 2.0], 3) == [4.0, 2.0, 2.0]  # fewer values at the start
    assert running_mean([1.0, 7.0], 1) == [1.0, 7.0]
