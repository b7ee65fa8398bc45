"""The README's first example runs as written and the passes it has work for fire on it."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_readme_first_example_runs_and_every_pass_fires(tmp_path):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "compile_stack.compile_step(train_step)" in code
    # Empty caches: what a new user's first run compiles.
    env = {"COMPILE_STACK_CACHE": str(tmp_path / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0]
    report = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert report["replacements"]["attention"] == 2  # one per layer
    assert report["replacements"]["cross_entropy"] == 1 and report["replacements"]["adamw"] == 1
