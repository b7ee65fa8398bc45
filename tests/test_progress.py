"""What run_step.py shows while it works: a line while the first step compiles, a bounded number
of step lines, and none of the profiler's own chatter."""
import os
import time

import torch

from compile_stack.harness import measure
from compile_stack.harness.profiling import record
from passes import registry


def test_heartbeat_says_the_first_step_is_still_compiling(capsys):
    with measure.heartbeat("ours", every_s=0.05):
        time.sleep(0.3)
    lines = capsys.readouterr().out.splitlines()
    assert 2 <= len(lines) <= 6
    assert all(line.startswith("[ours] first step: ") and line.endswith(" s so far (compiling)...") for line in lines)
    time.sleep(0.1)
    assert capsys.readouterr().out == ""  # stopped with the block


def test_heartbeat_says_what_was_replaced_so_far(capsys):
    report = registry.PassReport()
    report.replacements.update({"attention": 2, "rope": 0})
    with measure.heartbeat("ours", every_s=0.05, report=report):
        time.sleep(0.12)
    assert capsys.readouterr().out.splitlines()[0].endswith("(compiling; replaced so far: attention 2)...")


def test_step_lines_are_bounded_and_end_with_the_last():
    for n in (1, 7, 20):
        assert [i for i in range(1, n + 1) if measure.shown(i, n)] == list(range(1, n + 1))
    for n in (21, 100, 1001):
        lines = [i for i in range(1, n + 1) if measure.shown(i, n)]
        assert 5 <= len(lines) <= 11 and lines[-1] == n


def test_profiler_start_and_stop_lines_are_muted_not_the_step(capfd):
    def step():
        os.write(2, b"the step's own line\n")
        torch.ones(3).sum()

    record(step)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert err == "the step's own line\n"
