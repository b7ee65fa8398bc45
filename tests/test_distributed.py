"""Data parallel over 2 processes (gloo on the CPU, NCCL on GPUs) against the single-process step.

One spawn runs every case: the sharded step for 2 steps on each rank's half
of the batch, then the full parameters gathered; the single-process steps on
the full batch run afterwards, split across the two processes.
"""
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.autograd import DeviceType

from compile_stack import caches
from compile_stack import distributed as D
from compile_stack.workloads import reference_fsdp
from compile_stack.harness.check import TOLERANCES
from compile_stack.harness.profiling import device_intervals, interval_overlap, profile_overlap
from compile_stack.workloads.config import PRESETS
from compile_stack.workloads.reference import AdamW, build_model
import compile_stack
from compile_stack.workloads.reference import cross_entropy
from compile_stack.capture.step import StepOptions
from compile_stack.harness.user_code import make_train_step
from compile_stack.harness.stock import StockStep
from tests import user_models
from tests.helpers import HAS_CUDA, rel_err

WORLD = 2
STEPS = 2
# name: (dtype, compiled)
CPU_CASES = {"fp32_compiled": (torch.float32, True), "bf16_compiled": (torch.bfloat16, True),
             "fp32_eager": (torch.float32, False)}
GPU_CASES = {"bf16_compiled": (torch.bfloat16, True)}
STOCK = "stock_fp32"  # the stock step (blocks through aot_eager), sharded vs in one process
USER = "user_fp32"  # a user's GPT, loss and torch.optim.AdamW through compile_step, sharded by the user's FSDP2
# torch 2.11's FSDP2 skips its gather's version-counter guard while torch.compiler.is_compiling(), which
# holds for its backward hooks when backward() runs on the thread of a compiled frame: the CPU's case
# (a CUDA backward runs on the engine's device threads). The user's sharded step then fails its
# backward on the CPU ("modified by an inplace operation"), under stock torch.compile as well; 2.13 has
# no such guard.
USER_ON_CPU = torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)
GPU_CONFIG = PRESETS["tiny"].with_overrides(layers=2, seq=1024, d_model=1024, heads=8, d_ff=2816, vocab=32000)


def _batches(cfg, device):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=g).to(device) for _ in range(2))
            for _ in range(STEPS)]


def _model(cfg, dtype, device):
    torch.manual_seed(0)
    return build_model(cfg, device, dtype)


def _user_run(cfg, device, shard=None) -> dict:
    """A user's own step through ``compile_step`` for STEPS steps: the model sharded with FSDP2 (a
    group per block, then the root) and each rank on its share of the batch if ``shard`` is given."""
    from passes import registry

    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    model = user_models.build_gpt(vocab_size=cfg.vocab, context_length=cfg.seq, d_model=cfg.d_model,
                                  num_layers=cfg.layers, num_heads=cfg.heads, d_ff=cfg.d_ff).to(device)
    init = _to_cpu(dict(model.named_parameters()))
    if shard is not None:
        D.shard_blocks(model)
    step = compile_stack.compile_step(make_train_step(model, user_models.token_loss, torch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1)), codegen=False)
    if shard is None:
        losses = [step(x, y).item() for x, y in _batches(cfg, device)]
    else:  # each rank's mean over its share; their mean is the batch's
        losses = [D.mean_over_ranks(step(shard(x), shard(y))).item() for x, y in _batches(cfg, device)]
    return {"init": init, "losses": losses, "params": _to_cpu(D.full_params(model)),
            "passes": dict(registry.current().replacements), "notes": list(registry.current().notes)}


def _to_cpu(params):
    return {n: p.detach().cpu().clone() for n, p in params.items()}


def _stock_run(cfg, device, shard=None) -> dict:
    """The stock step for STEPS steps: sharded over the ranks if ``shard`` splits the batch."""
    step = StockStep(_model(cfg, torch.float32, device), sharded=shard is not None, backend="aot_eager")
    init = _to_cpu(dict(step.loss.named_parameters())) if shard is None else None
    shard = shard or (lambda t: t)
    losses = [step(shard(x), shard(y)).item() for x, y in _batches(cfg, device)]
    return {"init": init, "losses": losses, "params": _to_cpu(D.full_params(step.loss))}


