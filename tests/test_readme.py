"""The README's first example runs as written, from the installed wheel (tests/installed_wheel.py)
in a directory outside the checkout, and the passes it has work for fire on it."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

from tests.installed_wheel import clean_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_readme_first_example_runs_and_every_pass_fires(installed_wheel, tmp_path):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert "compile_stack.compile_step(train_step)" in code
    _, python = installed_wheel
    # Empty caches: what a new user's first run compiles.
    result = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                            env=clean_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0]
    report = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert report["replacements"]["attention"] == 2  # one per layer
    assert report["replacements"]["cross_entropy"] == 1 and report["replacements"]["adamw"] == 1


def install_block() -> list[str]:
    """The commands of the README's "Install and test" block, without their comments."""
    section = (ROOT / "README.md").read_text().split("## Install and test\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_install_and_test_commands():
    readme = install_block()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith(("pip ", "python -m pytest"))]
    cpu = readme[0].split(" --index-url ")[0]  # CI cannot reach the CPU line's index; its own has the build
    assert ci == [cpu, *readme[-2:]]
    assert readme[-2:] == ['pip install -e ".[test]"', "python -m pytest -q -n 2"]
