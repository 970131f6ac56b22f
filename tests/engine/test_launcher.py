"""Launcher (runner/launcher.py) on its own: inline when off; on, FIFO on one helper thread that sees the submitting
thread's RuntimeOptions, with the work's error raised at join."""

from __future__ import annotations

import threading

import pytest
import torch

from hyperdraft import options
from hyperdraft.options import RuntimeOptions
from hyperdraft.runner.launcher import Launcher

CPU = torch.device("cpu")


def test_off_runs_inline():
    launcher = Launcher(False, CPU)
    seen = launcher.submit(threading.get_ident)
    assert seen.result() == threading.get_ident() and launcher.submitted == 0
    launcher.join()  # nothing pending: a no-op


def test_on_runs_in_order_on_one_helper_thread_with_the_callers_options():
    launcher = Launcher(True, CPU)
    order, threads = [], set()
    mine = RuntimeOptions(pdl=False)

    def work(i):
        def run():
            order.append(i)
            threads.add(threading.get_ident())
            return options.current(), torch.is_grad_enabled()
        return run

    with options.activated(mine):
        pending = [launcher.submit(work(i)) for i in range(20)]
    launcher.join()
    assert order == list(range(20)) and len(threads) == 1 and threading.get_ident() not in threads
    assert all(p.result() == (mine, False) for p in pending)  # the caller's options, under no_grad
    assert launcher.submitted == 20
    launcher.close()


def test_an_error_surfaces_at_join_once():
    launcher = Launcher(True, CPU)

    def fail():
        raise ValueError("launch failed")

    launcher.submit(fail)
    with pytest.raises(ValueError, match="launch failed"):
        launcher.join()
    launcher.join()  # already raised: the launcher is usable again
    assert launcher.submit(lambda: 7).result() == 7
    launcher.close()
    assert launcher.submit(threading.get_ident).result() == threading.get_ident()  # closed: inline