def _worker(rank, port, out_dir, cfg, cases, codegen):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    from passes import registry

    torch.set_num_threads(1)  # one core per rank, as torchrun sets it
    caches.use_cache_dir(os.path.join(out_dir, f"cache{rank}"))
    rank, world, device = D.setup_distributed()
    out = {"dist": {}, "single": {}}
    for name, (dtype, compiled) in cases.items():
        model = _model(cfg, dtype, device)
        step = reference_fsdp.DistributedTrainStep(model, AdamW, StepOptions(codegen=codegen) if compiled else None)
        losses = [step(D.shard_batch(x, rank, world), D.shard_batch(y, rank, world)).item()
                  for x, y in _batches(cfg, device)]
        out["dist"][name] = {
            "losses": losses,
            "params": _to_cpu(reference_fsdp.gather_full_params(step)),
            "local_numel": sum(t.numel() for t in step.shards.tensors),
            "state_numel": sum(m.numel() + v.numel() for m, v in zip(step.optimizer.m, step.optimizer.v)),
            "graphs": step.backend.graphs if step.backend else None,
        }
        if device.type == "cuda":
            out["dist"][name]["overlap"] = profile_overlap(
                lambda: step(*(D.shard_batch(t, rank, world) for t in _batches(cfg, device)[0])))
    out["passes"] = dict(registry.current().replacements)
    if device.type == "cpu":
        out["dist"][STOCK] = _stock_run(cfg, device, shard=lambda t: D.shard_batch(t, rank, world))
        if USER_ON_CPU:
            out["dist"][USER] = _user_run(cfg, device, shard=lambda t: D.shard_batch(t, rank, world))
    # The single-process references, shared out between the ranks.
    for i, (name, (dtype, compiled)) in enumerate(cases.items()):
        if i % world != rank:
            continue
        model = _model(cfg, dtype, device)
        out["single"][name] = {"init": _to_cpu(dict(model.named_parameters()))}
        step = make_train_step(model, cross_entropy, AdamW(model.parameters()))
        step = compile_stack.compile_step(step, codegen=codegen) if compiled else step
        out["single"][name]["losses"] = [step(x, y).item() for x, y in _batches(cfg, device)]
        out["single"][name]["params"] = _to_cpu(dict(model.named_parameters()))
    if device.type == "cpu" and len(cases) % world == rank:
        out["single"][STOCK] = _stock_run(cfg, device)
    if device.type == "cpu" and USER_ON_CPU and (len(cases) + 1) % world == rank:
        out["single"][USER] = _user_run(cfg, device)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, cfg, cases, codegen) -> dict:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), cfg, cases, codegen), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    single = {k: v for r in ranks for k, v in r["single"].items()}
    return {"ranks": ranks, "dist": ranks[0]["dist"], "single": single}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("dist"), PRESETS["tiny"], CPU_CASES, codegen=False)


def _global_rel(a: dict, b: dict) -> float:
    num = sum(((a[n].double() - b[n].double()) ** 2).sum() for n in b)
    return float((num / sum((t.double() ** 2).sum() for t in b.values())).sqrt())


def _check_matches(run, name, loss_tol, param_tol):
    d, s = run["dist"][name], run["single"][name]
    assert d["params"].keys() == s["params"].keys()
    # The step moved the weights, so agreeing after it means something.
    assert _global_rel(s["params"], s["init"]) > 1e-4
    for ld, ls in zip(d["losses"], s["losses"], strict=True):
        assert abs(ld - ls) / abs(ls) <= loss_tol, (d["losses"], s["losses"])
    assert _global_rel(d["params"], s["params"]) <= param_tol
    return d


@pytest.mark.parametrize("name", ["fp32_compiled", "fp32_eager"])
def test_fp32_matches_single_process(cpu_run, name):
    d = _check_matches(cpu_run, name, loss_tol=1e-5, param_tol=1e-5)
    for n, p in cpu_run["single"][name]["params"].items():
        assert rel_err(d["params"][n], p) <= 1e-5, n


def test_stock_step_sharded_matches_single_process(cpu_run):
    """`--compare stock` under torchrun: the stock step, sharded by FSDP2, steps as in one process."""
    _check_matches(cpu_run, STOCK, loss_tol=1e-5, param_tol=1e-5)


@pytest.mark.skipif(not USER_ON_CPU, reason="torch 2.11's FSDP2 fails a compiled step's backward on the CPU")
def test_a_users_step_sharded_by_fsdp2_matches_single_process(cpu_run):
    """A user's own model, loss and torch.optim.AdamW, the model sharded with FSDP2's fully_shard,
    through ``compile_step``: it steps as in one process and its update is fused (the gradient
    shards' sizes reach the pass as symbols). FSDP2's hooks around the model's call put the LM head
    and the loss in different graphs: the loss is left unfused, and the report says so."""
    _check_matches(cpu_run, USER, loss_tol=1e-5, param_tol=1e-5)
    single = cpu_run["single"][USER]["passes"]
    assert (single["attention"], single["cross_entropy"], single["adamw"]) == (PRESETS["tiny"].layers, 1, 1)
    for r in cpu_run["ranks"]:
        sharded = r["dist"][USER]
        assert sharded["passes"]["adamw"] == 1 and sharded["passes"]["attention"] >= 1, sharded["notes"]
        assert sharded["passes"]["cross_entropy"] == 0
        assert any("its logits come from another graph" in n for n in sharded["notes"]), sharded["notes"]


