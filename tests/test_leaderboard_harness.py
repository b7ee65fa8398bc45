"""benchmarks/leaderboard_harness.py: the leaderboard's own step and timing code with compile_step added."""
import pytest

import compile_stack
from benchmarks import leaderboard_harness as harness


@pytest.mark.slow
def test_the_harness_compiles_the_published_step_with_the_options_given(monkeypatch):
    """The added line gets ``--offload-activations``' share, and the published step comes out of it
    with attention, the loss and AdamW replaced (on the CPU: timed by the wall clock)."""
    calls = []
    compile_step = compile_stack.compile_step

    def spy(step, **options):
        calls.append(options)
        return compile_step(step, **options)

    monkeypatch.setattr(compile_stack, "compile_step", spy)
    result = harness.main(["--preset", "tiny", "--layers", "2", "--rep", "1", "--warmup", "1",
                           "--offload-activations", "0.5"])
    assert calls == [{"offload_activations": 0.5}]
    assert result["compiled"] and result["offload_activations"] == 0.5 and result["step_ms"] > 0
    replaced = result["passes"]["replacements"]
    assert all(replaced[name] > 0 for name in ("attention", "cross_entropy", "adamw")), replaced


@pytest.mark.parametrize("argv, expected", [
    (["--offload-activations", "1.5"], "--offload-activations: expected a share of the host's memory in (0, 1)"),
    (["--offload-activations", "--no-compile"], "--offload-activations: needs the compiled step"),
    (["--rep", "0"], "--rep: expected a positive number of milliseconds"),
])
def test_bad_options_are_refused_naming_the_option(argv, expected, capsys):
    with pytest.raises(SystemExit):
        harness.parse_args(argv)
    assert expected in capsys.readouterr().err


def test_without_offload_the_added_line_is_the_plain_call():
    """No flag: the plan's default (offload within the host's free memory); the flag that turns it off."""
    assert harness.parse_args([]).offload_activations is None
    assert harness.parse_args(["--no-offload-activations"]).offload_activations is False
