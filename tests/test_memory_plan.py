"""The memory plan: what AOTAutograd's partitioner saves under our budget, and our estimate of it."""
import os
import subprocess
import sys

import pytest
import torch

from compile_stack.memory_plan.estimate import saved_bytes_per_token
from compile_stack.backend import PassBackend
from compile_stack.workloads.config import PRESETS, ModelConfig
import compile_stack
from compile_stack.workloads.reference import AdamW, Block, RotaryEmbedding, build_model, cross_entropy
from compile_stack.harness.user_code import make_train_step

# Block proportions of the full preset (d_ff ≈ 2.7·d, head dim 64), small enough for the CPU; two
# blocks, so that they compile as one block graph between the embedding and the head.
CFG = ModelConfig(layers=2, seq=64, batch=2, d_model=128, heads=2, d_ff=344, vocab=256)
OUR_FORWARD_OPS = ("flash_attention_fwd", "linear_cross_entropy_fwd")


def _activation_bytes(fwd: torch.fx.GraphModule, skip_outputs: int = 0) -> int:
    """Bytes of the tensors a partitioned forward returns after its first ``skip_outputs``:
    what it computed, plus its first input (the block's input x); other inputs are weights."""
    placeholders = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    out = next(n for n in fwd.graph.nodes if n.op == "output").args[0][skip_outputs:]
    saved = [a for a in out if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    return sum(a.meta["val"].nbytes for a in saved if a.op != "placeholder" or a is placeholders[0])


def _partition_at(budget: float) -> tuple[dict, float]:
    """Compile one step at ``budget``; per graph (the embedding, the block, head + loss, in the order
    they are compiled): activation bytes saved, ops recomputed."""
    partition = torch._functorch.partitioners.min_cut_rematerialization_partition
    graphs = {}

    def spy(joint, inputs, **kw):
        fwd, bwd = partition(joint, inputs, **kw)
        nbytes = _activation_bytes(fwd)
        recomputed = sorted({op for n in bwd.graph.nodes for op in OUR_FORWARD_OPS if op in str(n.target)})
        graphs[len(graphs)] = {"saved_bytes": nbytes, "recomputed": recomputed}
        return fwd, bwd

    torch.compiler.reset()
    torch.manual_seed(0)
    model = build_model(CFG, "cpu", torch.float32)
    ids = torch.randint(CFG.vocab, (CFG.batch, CFG.seq))
    step = compile_stack.compile_step(make_train_step(model, cross_entropy, AdamW(model.parameters())),
                                      memory_budget=budget, codegen=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("compile_stack.backend.aten_graphs.min_cut_rematerialization_partition", spy)
        loss = step(ids, ids).item()
    return graphs, loss


@pytest.fixture(scope="module")
def plans():
    return {budget: _partition_at(budget) for budget in (0.0, 0.1, 0.3, 1.0)}


def test_budget_changes_what_the_block_saves_not_the_loss(plans):
    block = {b: graphs[1]["saved_bytes"] for b, (graphs, _) in plans.items()}  # graph 0 is the embedding
    assert block[0.0] < block[0.3] < block[1.0]
    losses = [loss for _, loss in plans.values()]
    assert losses == pytest.approx([losses[0]] * len(losses), rel=1e-6)


def test_our_ops_are_never_recomputed_at_any_budget(plans):
    """Attention's output and the fused cross-entropy's gradients are marked must-save."""
    for budget, (graphs, _) in plans.items():
        assert [g["recomputed"] for g in graphs.values()] == [[], [], []], budget


def test_estimate_is_at_or_above_what_the_partitioner_saves(plans):
    for budget, (graphs, _) in plans.items():
        estimate = CFG.tokens * saved_bytes_per_token(CFG, budget, nbytes=4)
        assert graphs[1]["saved_bytes"] <= estimate, budget
    # And not far above at the floor: block input, attention output and log-sum-exp.
    floor = plans[0.0][0][1]["saved_bytes"]
    assert floor <= CFG.tokens * saved_bytes_per_token(CFG, 0.0, nbytes=4) <= 1.5 * floor


class _Partitioned(Exception):
    """Raised by the spy once the partition is known: the full-width block never runs."""


@pytest.mark.parametrize("budget", [0.15, 0.46, 0.97])
def test_measured_plans_match_the_partitioner_at_full_width(budget):
    """The full preset's block, one sequence, compiled but not run, saves what the looked-up
    plan says, up to the norms' statistics."""
    cfg = PRESETS["full"].with_overrides(layers=1, batch=1)
    with torch.device("meta"):
        block = Block(cfg).to(torch.bfloat16)
    block = block.to_empty(device="cpu")  # uninitialized weights: only the graphs matter here
    rope = RotaryEmbedding(cfg.head_dim, cfg.seq)
    block.attn.rope.cos.copy_(rope.cos), block.attn.rope.sin.copy_(rope.sin)
    partition = torch._functorch.partitioners.min_cut_rematerialization_partition
    saved = []

    def spy(joint, inputs, **kw):
        fwd, _ = partition(joint, inputs, **kw)
        saved.append(_activation_bytes(fwd, skip_outputs=1))  # after the block's own output
        raise _Partitioned

    torch.compiler.reset()
    backend = PassBackend(memory_budget=budget, codegen=False)
    x = torch.zeros(1, cfg.seq, cfg.d_model, dtype=torch.bfloat16, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp, backend.active(), pytest.raises(Exception, match="_Partitioned"):
        mp.setattr("compile_stack.backend.aten_graphs.min_cut_rematerialization_partition", spy)
        torch.compile(block, backend=backend, fullgraph=True)(x)
    estimate = saved_bytes_per_token(cfg, budget)
    assert saved[0] / cfg.tokens <= estimate <= saved[0] / cfg.tokens + 2 * 4


@pytest.mark.parametrize("users_setting, expected", [
    (None, "expandable_segments:True"),
    ("expandable_segments:False", "expandable_segments:False"),
])
def test_importing_the_package_turns_on_expandable_segments_unless_the_user_chose(users_setting, expected):
    """The plan fills the device to within 5%, which needs the allocator's expandable segments:
    a user's own script gets them from the import, as run_step does; a setting of theirs stays."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if users_setting is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = users_setting
    probe = "import os, compile_stack; print(os.environ['PYTORCH_CUDA_ALLOC_CONF'])"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
