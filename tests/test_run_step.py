"""run_step.py end to end on the tiny preset (CPU): the user-facing contract."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import compile_stack
import run_step
from compile_stack.harness.profiling import BESIDE_COMPUTE, CATEGORIES

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {"device", "preset", "config", "compiled", "compile_s", "step_ms", "tokens_per_s",
                "peak_mem_gib", "mfu", "loss", "passes"}


@pytest.fixture
def cache(tmp_path):
    return ["--cache-dir", str(tmp_path / "cache")]


@pytest.mark.slow
def test_compiled_step_checks_inspects_profiles_and_reports(tmp_path, cache, capsys):
    out, inspect_dir, trace = tmp_path / "out.json", tmp_path / "inspect", tmp_path / "trace.json"
    code = run_step.main(["--compile", "--check", "--device", "cpu", "--steps", "2", "--warmup", "1",
                          "--json", str(out), "--inspect", str(inspect_dir), "--profile", str(trace), *cache])
    assert code == 0
    summary = json.loads(out.read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["preset"] == "tiny" and summary["compiled"] is True
    times = summary["step_times_ms"]
    assert len(times) == 2 and summary["step_ms"] == pytest.approx(sum(times) / 2, abs=0.01)  # the median of two
    assert summary["check"]["ok"] is True
    for key in ("loss_rel_err", "grad_rel_err", "param_rel_err"):
        assert 0 <= summary["check"][key] <= summary["check"]["tolerances"][key]
    # Every layer's attention and its q and k rotations (one block graph all layers call), one loss,
    # one fused update; the optimizer compiles once. The reference AdamW has no QR or Newton–Schulz.
    layers = summary["config"]["layers"]
    assert summary["passes"] == {"param_data": summary["passes"]["param_data"], "rope": 2 * layers,
                                 "attention": layers, "cross_entropy": 1, "adamw": 1, "linalg_qr": 0,
                                 "newton_schulz": 0}
    assert summary["passes"]["param_data"] > 0
    assert not [n for n in summary["pass_notes"] if "failed" in n], summary["pass_notes"]  # no pass broke on a graph
    index = (inspect_dir / "index.md").read_text()
    for kind in ("model.captured0.dynamo.py", "model0.joint.after.txt", "block0.dynamo.py", "block0.joint.before.txt",
                 "block0.joint.after.txt", "block0.code.py", "block0.code.2.py", "model1.joint.after.txt",
                 "optimizer0.pre_grad.after.txt", "optimizer0.code.py"):
        assert kind in index and (inspect_dir / kind).exists()
    assert "cstack.flash_attention_fwd" in (inspect_dir / "block0.joint.after.txt").read_text()
    assert "cstack.linear_cross_entropy_fwd" in (inspect_dir / "model1.joint.after.txt").read_text()
    assert "cstack.fused_adamw_" in (inspect_dir / "optimizer0.code.py").read_text()
    assert trace.exists() and set(summary["profile"]) >= {"attention", "matmul", "optimizer", "other"}
    assert abs(sum(summary["profile"][c]["share"] for c in CATEGORIES if c not in BESIDE_COMPUTE) - 1) < 1e-2
    assert summary["profile"]["largest"] and all(k["category"] in CATEGORIES for k in summary["profile"]["largest"])
    printed = capsys.readouterr().out
    assert "step 2/2" in printed and "compile_s" in printed


@pytest.mark.slow
def test_eager_step_with_stock_comparison(tmp_path, cache, monkeypatch):
    """Both steps timed; ours is freed before the stock one is built (both fit only one at a time)."""
    import weakref

    from compile_stack.harness import stock, user_code

    ours, freed_before_stock = [], []
    build = user_code.build_model
    monkeypatch.setattr(user_code, "build_model", lambda *a: ours.append(weakref.ref(m := build(*a))) or m)
    stock_init = stock.StockStep.__init__

    def init(self, model, *a, **kw):
        freed_before_stock.append(ours[0]() is None)
        stock_init(self, model, *a, **kw)

    monkeypatch.setattr(stock.StockStep, "__init__", init)
    out = tmp_path / "out.json"
    assert run_step.main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--compare", "stock", "--json", str(out),
                          *cache]) == 0
    assert freed_before_stock == [True]
    summary = json.loads(out.read_text())
    assert summary["compiled"] is False
    stock = summary["compare"]["stock"]
    assert stock["step_ms"] > 0 and summary["compare"]["speedup"] == pytest.approx(stock["step_ms"] / summary["step_ms"], rel=1e-2)


def test_a_check_whose_eager_reference_cannot_fit_is_refused(cache):
    # Compiled, S 65536 fits easily; the eager reference's B·H·S² scores (69 GB each) do not.
    with pytest.raises(SystemExit, match=r"--check: the eager reference .* estimated peak [\d.]+ GiB"):
        run_step.main(["--compile", "--check", "--seq", "65536", "--device", "cpu", *cache])


def test_a_config_that_cannot_fit_is_refused_with_the_estimate(cache, capsys):
    with pytest.raises(SystemExit, match=r"config does not fit: estimated peak [\d.]+ GiB"):
        run_step.main(["--preset", "full", "--device", "cpu", *cache])


@pytest.mark.parametrize("argv, message", [
    (["--memory-budget", "1.5"], "--memory-budget: expected a fraction in"),
    (["--steps", "0"], "--steps: expected at least 1"),
    (["--inspect", "x"], "--inspect: needs --compile"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        run_step.parse_args(argv)
    assert message in capsys.readouterr().err


def test_help_runs_as_a_script():
    result = subprocess.run([sys.executable, "run_step.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--compile" in result.stdout and "--inspect" in result.stdout


def test_blocks_compiled_once_match_the_whole_graph():
    """Blocks compiled once (the default): same loss and parameters as --whole-graph, where every
    block is inlined into one graph."""
    import torch

    from compile_stack.workloads.config import PRESETS
    from compile_stack.harness.user_code import make_train_step
    from compile_stack.workloads.reference import AdamW, build_model, cross_entropy
    from passes import registry

    cfg = PRESETS["tiny"].with_overrides(layers=3)
    results = {}
    for blocks in (False, True):
        torch._dynamo.reset()
        registry.current().clear()
        torch.manual_seed(0)
        model = build_model(cfg, "cpu", torch.float32)
        ids = torch.randint(cfg.vocab, (cfg.batch, cfg.seq))
        train_step = make_train_step(model, cross_entropy, AdamW(model.parameters()))
        step = compile_stack.compile_step(train_step, codegen=False, blocks=blocks)
        loss = step(ids, ids).item()
        block_graphs = [calls.backend.graphs for calls in step.block_calls]
        results[blocks] = (loss, [p.detach().clone() for p in model.parameters()], step.backend.graphs,
                           block_graphs, dict(registry.current().replacements))
    (loss_whole, params_whole, graphs_whole, blocks_whole, report_whole), \
        (loss_blocks, params_blocks, graphs_blocks, blocks_blocks, report_blocks) = results[False], results[True]
    assert (graphs_whole, blocks_whole) == (1, [])
    assert (graphs_blocks, blocks_blocks) == (2, [1])  # embedding, head + loss; one block graph
    assert report_whole["attention"] == report_blocks["attention"] == cfg.layers
    assert report_blocks["cross_entropy"] == 1 and report_blocks["adamw"] == 1
    assert loss_blocks == pytest.approx(loss_whole, rel=1e-6)
    for a, b in zip(params_blocks, params_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