def test_bf16_matches_single_process(cpu_run):
    _check_matches(cpu_run, "bf16_compiled", TOLERANCES["loss_rel_err"], TOLERANCES["param_rel_err"])


def test_parameters_and_states_are_sharded(cpu_run):
    total = PRESETS["tiny"].params
    for r in cpu_run["ranks"]:
        case = r["dist"]["fp32_compiled"]
        assert case["local_numel"] == total // WORLD
        assert case["state_numel"] == 2 * total // WORLD
    assert sum(p.numel() for p in cpu_run["dist"]["fp32_compiled"]["params"].values()) == total


def test_compiled_step_applies_every_pass_with_one_block_graph(cpu_run):
    from passes import registry

    # Every pass that has something to find in the reference step: it has no QR or Newton–Schulz.
    expected = set(registry.pass_names()) - {"linalg_qr", "newton_schulz"}
    for r in cpu_run["ranks"]:
        assert {name for name in registry.pass_names() if r["passes"].get(name, 0) > 0} == expected
    # The embedding, ONE graph for every block (no recompile per block), the head with the loss.
    assert cpu_run["dist"]["fp32_compiled"]["graphs"] == 3


def test_shard_batch():
    x = torch.arange(12).view(4, 3)
    assert torch.equal(D.shard_batch(x, 1, 2), x[2:])
    with pytest.raises(ValueError, match="tensor: expected a batch dimension divisible by the world size 3"):
        D.shard_batch(x, 0, 3)


def test_bad_setup_raises(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="environment: expected torchrun's variables"):
        D.setup_distributed()
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="model: expected a process group"):
        reference_fsdp.shard_model(_model(PRESETS["tiny"], torch.float32, "cpu"))
    with pytest.raises(ValueError, match="model: expected a compile_stack.workloads.reference.Transformer"):
        reference_fsdp.shard_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="step_or_model: expected a DistributedTrainStep"):
        reference_fsdp.gather_full_params(torch.nn.Linear(2, 2))


def test_interval_overlap():
    # comm [0,4) ∪ [3,6) = [0,6); compute [1,2) ∪ [5,9): hidden 1 + 1 = 2, exposed 4.
    stats = interval_overlap([(3, 6), (0, 4)], [(5, 9), (1, 2)])
    assert stats == {"comm": 6, "compute": 5, "hidden_comm": 2, "exposed_comm": 4, "hidden_fraction": 2 / 6}
    assert interval_overlap([], [(0, 1)])["hidden_fraction"] is None
    assert interval_overlap([(0, 2)], [(0, 1), (1, 2)])["exposed_comm"] == 0


def test_device_intervals_leave_annotation_spans_out():
    """FSDP's span around its all-gather is not compute hiding the collective; CPU ops don't count."""
    def event(name, start, end, device_type=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device_type, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [
        event("FSDP::all_gather", 0, 10, annotation=True),
        event("nccl:_all_gather_base", 2, 10, annotation=True),
        event("ncclDevKernel_AllGather_RING_LL", 2, 10),
        event("triton_poi_fused_mul_silu_1", 0, 4),
        event("aten::mm", 0, 10, device_type=DeviceType.CPU),
        event("Memset (Device)", 5, 5),
    ]
    comm, compute = device_intervals(events)
    assert comm == [(2, 10)] and compute == [(0, 4)]
    assert interval_overlap(comm, compute)["exposed_comm"] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")
def test_two_gpus_bf16_matches_single_process_and_overlaps(tmp_path):
    run = _spawn(tmp_path, GPU_CONFIG, GPU_CASES, codegen=True)
    _check_matches(run, "bf16_compiled", TOLERANCES["loss_rel_err"], TOLERANCES["param_rel_err"])
    overlap = run["dist"]["bf16_compiled"]["overlap"]
    assert overlap["comm_ms"] > 0 and overlap["compute_ms"] > 0
    assert 0 <= overlap["hidden_fraction"] <= 1


@pytest.mark.slow
def test_torchrun_run_step_two_processes(tmp_path):
    """The README's command: `torchrun --nproc-per-node 2 run_step.py --compile` (gloo, tiny), with the
    stock step sharded beside it (`--compare stock`)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "run_step.py", "--compile",
           "--steps", "1", "--warmup", "0", "--compare", "stock", "--cache-dir", str(tmp_path / "cache"),
           "--json", str(out)]
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["world_size"] == 2 and len(summary["step_ms_per_rank"]) == 2
    assert summary["passes"]["attention"] == 1 and summary["passes"]["cross_entropy"] == 1
    assert summary["passes"]["adamw"] == 1
    stock = summary["compare"]["stock"]
    assert stock["world_size"] == 2 and len(stock["peak_mem_gib_per_rank"]) == 2
    assert summary["compare"]["speedup"] == pytest.approx(stock["step_ms"] / summary["step_ms"], rel=1e-2)
