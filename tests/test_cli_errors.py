"""run_step.py's command line: bad options and unwritable outputs are refused up front, in one line.

Each case runs ``run_step.main`` with model building made to fail, so a check that came only after
the model (or after the whole run) fails the test instead of running a step; the refusal must be a
SystemExit whose message names the option and what was expected, with no traceback.
In the paths, {file} is an existing regular file, {under_file} a path below it (not writable even
for root) and {tmp} an existing writable directory.
"""
import subprocess
import sys
from pathlib import Path

import pytest

import run_step
from compile_stack.harness import plan, user_code

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    ("--seq 0", "--seq: expected a positive integer, got 0"),
    ("--batch -1", "--batch: expected a positive integer, got -1"),
    ("--layers 0", "--layers: expected a positive integer, got 0"),
    ("--heads 5", "--heads: expected a divisor of d_model=64, got 5 (preset tiny)"),
    ("--heads 64", "--heads: head dim d_model/heads must be even for RoPE"),
    ("--preset small --heads 5", "--heads: expected a divisor of d_model=4096, got 5 (preset small)"),
    ("--passes unknown", "--passes: unknown pass ['unknown']; expected some of"),
    ("--passes adamw,nope", "--passes: unknown pass ['nope']"),
    ("--compile --inspect {file}", "--inspect: expected a writable directory"),
    ("--compile --inspect {under_file}/graphs", "--inspect: expected a writable directory"),
    ("--cache-dir {file}", "--cache-dir: expected a writable directory"),
    ("--cache-dir {under_file}", "--cache-dir: expected a writable directory"),
    ("--cache-dir /proc/no_such_dir/cache", "--cache-dir: expected a writable directory"),
    ("--device tpu", "--device: expected cpu, cuda or cuda:N, got 'tpu'"),
    ("--device meta", "--device: expected cpu, cuda or cuda:N, got 'meta'"),
    ("--device cuda:99", "--device: expected"),
    ("--json {under_file}/out.json", "--json: expected a writable file path"),
    ("--json {tmp}/missing/out.json", "--json: expected a writable file path in an existing directory"),
    ("--json {tmp}", "--json: expected a writable file path, got"),
    ("--json /proc/out.json", "--json: expected a writable file path"),
    ("--profile {tmp}/missing/trace.json", "--profile: expected a writable file path in an existing directory"),
    ("--profile {under_file}/trace.json", "--profile: expected a writable file path"),
    ("--offload-activations", "--offload-activations: needs --compile"),
    ("--compile --offload-activations --memory-budget 0.5",
     "--offload-activations: expected False with a fixed --memory-budget"),
    ("--compile --offload-activations --no-offload-activations", "not allowed with argument"),
    ("--compile --memory-budget 1.5", "--memory-budget: expected a fraction in [0, 1], got 1.5"),
    ("--compile --offload-activations 1.2", "--offload-activations: expected a share of the host's memory in (0, 1)"),
    ("--compile --offload-activations 0", "--offload-activations: expected a share of the host's memory in (0, 1)"),
]


@pytest.fixture
def no_work(monkeypatch):
    """Building a model or a step fails the test: every refusal must come before them."""
    def refuse(*args, **kwargs):
        raise AssertionError("the run started before the options were checked")

    for module, name in ((user_code, "build_model"), (user_code, "build_user_model"),
                         (user_code, "make_train_step"), (plan, "choose_budget")):
        monkeypatch.setattr(module, name, refuse)


def argv_of(case: str, tmp_path: Path) -> list[str]:
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("")
    argv = case.format(file=a_file, under_file=a_file, tmp=tmp_path).split()
    if "--cache-dir" not in argv:
        argv += ["--cache-dir", str(tmp_path / "cache")]
    return argv + ["--steps", "1", "--warmup", "0"]


@pytest.mark.parametrize("case, fragment", CASES, ids=[c for c, _ in CASES])
def test_bad_option_is_refused_in_one_line(case, fragment, tmp_path, no_work, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_step.main(argv_of(case, tmp_path))
    code, err = exit_info.value.code, capsys.readouterr().err
    message = code if isinstance(code, str) else err.strip().splitlines()[-1]  # p.error: usage, then the error
    assert code != 0 and code is not None
    assert fragment in message
    assert "\n" not in message and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # refused before the caches were set up


def test_good_output_paths_are_accepted_and_left_untouched(tmp_path):
    """Missing directories for --inspect and --cache-dir are fine (the run makes them); nothing is
    written by the checks."""
    args = run_step.parse_args(["--compile", "--inspect", str(tmp_path / "a" / "b"), "--cache-dir",
                                str(tmp_path / "cache"), "--json", str(tmp_path / "out.json"),
                                "--profile", str(tmp_path / "trace.json"), "--device", "cpu", "--heads", "2"])
    assert args.heads == 2 and list(tmp_path.iterdir()) == []


def test_the_script_prints_one_line_and_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "run_step.py", "--json", str(tmp_path / "no" / "out.json")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("run_step.py: error: --json: expected")
