"""Any model's step over 2 processes (gloo on the CPU, NCCL on GPUs) against the single-process eager step.

One spawn runs every case: each model sharded with FSDP2 (by ``compile_stack.shard`` or by the user's
own ``fully_shard`` calls), its step compiled by ``compile_step``, STEPS steps on each rank's half of a
new batch; then the full parameters and optimizer state gathered, and a checkpoint's round trip
(torch.distributed.checkpoint) resuming the last step. The single-process eager steps on the full
batch run afterwards, shared out between the two processes.
"""
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.autograd import DeviceType
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import compile_stack
from compile_stack import caches
from compile_stack import distributed as D
from compile_stack.harness.check import TOLERANCES
from compile_stack.harness.profiling import device_intervals, interval_overlap, profile_overlap
from compile_stack.harness.stock import StockStep
from compile_stack.harness.user_code import make_train_step
from compile_stack.workloads import reference
from compile_stack.workloads.config import PRESETS
from tests import user_models
from tests.helpers import HAS_CUDA, rel_err

WORLD = 2
STEPS = 3
CFG = PRESETS["tiny"].with_overrides(batch=4, seq=32)
STOCK = "stock"  # the stock step (blocks through aot_eager), sharded vs in one process


def _reference(cfg):
    return reference.Transformer(cfg)


def _user(factory):
    return lambda cfg: factory(vocab_size=cfg.vocab, context_length=cfg.seq, d_model=cfg.d_model,
                               num_layers=cfg.layers, num_heads=cfg.heads, d_ff=cfg.d_ff)


# name: (build, build in one process, loss, optimizer, shard with compile_stack.shard, round trip)
CASES = {
    "reference": (_reference, _reference, reference.cross_entropy, reference.AdamW, True, False),
    "gpt": (_user(user_models.build_gpt), _user(user_models.build_gpt), user_models.token_loss,
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), True, True),
    "einops": (_user(user_models.build_einops_lm), _user(user_models.build_einops_lm), user_models.einops_loss,
               lambda ps: user_models.MyAdamW(ps, lr=1e-2), True, True),
    "own_fully_shard": (_user(user_models.build_sharded_gpt), _user(user_models.build_gpt), user_models.token_loss,
                        lambda ps: torch.optim.AdamW(ps, lr=1e-2), False, False),
}
GPU_CONFIG = PRESETS["tiny"].with_overrides(layers=2, seq=1024, d_model=1024, heads=8, d_ff=2816, vocab=32000)


def _batches(cfg, device):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=g).to(device) for _ in range(2))
            for _ in range(STEPS)]


def _to_cpu(tensors):
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone() for n, t in tensors.items()}


def _optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Each parameter's moments by '<name>.<key>', gathered whole (a collective)."""
    names = {id(p): n for n, p in model.named_parameters()}
    if isinstance(optimizer, reference.AdamW):
        entries = {names[id(p)]: {"m": m, "v": v} for p, m, v in zip(optimizer.params, optimizer.m, optimizer.v)}
    else:
        entries = {names[id(p)]: state for p, state in optimizer.state.items()}
    return _to_cpu({f"{n}.{k}": t for n, state in entries.items() for k, t in state.items()
                    if isinstance(t, torch.Tensor) and t.dim() > 0})


def _sharded_run(name, cfg, device, rank, ckpt_dir, codegen) -> dict:
    """Case ``name`` sharded over the ranks through ``compile_step``, each rank on its half of each batch."""
    from passes import registry

    build, _, loss_fn, make_optimizer, shard, round_trip = CASES[name]
    torch._dynamo.reset()
    registry.current().clear()
    torch.manual_seed(0)
    with torch.device(device):
        model = build(cfg)
    if shard:
        compile_stack.shard(model)
    optimizer = make_optimizer(model.parameters())
    step = compile_stack.compile_step(make_train_step(model, loss_fn, optimizer), codegen=codegen)
    batches = [tuple(D.shard_batch(t, rank, WORLD) for t in batch) for batch in _batches(cfg, device)]
    losses = [D.mean_over_ranks(step(*batch)).item() for batch in batches[:-1]]
    if round_trip:  # a checkpoint before the last step, loaded back after it: the last step again
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=ckpt_dir)
    losses.append(D.mean_over_ranks(step(*batches[-1])).item())
    out = {"losses": losses, "params": _to_cpu(dict(model.named_parameters())),
           "state": _optimizer_state(model, optimizer), "passes": dict(registry.current().replacements),
           "notes": list(registry.current().notes), "sharded_numel": sum(
               p.to_local().numel() for p in model.parameters()), "numel": sum(p.numel() for p in model.parameters())}
    if round_trip:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # the checkpoint must bring every value back
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out["resumed_loss"] = D.mean_over_ranks(step(*batches[-1])).item()
        out["resumed_params"] = _to_cpu(dict(model.named_parameters()))
    if device.type == "cuda":
        out["overlap"] = profile_overlap(lambda: step(*batches[0]))
    return out


