"""The memory plan: what AOTAutograd's partitioner saves under our budget, and our estimate of it."""
import pytest
import torch

from compile_stack import memory
from compile_stack.config import ModelConfig
from compile_stack.reference import AdamW, build_model
from compile_stack.step import StepOptions, TrainStep

# Block proportions of the full preset (d_ff ≈ 2.7·d, head dim 64), small enough for the CPU.
CFG = ModelConfig(layers=1, seq=64, batch=2, d_model=128, heads=2, d_ff=344, vocab=256)
OUR_FORWARD_OPS = ("flash_attention_fwd", "linear_cross_entropy_fwd")


def _partition_at(budget: float) -> tuple[dict, float]:
    """Compile one regional step at ``budget``; per graph: activation bytes saved, ops recomputed."""
    partition = torch._functorch.partitioners.min_cut_rematerialization_partition
    graphs = {}

    def spy(joint, inputs, **kw):
        fwd, bwd = partition(joint, inputs, **kw)
        placeholders = [n for n in fwd.graph.nodes if n.op == "placeholder"]
        out = next(n for n in fwd.graph.nodes if n.op == "output").args[0]
        saved = [a for a in out if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        # Activations: what the forward computed, plus its first input (the block's input x).
        nbytes = sum(a.meta["val"].nbytes for a in saved if a.op != "placeholder" or a is placeholders[0])
        recomputed = sorted({op for n in bwd.graph.nodes for op in OUR_FORWARD_OPS if op in str(n.target)})
        graphs[len(graphs)] = {"saved_bytes": nbytes, "recomputed": recomputed}
        return fwd, bwd

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model(CFG, "cpu", torch.float32)
    ids = torch.randint(CFG.vocab, (CFG.batch, CFG.seq))
    options = StepOptions(compile=True, memory_budget=budget, codegen=False, regional=True)
    step = TrainStep(model, AdamW(model.parameters()), options)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("compile_stack.capture.min_cut_rematerialization_partition", spy)
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
        estimate = CFG.tokens * memory.saved_bytes_per_token(CFG, budget, nbytes=4)
        assert graphs[1]["saved_bytes"] <= estimate, budget
    # And not far above at the floor: block input, attention output and log-sum-exp.
    floor = plans[0.0][0][1]["saved_bytes"]
    assert floor <= CFG.tokens * memory.saved_bytes_per_token(CFG, 0.0, nbytes=4) <= 1.5 * floor
