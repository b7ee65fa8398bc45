"""benchmarks/results.py: the results file and docs/benchmarks.md's current-figures table, on temporary files."""
import json
import re

import pytest

from benchmarks import results


def test_the_table_keeps_each_figures_latest_entry(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    results.append_result("step", {"step_ms": 10.0}, "stock 12.0 ms", "run_step.py --compile", path=path)
    results.append_result("attention", "fwd 1.0 ms", None, "bench_attention.py", extra={"note": "a note"}, path=path)
    results.append_result("step", "9.0 ms", "stock 11.0 ms", "run_step.py --compile", path=path)
    older = {**json.loads(path.read_text().splitlines()[0]), "ours": "an older figure", "date": "2000-01-01"}
    with path.open("a") as f:  # later in the file, earlier by date: not the latest
        f.write(json.dumps(older) + "\n")
    entry = json.loads(path.read_text().splitlines()[0])
    assert {"date", "commit", "device", "torch", "triton", "command"} <= entry.keys()

    results.main(["--table", "--results", str(path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| figure | ours | anchor, same call | command | commit | date |"
    assert len(lines) == 4
    assert lines[2].startswith("| step | 9.0 ms | stock 11.0 ms | `run_step.py --compile` |")
    assert lines[3].startswith("| attention | fwd 1.0 ms | – | `bench_attention.py` a note |")


def test_write_replaces_only_the_text_between_the_markers(tmp_path):
    path = tmp_path / "results.jsonl"
    results.append_result("step", "9.0 ms", None, "run_step.py", path=path)
    markdown = tmp_path / "benchmarks.md"
    head, tail = "# Benchmarks\n\nintro\n", "\n\n## an entry\n\ntext\n"
    markdown.write_text(f"{head}{results.BEGIN}\n| old | table |\n{results.END}{tail}")
    results.main(["--write", str(markdown), "--results", str(path)])
    assert markdown.read_text() == f"{head}{results.BEGIN}\n{results.table(path)}\n{results.END}{tail}"


def test_a_missing_marker_names_the_file(tmp_path):
    markdown = tmp_path / "benchmarks.md"
    markdown.write_text(f"# Benchmarks\n{results.BEGIN}\n| table |\n")
    with pytest.raises(SystemExit, match=re.escape(f"{markdown}: marker not found: {results.END}")):
        results.write(markdown, tmp_path / "results.jsonl")


def test_tests_never_append_to_the_real_file():
    before = results.RESULTS.read_text()
    assert results.append_result("step", "1 ms", None) is None
    assert results.RESULTS.read_text() == before


def test_a_snapshots_commit_comes_from_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "results.jsonl"
    monkeypatch.setenv("COMPILE_STACK_COMMIT", "abc1234")
    results.append_result("step", "9.0 ms", None, "run_step.py --compile", path=path)
    monkeypatch.delenv("COMPILE_STACK_COMMIT")
    results.append_result("step", "9.0 ms", None, "run_step.py --compile", path=path)
    first, second = (json.loads(line)["commit"] for line in path.read_text().splitlines())
    assert first == "abc1234" and second == results.git_commit() != "abc1234"
