"""run_step.py end to end on the tiny preset (CPU): the user-facing contract."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import run_step

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_KEYS = {"device", "preset", "config", "compiled", "compile_s", "step_ms", "tokens_per_s",
                "peak_mem_gib", "mfu", "loss", "passes"}


@pytest.fixture
def cache(tmp_path):
    return ["--cache-dir", str(tmp_path / "cache")]


@pytest.mark.slow
def test_compiled_step_checks_inspects_profiles_and_reports(tmp_path, cache, capsys):
    out, inspect_dir, trace = tmp_path / "out.json", tmp_path / "inspect", tmp_path / "trace.json"
    code = run_step.main(["--compile", "--check", "--steps", "2", "--warmup", "1", "--json", str(out),
                          "--inspect", str(inspect_dir), "--profile", str(trace), *cache])
    assert code == 0
    summary = json.loads(out.read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["preset"] == "tiny" and summary["compiled"] is True
    assert summary["check"]["ok"] is True
    for key in ("loss_rel_err", "grad_rel_err", "param_rel_err"):
        assert 0 <= summary["check"][key] <= summary["check"]["tolerances"][key]
    # One rewrite per attention layer, one loss, one fused update; the optimizer compiles once.
    layers = summary["config"]["layers"]
    assert summary["passes"] == {"param_data": summary["passes"]["param_data"], "attention": layers,
                                 "cross_entropy": 1, "adamw": 1}
    assert summary["passes"]["param_data"] > 0
    index = (inspect_dir / "index.md").read_text()
    for kind in ("model0.dynamo.py", "model0.joint.before.txt", "model0.joint.after.txt", "model0.code.py",
                 "model0.code.2.py", "optimizer0.pre_grad.after.txt", "optimizer0.code.py"):
        assert kind in index and (inspect_dir / kind).exists()
    joint = (inspect_dir / "model0.joint.after.txt").read_text()
    assert "cstack.flash_attention_fwd" in joint and "cstack.linear_cross_entropy_fwd" in joint
    assert "cstack.fused_adamw_" in (inspect_dir / "optimizer0.code.py").read_text()
    assert trace.exists() and set(summary["profile"]) >= {"attention", "matmul", "optimizer", "other"}
    assert abs(sum(row["share"] for row in summary["profile"].values()) - 1) < 1e-2
    printed = capsys.readouterr().out
    assert "step 2/2" in printed and "compile_s" in printed


@pytest.mark.slow
def test_eager_step_with_stock_comparison(tmp_path, cache):
    out = tmp_path / "out.json"
    assert run_step.main(["--steps", "1", "--warmup", "0", "--compare", "stock", "--json", str(out), *cache]) == 0
    summary = json.loads(out.read_text())
    assert summary["compiled"] is False
    stock = summary["compare"]["stock"]
    assert stock["step_ms"] > 0 and summary["compare"]["speedup"] == pytest.approx(stock["step_ms"] / summary["step_ms"], rel=1e-2)


def test_memory_budget_changes_what_the_partitioner_saves(tmp_path):
    """A lower budget saves fewer values for the backward (recomputing even attention at 0), same loss."""
    import torch

    from compile_stack.config import PRESETS
    from compile_stack.reference import AdamW, build_model
    from compile_stack.step import StepOptions, TrainStep

    cfg = PRESETS["tiny"].with_overrides(layers=1)
    saved, losses, recomputes_attention = {}, {}, {}
    partition = torch._functorch.partitioners.min_cut_rematerialization_partition
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(cfg, "cpu", torch.float32)
        ids = torch.randint(cfg.vocab, (cfg.batch, cfg.seq))
        step = TrainStep(model, AdamW(model.parameters()), StepOptions(compile=True, memory_budget=budget, codegen=False))

        def spy(joint, inputs, **kw):
            fwd, bwd = partition(joint, inputs, **kw)
            out = next(n for n in fwd.graph.nodes if n.op == "output")
            saved[budget] = sum(a.meta["val"].numel() for a in out.args[0]
                                if hasattr(a, "meta") and isinstance(a.meta.get("val"), torch.Tensor))
            recomputes_attention[budget] = any("flash_attention_fwd" in str(n.target) for n in bwd.graph.nodes)
            return fwd, bwd

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("compile_stack.capture.min_cut_rematerialization_partition", spy)
            losses[budget] = step(ids, ids).item()
    assert saved[0.0] < saved[1.0]
    assert losses[0.0] == pytest.approx(losses[1.0], rel=1e-6)
    assert recomputes_attention == {1.0: False, 0.0: True}


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


def test_regional_compile_shares_one_block_graph_and_matches(tmp_path):
    """--regional: three model graphs whatever the depth, same loss and gradients as the whole graph."""
    import torch

    from compile_stack.config import PRESETS
    from compile_stack.reference import AdamW, build_model
    from compile_stack.step import StepOptions, TrainStep
    from passes import registry

    cfg = PRESETS["tiny"].with_overrides(layers=3)
    results = {}
    for regional in (False, True):
        torch._dynamo.reset()
        registry.REPORT.clear()
        torch.manual_seed(0)
        model = build_model(cfg, "cpu", torch.float32)
        ids = torch.randint(cfg.vocab, (cfg.batch, cfg.seq))
        step = TrainStep(model, AdamW(model.parameters()), StepOptions(compile=True, codegen=False, regional=regional))
        loss = step(ids, ids).item()
        results[regional] = (loss, [p.detach().clone() for p in model.parameters()], step.backend.graphs,
                             dict(registry.REPORT.replacements))
    (loss_whole, params_whole, graphs_whole, report_whole), (loss_reg, params_reg, graphs_reg, report_reg) = (
        results[False], results[True])
    assert graphs_whole == 1 and graphs_reg == 3  # embedding, the shared block, head + loss
    assert report_whole["attention"] == cfg.layers and report_reg["attention"] == 1
    assert report_reg["cross_entropy"] == 1 and report_reg["adamw"] == 1
    assert loss_reg == pytest.approx(loss_whole, rel=1e-6)
    for a, b in zip(params_reg, params_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
