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
from compile_stack.harness import build, plan, user_code
from compile_stack.harness.options import OVERRIDES
from compile_stack.memory_plan import sizes

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


M = "tests.user_mistakes"
FACTORY = ("a factory FACTORY(vocab_size=, context_length=, d_model=, num_layers=, num_heads=, d_ff=) "
           "returning an nn.Module")
ON_LOGITS = "on logits [2, 8, 512] and targets [2, 8]"
# The user's code: each mistake and the exact line that refuses it (tests/user_mistakes.py).
USER_CASES = [
    (f"--model {M}:NOT_CALLABLE", f"--model: expected {FACTORY}, got '{M}:NOT_CALLABLE', which is not callable (int)"),
    (f"--model {M}:build_from_config",
     f"--model: expected {FACTORY}, got build_from_config(cfg) (missing a required argument: 'cfg')"),
    (f"--model {M}:build_not_a_module", "--model: expected a factory returning an nn.Module, got list"),
    (f"--model {M}:build_hidden_states",
     "--model: expected logits [B, S, V] = [2, 8, 512] from token ids [2, 8], got shape [2, 8, 64]"),
    (f"--model {M}:build_failing_forward", "--model: the model failed on token ids [2, 8]: RuntimeError: "
                                           "mat1 and mat2 must have the same dtype, but got Long and BFloat16"),
    (f"--loss {M}:NOT_CALLABLE",
     f"--loss: expected a function FN(logits, targets), got '{M}:NOT_CALLABLE', which is not callable (int)"),
    (f"--loss {M}:loss_with_mask", "--loss: expected a function FN(logits, targets), got "
                                   "loss_with_mask(logits, targets, mask) (missing a required argument: 'mask')"),
    (f"--loss {M}:loss_unflattened", f"--loss: FN(logits, targets) failed {ON_LOGITS}: "
                                     "RuntimeError: Expected target size [2, 512], got [2, 8]"),
    (f"--loss {M}:loss_per_logit", "--loss: expected a floating-point scalar or one loss per token ([], [B, S] or "
                                   f"[B·S]) {ON_LOGITS}, got shape [2, 8, 512]"),
    (f"--loss {M}:loss_as_float", "--loss: expected a floating-point scalar or one loss per token ([], [B, S] or "
                                  f"[B·S]) {ON_LOGITS}, got a float"),
    (f"--optimizer {M}:NOT_CALLABLE",
     f"--optimizer: expected an optimizer class CLASS(params), got '{M}:NOT_CALLABLE', which is not callable (int)"),
    (f"--optimizer {M}:OptimizerWithoutParams", "--optimizer: expected an optimizer class CLASS(params), got "
                                                "OptimizerWithoutParams(*, lr=0.001) (too many positional arguments)"),
    (f"--optimizer {M}:NotAnOptimizer", "--optimizer: expected an optimizer with step() and zero_grad(), "
                                        "got a NotAnOptimizer without step() or zero_grad()"),
    (f"--optimizer {M}:FailingOptimizer",
     "--optimizer: CLASS(model.parameters()) failed: ValueError: Invalid learning rate: -1.0"),
]


@pytest.fixture
def no_compile(monkeypatch):
    """Compiling or running a step fails the test: the user's code must be refused before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the step was compiled or run before the user's code was checked")

    monkeypatch.setattr(build.compile_stack, "compile_step", refuse)
    monkeypatch.setattr(build, "FirstCallTimer", refuse)


@pytest.mark.parametrize("case, message", USER_CASES, ids=[c.split(":")[1] + c.split()[0] for c, _ in USER_CASES])
def test_users_mistake_is_refused_in_one_line_before_compiling(case, message, tmp_path, no_compile, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_step.main(["--compile", "--device", "cpu", *argv_of(case, tmp_path)])
    assert exit_info.value.code == message
    assert "Traceback" not in capsys.readouterr().err


def test_users_right_code_passes_the_checks(tmp_path, no_compile):
    """The same checks let the right code through (to the step, which the fixture stops)."""
    with pytest.raises(AssertionError, match="the step was compiled or run"):
        run_step.main(["--compile", "--device", "cpu", "--model", f"{M}:build_gpt", "--loss", f"{M}:token_loss",
                       "--optimizer", "tests.user_models:MyAdamW", *argv_of("", tmp_path)])


GIB = 2**30
SIZE_FLAGS = {"--preset", *(f"--{n.replace('_', '-')}" for n in OVERRIDES), "--memory-budget"}
# Configs that cannot fit a 24 GiB CPU: the first words of the refusal, and whether it may suggest --compile.
TOO_LARGE = [
    ("--preset small --seq 4096", "config does not fit: estimated peak", True),
    ("--preset small --seq 4096 --check", "config does not fit: estimated peak", False),
    ("--preset full", "config does not fit: estimated peak", False),
    ("--preset full --compile", "config does not fit: estimated peak", False),
    ("--preset small --compile --memory-budget 1", "config does not fit: estimated peak", False),
    ("--preset small --seq 4096 --check --compile",
     "--check: the eager reference step it runs next to ours does not fit: estimated peak", False),
]


def without_size_flags(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in SIZE_FLAGS:
            skip = True
        else:
            out.append(word)
    return out


def suggestions(message: str) -> list[list[str]]:
    """The options a refusal suggests ("Try A, or B (estimated …)" / "check B (…)"), each as argv."""
    tail = message.split(". ", 1)[1].split("; or --force")[0]
    found = []
    tail = tail.replace("Run without --check, or check ", "Try ").removeprefix("Try ")
    for part in tail.split(", or "):
        found.append(part.split(" (estimated")[0].split())
    return found


@pytest.mark.parametrize("case, start, may_compile", TOO_LARGE, ids=[c for c, _, _ in TOO_LARGE])
def test_a_refusal_suggests_options_that_fit(case, start, may_compile, tmp_path, monkeypatch):
    """Each suggestion differs from the refused config and is planned without refusal; --compile
    is suggested only where the compiled step fits."""
    monkeypatch.setattr(sizes, "device_bytes", lambda device: 24 * GIB)
    argv = argv_of(case, tmp_path) + ["--device", "cpu"]
    with pytest.raises(SystemExit) as exit_info:
        plan.plan_run(run_step.parse_args(argv))
    message = exit_info.value.code
    assert message.startswith(start) and "\n" not in message and message.endswith("or --force to run anyway.")
    options = suggestions(message)
    assert options and (["--compile"] in options) == may_compile
    for option in options:
        if option[0] == "--compile" or option[0] == "--memory-budget":
            suggested = argv + option
        else:
            suggested = without_size_flags(argv) + option + [f for f in ("--compile",) if f in argv]
        assert suggested != argv
        plan.plan_run(run_step.parse_args(suggested))  # fits: no SystemExit


def test_force_is_documented(capsys):
    with pytest.raises(SystemExit):
        run_step.parse_args(["--help"])
    assert "--force               run even if the memory estimate says" in capsys.readouterr().out
