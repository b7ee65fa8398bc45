"""examples/leaderboard/main.py: the submission starts its own two processes and prints ms per step."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "examples" / "leaderboard" / "main.py"


def _main_module():
    spec = importlib.util.spec_from_file_location("leaderboard_main", MAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_main_spawns_two_gloo_processes_and_prints_ms_per_step():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(MAIN), "--preset", "tiny", "--rep", "1", "--warmup", "1"],
                            cwd=MAIN.parent, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [ln for ln in result.stdout.splitlines() if "ms per step" in ln]
    assert len(lines) == 1 and re.match(r"\d+\.\d ms per step \(the reference model, 2 layers, 2 × CPU\)", lines[0])


def test_the_users_factory_when_installed_else_none():
    main = _main_module()
    assert main.user_factory("tests.user_models:build_gpt").__name__ == "build_gpt"
    assert main.user_factory("no_such_course_package.model:Model") is None
    with pytest.raises(AttributeError):
        main.user_factory("tests.user_models:no_such_factory")


def test_bad_model_spec_is_refused(capsys):
    with pytest.raises(SystemExit):
        _main_module().parse_args(["--model", "just_a_module"])
    assert "--model: expected MODULE:FACTORY" in capsys.readouterr().err
