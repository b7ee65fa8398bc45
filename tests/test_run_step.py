"""run_step.py end to end on the tiny preset (CPU): the user-facing contract."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import run_step
from compile_stack.profiling import CATEGORIES

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
    # Regional: one rewrite in the block graph all layers share, one loss, one fused update;
    # the optimizer compiles once.
    assert summary["passes"] == {"param_data": summary["passes"]["param_data"], "attention": 1,
                                 "cross_entropy": 1, "adamw": 1}
    assert summary["passes"]["param_data"] > 0
    index = (inspect_dir / "index.md").read_text()
    for kind in ("model0.dynamo.py", "model1.joint.before.txt", "model1.joint.after.txt", "model1.code.py",
                 "model1.code.2.py", "optimizer0.pre_grad.after.txt", "optimizer0.code.py"):
        assert kind in index and (inspect_dir / kind).exists()
    assert "cstack.flash_attention_fwd" in (inspect_dir / "model1.joint.after.txt").read_text()
    assert "cstack.linear_cross_entropy_fwd" in (inspect_dir / "model2.joint.after.txt").read_text()
    assert "cstack.fused_adamw_" in (inspect_dir / "optimizer0.code.py").read_text()
    assert trace.exists() and set(summary["profile"]) >= {"attention", "matmul", "optimizer", "other"}
    assert abs(sum(summary["profile"][c]["share"] for c in CATEGORIES) - 1) < 1e-2
    assert summary["profile"]["largest"] and all(k["category"] in CATEGORIES for k in summary["profile"]["largest"])
    printed = capsys.readouterr().out
    assert "step 2/2" in printed and "compile_s" in printed


@pytest.mark.slow
def test_eager_step_with_stock_comparison(tmp_path, cache, monkeypatch):
    """Both steps timed; ours is freed before the stock one is built (both fit only one at a time)."""
    import weakref

    from compile_stack import stock

    ours, freed_before_stock = [], []
    build = run_step.build_model
    monkeypatch.setattr(run_step, "build_model", lambda *a: ours.append(weakref.ref(m := build(*a))) or m)
    stock_init = stock.StockStep.__init__

    def init(self, model, *a, **kw):
        freed_before_stock.append(ours[0]() is None)
        stock_init(self, model, *a, **kw)

    monkeypatch.setattr(stock.StockStep, "__init__", init)
    out = tmp_path / "out.json"
    assert run_step.main(["--steps", "1", "--warmup", "0", "--compare", "stock", "--json", str(out), *cache]) == 0
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


def test_regional_compile_shares_one_block_graph_and_matches(tmp_path):
    """Regional (the default): three model graphs whatever the depth, same loss and gradients as --whole-graph."""
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


# --------------------------------------------------------------------------- out-of-range targets

def _flagging_step(bad_calls):
    """A stand-in step whose calls numbered in ``bad_calls`` (from 1) leave the fused loss's bad-target flag
    set, as its op does on a target >= V; returns how often it was called."""
    import torch

    from custom_ops.linear_cross_entropy import linear_cross_entropy

    calls = []

    def step(inputs, targets):
        calls.append(1)
        targets = torch.tensor([0, 11 if len(calls) in bad_calls else 10, -100])
        return linear_cross_entropy(torch.randn(3, 8), torch.randn(11, 8), targets)

    return step, calls


def test_timed_steps_stop_at_the_step_that_saw_a_bad_target():
    import torch

    step, calls = _flagging_step({2})
    with pytest.raises(ValueError, match=r"^targets: expected values in \[0, V\)"):
        run_step.timed_steps(step, (None, None), 5, torch.device("cpu"))
    assert len(calls) == 2


def test_first_call_timer_checks_the_flags():
    step, _ = _flagging_step({1})
    with pytest.raises(ValueError, match=r"^targets: expected values in \[0, V\)"):
        run_step.FirstCallTimer(step)(None, None)


def test_compiled_step_refuses_an_out_of_range_target_before_the_update():
    """Compiled (our passes: the fused loss and the fused AdamW), a batch with a target = V raises a
    ValueError naming targets and leaves parameters and optimizer moments untouched; ignore_index
    (-100) is still accepted, and training goes on with good targets."""
    import torch
    import torch.nn.functional as F

    import compile_stack
    from compile_stack.config import PRESETS
    from compile_stack.reference import AdamW, build_model
    from passes import registry

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    torch._dynamo.reset()
    registry.REPORT.clear()
    cfg = PRESETS["tiny"]
    model = build_model(cfg, "cpu", torch.float32)
    optimizer = AdamW(model.parameters())
    step = run_step.FirstCallTimer(compile_stack.compile_step(run_step.make_train_step(model, loss_fn, optimizer),
                                                              codegen=False))
    inputs = torch.randint(cfg.vocab, (cfg.batch, cfg.seq))
    good = torch.randint(cfg.vocab, (cfg.batch, cfg.seq))
    good[0, :5] = -100
    assert torch.isfinite(step(inputs, good))
    assert registry.REPORT.replacements["cross_entropy"] == 1 and registry.REPORT.replacements["adamw"] == 1

    def state():
        return [t.detach().clone() for t in (*model.parameters(), *optimizer.m, *optimizer.v)]

    before = state()
    bad = good.clone()
    bad[1, 7] = cfg.vocab
    with pytest.raises(ValueError, match=r"^targets: expected values in \[0, V\)"):
        run_step.timed_steps(step, (inputs, bad), 3, torch.device("cpu"))
    after = state()
    assert all(torch.equal(a, b) and torch.isfinite(a).all() for a, b in zip(after, before))
    run_step.timed_steps(step, (inputs, good), 1, torch.device("cpu"))  # nothing left flagged
    assert not torch.equal(next(model.parameters()), before[0])
    assert all(torch.isfinite(t).all() for t in state())