def _single_run(name, cfg, device) -> dict:
    """Case ``name`` in one process, eager, on the full batches."""
    _, build, loss_fn, make_optimizer, _, _ = CASES[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = build(cfg)
    init = _to_cpu(dict(model.named_parameters()))
    optimizer = make_optimizer(model.parameters())
    step = make_train_step(model, loss_fn, optimizer)
    losses = [step(x, y).item() for x, y in _batches(cfg, device)]
    return {"init": init, "losses": losses, "params": _to_cpu(dict(model.named_parameters())),
            "state": _optimizer_state(model, optimizer)}


def _stock_run(cfg, device, shard=None) -> dict:
    """The stock step: sharded over the ranks if ``shard`` splits the batch."""
    torch.manual_seed(0)
    step = StockStep(reference.build_model(cfg, device, torch.float32), sharded=shard is not None, backend="aot_eager")
    shard = shard or (lambda t: t)
    losses = [step(shard(x), shard(y)).item() for x, y in _batches(cfg, device)]
    return {"losses": losses, "params": _to_cpu(dict(step.loss.named_parameters()))}


def _worker(rank, port, out_dir, cfg, cases, codegen):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # one core per rank, as torchrun sets it
    caches.use_cache_dir(os.path.join(out_dir, f"cache{rank}"))
    rank, world, device = D.setup_distributed()
    out = {"dist": {name: _sharded_run(name, cfg, device, rank, os.path.join(out_dir, f"ckpt_{name}"), codegen)
                    for name in cases}, "single": {}}
    if device.type == "cpu":
        out["dist"][STOCK] = _stock_run(cfg, device, shard=lambda t: D.shard_batch(t, rank, world))
    for i, name in enumerate([*cases, STOCK] if device.type == "cpu" else cases):
        if i % world == rank:  # the single-process references, shared out between the ranks
            out["single"][name] = _stock_run(cfg, device) if name == STOCK else _single_run(name, cfg, device)
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
    return _spawn(tmp_path_factory.mktemp("dist"), CFG, list(CASES), codegen=False)


def _global_rel(a: dict, b: dict) -> float:
    num = sum(((a[n].double() - b[n].double()) ** 2).sum() for n in b)
    return float((num / sum((t.double() ** 2).sum() for t in b.values())).sqrt())


def _check_matches(run, name, loss_tol, tol):
    d, s = run["dist"][name], run["single"][name]
    assert d["params"].keys() == s["params"].keys()
    for ld, ls in zip(d["losses"], s["losses"], strict=True):
        assert abs(ld - ls) / abs(ls) <= loss_tol, (d["losses"], s["losses"])
    assert _global_rel(d["params"], s["params"]) <= tol
    return d


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_compiled_step_matches_single_process_eager(cpu_run, name):
    """Loss, every gathered parameter and optimizer moment after STEPS steps on new batches."""
    d = _check_matches(cpu_run, name, loss_tol=1e-5, tol=1e-5)
    s = cpu_run["single"][name]
    assert _global_rel(s["params"], s["init"]) > 1e-3  # the steps moved the weights
    for n, p in s["params"].items():
        assert rel_err(d["params"][n], p) <= 1e-4, n
    assert d["state"].keys() == s["state"].keys() and d["state"]
    for n, t in s["state"].items():
        assert rel_err(d["state"][n], t) <= 1e-4, n


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_gets_every_pass(cpu_run, name):
    """Attention replaced in each block, the LM head and loss fused into one cross-entropy, the update fused,
    on every rank; the optimizer steps its local shards, and the parameters are sharded."""
    for r in cpu_run["ranks"]:
        d = r["dist"][name]
        assert d["passes"]["attention"] == CFG.layers, d["notes"]
        assert d["passes"]["cross_entropy"] == 1, d["notes"]
        assert d["passes"]["adamw"] >= 1, d["notes"]
        assert any("steps the local shards" in n for n in d["notes"]), d["notes"]
        assert d["sharded_numel"] < d["numel"] * 0.6


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case[5]])
def test_checkpoint_round_trip_resumes_the_step(cpu_run, name):
    """torch.distributed.checkpoint of the model and optimizer before the last step, loaded back: the
    last step again gives the uninterrupted run's parameters."""
    d = cpu_run["dist"][name]
    assert d["resumed_loss"] == pytest.approx(d["losses"][-1], rel=1e-6)
    for n, p in d["params"].items():
        assert rel_err(d["resumed_params"][n], p) <= 1e-6, n


def test_stock_step_sharded_matches_single_process(cpu_run):
    """`--compare stock` under torchrun: the stock step, sharded by FSDP2, steps as in one process."""
    _check_matches(cpu_run, STOCK, loss_tol=1e-5, tol=1e-5)


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
        compile_stack.shard(user_models.build_gpt(16, 8, 8, 2, 2, 16))
    with pytest.raises(ValueError, match="model: expected a torch.nn.Module"):
        compile_stack.shard(lambda x: x)


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
    run = _spawn(tmp_path, GPU_CONFIG, ["reference"], codegen=True)
    _check_matches(run, "reference", TOLERANCES["loss_rel_err"], TOLERANCES["param_rel_err"])
    overlap = run["dist"]["reference"]["overlap"]
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
    assert summary["passes"]["attention"] == PRESETS["tiny"].layers and summary["passes"]["cross_entropy"] == 1
    assert summary["passes"]["adamw"] == 1
    stock = summary["compare"]["stock"]
    assert stock["world_size"] == 2 and len(stock["peak_mem_gib_per_rank"]) == 2
    assert summary["compare"]["speedup"] == pytest.approx(stock["step_ms"] / summary["step_ms"], rel=1e-2)
