"""cstack::fused_adamw_: float64 references, torch.optim.AdamW, opcheck, compile, bad input, Triton paths."""
import math

import pytest
import torch

from custom_ops import adamw
from custom_ops.adamw import fused_adamw
from tests.helpers import HAS_CUDA

ODD_SHAPES = [(1,), (37,), (5, 13), (64, 33)]
# Interpreter-sized: a handful of 16-element blocks, most with a partial tail.
TINY_SHAPES = [(1,), (37,), (5, 13)]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (param, grad, exp_avg, exp_avg_sq) storage dtypes
DTYPES = {
    "fp32": (FP32, FP32, FP32, FP32),
    "bf16": (BF16, BF16, BF16, BF16),
    "mixed": (FP32, BF16, BF16, FP32),
}


def reference_step(p, g, m, v, *, lr, t, beta1, beta2, eps, weight_decay, torch_semantics):
    """One AdamW step in float64 (docs/reference.md §2, or torch.optim.AdamW's eps placement)."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    if torch_semantics:
        p = p - lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps)
    else:
        p = p - lr * math.sqrt(bc2) / bc1 * m / (v.sqrt() + eps)
    return p, m, v


def make_state(shapes, dtypes, device="cpu", grad_scale=1.0, zero_moments=False):
    """Params ~0.1·N(0,1) (so an lr-sized update spans many bf16 ulps), grads, random or zero moments.

    Zero moments (a first step) make m and v exactly (1−β)·g and (1−β₂)·g², which shows any error in 1 − β."""
    pd, gd, md, vd = dtypes
    moment_scale = 0.0 if zero_moments else 1.0
    params = [(0.1 * torch.randn(s)).to(device, pd) for s in shapes]
    grads = [(grad_scale * torch.randn(s)).to(device, gd) for s in shapes]
    exp_avgs = [(moment_scale * grad_scale * 0.3 * torch.randn(s)).to(device, md) for s in shapes]
    exp_avg_sqs = [(moment_scale * grad_scale**2 * torch.rand(s)).to(device, vd) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def assert_rounded_once(actual, expected64):
    """Within one storage ulp of the float64 result (rounded once), plus fp32 math noise at the tensor's scale."""
    rtol = {FP32: 4 * 2**-24, BF16: 2**-7, FP16: 2**-10}[actual.dtype]
    atol = 4 * 2**-24 * expected64.abs().max().item()
    torch.testing.assert_close(actual.double().cpu(), expected64.cpu(), rtol=rtol, atol=atol)


def check_steps(step_fn, shapes, dtypes, *, device="cpu", steps=3, lr=0.05, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, torch_semantics=False, grad_scale=1.0, zero_moments=False):
    """Run ``steps`` updates; after each, compare with the float64 step from the state before it."""
    state = make_state(shapes, dtypes, device, grad_scale, zero_moments)
    for t in range(1, steps + 1):
        before = [[x.clone() for x in seq] for seq in state]
        step_fn(*state, lr=lr, t=t, betas=betas, eps=eps, weight_decay=weight_decay,
                torch_semantics=torch_semantics)
        for i in range(len(shapes)):
            expected = reference_step(*(seq[i] for seq in before), lr=lr, t=t, beta1=betas[0], beta2=betas[1],
                                      eps=eps, weight_decay=weight_decay, torch_semantics=torch_semantics)
            for seq, exp in zip((state[0], state[2], state[3]), expected):
                assert_rounded_once(seq[i], exp)
        state[1][:] = [torch.randn_like(g) * grad_scale for g in state[1]]


def op_step(params, grads, exp_avgs, exp_avg_sqs, *, lr, t, betas, eps, weight_decay, torch_semantics):
    fused_adamw(params, grads, exp_avgs, exp_avg_sqs, lr=lr, step=t, betas=betas, eps=eps,
                weight_decay=weight_decay, torch_semantics=torch_semantics)


def triton_step(params, grads, exp_avgs, exp_avg_sqs, *, lr, t, betas, eps, weight_decay, torch_semantics):
    """The Triton kernel with a tiny block, so tensors span several blocks with partial tails."""
    adamw._triton_step(params, grads, exp_avgs, exp_avg_sqs, torch.tensor(lr), torch.tensor(float(t)),
                       betas[0], betas[1], eps, weight_decay, torch_semantics, block=16, num_warps=1)


# eps=1e-3 with grads ~1e-3: eps dominates √v, so the two eps placements differ by ~2× in the update.
CASES = {
    "plain": dict(eps=1e-8, weight_decay=0.0, grad_scale=1.0),
    "decay": dict(eps=1e-8, weight_decay=0.1, grad_scale=1.0),
    "big_eps": dict(eps=1e-3, weight_decay=0.1, grad_scale=1e-3),
}


@pytest.mark.parametrize("torch_semantics", [False, True])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_cpu_matches_float64_reference(dtypes, case, torch_semantics):
    check_steps(op_step, ODD_SHAPES, DTYPES[dtypes], torch_semantics=torch_semantics, zero_moments=case == "plain",
                **CASES[case])


def test_cpu_zero_beta1():
    check_steps(op_step, ODD_SHAPES, DTYPES["fp32"], betas=(0.0, 0.99), weight_decay=0.1)


@pytest.mark.parametrize("torch_semantics", [False, True])
@pytest.mark.parametrize("case", ["decay", "big_eps"])
def test_triton_kernel_matches_float64_reference(case, torch_semantics):
    """The table kernel itself: CPU tensors under the interpreter, CUDA tensors on a GPU."""
    device = "cuda" if HAS_CUDA else "cpu"
    check_steps(triton_step, TINY_SHAPES, DTYPES["fp32"], device=device, torch_semantics=torch_semantics,
                zero_moments=True, **CASES[case])


def test_triton_kernel_groups_and_zero_beta1():
    """Two dtype groups (two launches) in one call, fp16 moments, β₁ = 0 (ln β₁ = −∞)."""
    device = "cuda" if HAS_CUDA else "cpu"
    shapes = [(3,), (50,), (17, 2)]
    state_a = make_state(shapes, DTYPES["fp32"], device)
    state_b = make_state(shapes, (FP32, FP32, FP16, FP16), device)
    state = [a + b for a, b in zip(state_a, state_b)]
    before = [[x.clone() for x in seq] for seq in state]
    triton_step(*state, lr=0.05, t=2, betas=(0.0, 0.99), eps=1e-8, weight_decay=0.1, torch_semantics=False)
    for i in range(2 * len(shapes)):
        expected = reference_step(*(seq[i] for seq in before), lr=0.05, t=2, beta1=0.0, beta2=0.99, eps=1e-8,
                                  weight_decay=0.1, torch_semantics=False)
        for seq, exp in zip((state[0], state[2], state[3]), expected):
            assert_rounded_once(seq[i], exp)


def test_triton_plan_is_cached():
    """Same tensors: the same plan, no rebuild. New tensors: a new plan."""
    device = "cuda" if HAS_CUDA else "cpu"
    state = make_state([(40,), (9,)], DTYPES["fp32"], device)
    triton_step(*state, lr=0.01, t=1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, torch_semantics=False)
    plan = next(reversed(adamw._plans.values()))
    triton_step(*state, lr=0.01, t=2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, torch_semantics=False)
    assert next(reversed(adamw._plans.values())) is plan
    state[1][0] = torch.randn(40, device=device)
    triton_step(*state, lr=0.01, t=3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, torch_semantics=False)
    assert next(reversed(adamw._plans.values())) is not plan


def test_triton_rejects_misaligned_pointer():
    device = "cuda" if HAS_CUDA else "cpu"
    params, grads, exp_avgs, exp_avg_sqs = make_state([(8,)], DTYPES["fp32"], device)
    grads = [torch.randn(9, device=device)[1:]]
    with pytest.raises(ValueError, match=r"grads\[0\].*16-byte aligned"):
        triton_step(params, grads, exp_avgs, exp_avg_sqs, lr=0.01, t=1, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay=0.0, torch_semantics=False)


@pytest.mark.parametrize("path", ["cpu_op", "triton"])
def test_torch_semantics_matches_torch_optim(path):
    """torch_semantics=True follows torch.optim.AdamW (fp32) over 4 steps; the default does not."""
    device = "cuda" if path == "triton" and HAS_CUDA else "cpu"
    step_fn = op_step if path == "cpu_op" else triton_step
    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1)
    params, _, _, _ = make_state(TINY_SHAPES, DTYPES["fp32"], device)
    ours = [p.clone() for p in params]
    theirs = [p.clone() for p in params]
    reference = [p.clone() for p in params]
    opt = torch.optim.AdamW(theirs, foreach=False, **kw)
    moments = [[torch.zeros_like(p) for p in params] for _ in range(4)]
    for t in range(1, 5):
        grads = [1e-3 * torch.randn_like(p) for p in params]
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.step()
        step_fn(ours, grads, moments[0], moments[1], t=t, torch_semantics=True, **kw)
        step_fn(reference, grads, moments[2], moments[3], t=t, torch_semantics=False, **kw)
    for a, b, r in zip(ours, theirs, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert (r - b).abs().max() > 1e-3


@pytest.mark.parametrize("path", ["cpu_op", "triton"])
def test_boundary_hyperparameters_match_torch_optim_nan_for_nan(path):
    """Every hyperparameter torch.optim.AdamW accepts, at its boundaries (lr, weight decay, β₁, β₂, eps
    = 0) and edited every step, over tensors with zero gradients (v = 0, where eps = 0 makes 0/0):
    torch_semantics=True gives eager torch.optim's values, NaN where it has NaN and nowhere else."""
    device = "cuda" if path == "triton" and HAS_CUDA else "cpu"
    step_fn = op_step if path == "cpu_op" else triton_step
    params = [p for p, *_ in [make_state(TINY_SHAPES, DTYPES["fp32"], device)]][0]
    ours, theirs = [p.clone() for p in params], [p.clone() for p in params]
    opt = torch.optim.AdamW(theirs, foreach=False)
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    edits = [dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.5), dict(lr=0.0, betas=(0.0, 0.99), eps=0.0,
             weight_decay=0.01), dict(lr=0.02, betas=(0.5, 0.0), eps=0.0, weight_decay=0.0),
             dict(lr=0.0, betas=(0.9, 0.999), eps=1e-3, weight_decay=0.5), dict(lr=0.05, betas=(0.0, 0.0), eps=1e-8,
             weight_decay=0.0)]
    for t, kw in enumerate(edits, start=1):
        grads = [torch.randn_like(p) * (torch.rand_like(p) < 0.5) for p in params]  # half of them 0
        grads[0].zero_()  # v stays 0 throughout
        for p, g in zip(theirs, grads):
            p.grad = g.clone()
        opt.param_groups[0].update(kw)
        opt.step()
        step_fn(ours, grads, *moments, t=t, torch_semantics=True, **kw)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"{kw}: {m}")


def test_opcheck():
    params, grads, exp_avgs, exp_avg_sqs = make_state([(5, 3), (1,)], (FP32, BF16, BF16, FP32))
    args = (params, grads, exp_avgs, exp_avg_sqs, torch.tensor(0.01), torch.tensor(3.0), 0.9, 0.999, 1e-8, 0.01, False)
    torch.library.opcheck(torch.ops.cstack.fused_adamw_.default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_and_matches_eager(backend):
    """A compiled function calling the op mutates its inputs exactly like eager, at new lr/step values too."""

    def train_update(params, grads, exp_avgs, exp_avg_sqs, lr, step):
        torch.ops.cstack.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, step, 0.9, 0.999, 1e-8, 0.01,
                                      False)

    compiled = torch.compile(train_update, backend=backend, fullgraph=True)
    eager_state = make_state([(7, 3), (11,)], DTYPES["fp32"])
    compiled_state = [[x.clone() for x in seq] for seq in eager_state]
    for t, lr in [(1, 0.01), (2, 0.02)]:
        train_update(*eager_state, torch.tensor(lr), torch.tensor(float(t)))
        compiled(*compiled_state, torch.tensor(lr), torch.tensor(float(t)))
    for eager_seq, compiled_seq in zip(eager_state, compiled_state):
        for e, c in zip(eager_seq, compiled_seq):
            torch.testing.assert_close(c, e, rtol=0, atol=0)


def _bad(mutate, match):
    return pytest.param(mutate, match, id=match.split(":")[0].replace("\\", ""))


@pytest.mark.parametrize("mutate, match", [
    _bad(lambda a: a.update(grads=a["grads"][:1]), r"grads: expected a list as long as params \(2\)"),
    _bad(lambda a: a["grads"].__setitem__(1, torch.randn(3)), r"grads\[1\]: expected the shape of params\[1\]"),
    _bad(lambda a: a["grads"].__setitem__(0, torch.randn(4, 5, device="meta")), r"grads\[0\]: expected the device"),
    _bad(lambda a: a["exp_avgs"].__setitem__(1, torch.zeros(2, 6)), r"exp_avgs\[1\]: expected the shape"),
    _bad(lambda a: a["exp_avg_sqs"].__setitem__(1, torch.zeros(6, dtype=torch.int32)), r"exp_avg_sqs\[1\]: expected dtype"),
    _bad(lambda a: a["params"].__setitem__(1, torch.zeros(6, dtype=torch.int64)), r"params\[1\]: expected dtype"),
    _bad(lambda a: a["params"].__setitem__(0, torch.zeros(5, 4).t()), r"params\[0\]: expected a contiguous tensor"),
    _bad(lambda a: a.update(lr=-1e-3), r"lr: expected a finite number >= 0"),
    _bad(lambda a: a.update(lr=math.inf), r"lr: expected a finite number >= 0"),
    _bad(lambda a: a.update(lr=torch.tensor(-1e-3)), r"lr: expected a finite value >= 0, got -0.001"),
    _bad(lambda a: a.update(lr=torch.tensor(math.nan)), r"lr: expected a finite value >= 0, got nan"),
    _bad(lambda a: a.update(lr=torch.tensor(math.inf)), r"lr: expected a finite value >= 0, got inf"),
    _bad(lambda a: a.update(lr=torch.tensor(1e-3, dtype=torch.float64)), r"lr: expected dtype torch.float32"),
    _bad(lambda a: a.update(step=0), r"step: expected a finite step number >= 1"),
    _bad(lambda a: a.update(step=math.inf), r"step: expected a finite step number >= 1"),
    _bad(lambda a: a.update(step=torch.tensor(0.0)), r"step: expected a finite step number >= 1, got 0.0"),
    _bad(lambda a: a.update(step=torch.tensor(-1.0)), r"step: expected a finite step number >= 1, got -1.0"),
    _bad(lambda a: a.update(step=torch.tensor(math.nan)), r"step: expected a finite step number >= 1, got nan"),
    _bad(lambda a: a.update(step=torch.tensor([1.0])), r"step: expected a tensor of rank 0"),
    _bad(lambda a: a.update(betas=(1.0, 0.999)), r"beta1: expected a value in \[0, 1\)"),
    _bad(lambda a: a.update(betas=(0.9, -0.1)), r"beta2: expected a value in \[0, 1\)"),
    _bad(lambda a: a.update(eps=-1e-8), r"eps: expected a finite value >= 0"),
    _bad(lambda a: a.update(eps=math.inf), r"eps: expected a finite value >= 0"),
    _bad(lambda a: a.update(weight_decay=-0.1), r"weight_decay: expected a finite value >= 0"),
    _bad(lambda a: a.update(weight_decay=math.inf), r"weight_decay: expected a finite value >= 0"),
    _bad(lambda a: a.update(weight_decay=math.nan), r"weight_decay: expected a finite value >= 0"),
    _bad(lambda a: a.update(betas=(math.nan, 0.999)), r"beta1: expected a value in \[0, 1\)"),
])
def test_bad_input_raises_before_any_update(mutate, match):
    params, grads, exp_avgs, exp_avg_sqs = make_state([(4, 5), (6,)], DTYPES["fp32"])
    args = dict(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, lr=1e-3, step=1)
    mutate(args)
    before = [p.clone() for p in args["params"]]
    with pytest.raises(ValueError, match=match):
        fused_adamw(**args)
    for p, b in zip(args["params"], before):
        assert torch.equal(p, b)


# --------------------------------------------------------------------------- shared memory

def _same_shapes(device):
    """Two (8,) tensors a list: the tensors line up whatever is swapped in."""
    state = make_state([(8,), (8,)], DTYPES["fp32"], device)
    return dict(zip(("params", "grads", "exp_avgs", "exp_avg_sqs"), state), device=device)


ALIASED = {  # name: (mutate the lists, message)
    "moments_one_tensor": (lambda a: a["exp_avg_sqs"].__setitem__(0, a["exp_avgs"][0]),
                           r"exp_avg_sqs\[0\]: expected memory of its own.*got memory shared with exp_avgs\[0\]"),
    "param_twice": (lambda a: a["params"].__setitem__(1, a["params"][0]),
                    r"params\[1\]: expected memory of its own.*params\[0\]"),
    "param_is_moment": (lambda a: a["exp_avgs"].__setitem__(1, a["params"][1]),
                        r"exp_avgs\[1\]: expected memory of its own.*params\[1\]"),
    "moment_of_another_param": (lambda a: a["exp_avg_sqs"].__setitem__(0, a["exp_avgs"][1]),
                                r"exp_avg_sqs\[0\]: expected memory of its own.*exp_avgs\[1\]"),
    "grad_is_param": (lambda a: a["grads"].__setitem__(0, a["params"][0]),
                      r"grads\[0\]: expected memory of its own.*params\[0\]"),
    "partial_overlap": (lambda a: (a.__setitem__("buf", torch.zeros(64, device=a["device"])),
                                   a["params"].__setitem__(1, a["buf"][16:24]),
                                   a["exp_avgs"].__setitem__(0, a["buf"][20:28])),
                        r"exp_avgs\[0\]: expected memory of its own.*params\[1\]"),
}


@pytest.mark.parametrize("path", ["cpu_op", "triton"])
@pytest.mark.parametrize("case", ALIASED)
def test_shared_memory_is_refused(case, path):
    """A tensor the op writes may share memory with no other argument: refused before any update."""
    mutate, match = ALIASED[case]
    args = _same_shapes("cuda" if path == "triton" and HAS_CUDA else "cpu")
    mutate(args)
    lists = [args[k] for k in ("params", "grads", "exp_avgs", "exp_avg_sqs")]
    before = [[t.clone() for t in seq] for seq in lists]
    with pytest.raises(ValueError, match=match):
        if path == "cpu_op":
            fused_adamw(*lists, lr=1e-3, step=1)
        else:
            triton_step(*lists, lr=1e-3, t=1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                        torch_semantics=False)
    for seq, old in zip(lists, before):
        assert all(torch.equal(t, o) for t, o in zip(seq, old))


@pytest.mark.parametrize("path", ["cpu_op", "triton"])
def test_disjoint_views_and_shared_grads_are_accepted(path):
    """Views of one flat buffer that do not overlap are fine, and grads may share memory (only read)."""
    device = "cuda" if path == "triton" and HAS_CUDA else "cpu"
    flat = [torch.randn(32, device=device) for _ in range(4)]
    flat[2].zero_()
    flat[3].zero_()
    state = [[f[:8], f[16:24]] for f in flat]
    state[1][1] = state[1][0]  # one grad for both
    step_fn = op_step if path == "cpu_op" else triton_step
    kw = dict(lr=0.05, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, torch_semantics=False)
    before = [[x.clone() for x in seq] for seq in state]
    step_fn(*state, t=1, **kw)
    for i in range(2):
        expected = reference_step(*(seq[i] for seq in before), t=1, beta1=0.9, beta2=0.999, lr=0.05, eps=1e-8,
                                  weight_decay=0.1, torch_semantics=False)
        for seq, exp in zip((state[0], state[2], state[3]), expected):
            assert_rounded_once(seq[i], exp)


def test_triton_plan_hit_still_checks_layout():
    """A cached plan is keyed on shapes and contiguity too: a transposed or reshaped grad at the
    address of an accepted one is refused, not run on the old plan."""
    params, grads, exp_avgs, exp_avg_sqs = make_state([(4, 4), (9,)], DTYPES["fp32"], "cuda" if HAS_CUDA else "cpu")
    kw = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, torch_semantics=False)
    triton_step(params, grads, exp_avgs, exp_avg_sqs, t=1, **kw)
    g = grads[0]
    before = [p.clone() for p in params]
    with pytest.raises(ValueError, match=r"grads\[0\]: expected a contiguous tensor"):
        triton_step(params, [g.t(), grads[1]], exp_avgs, exp_avg_sqs, t=2, **kw)
    with pytest.raises(ValueError, match=r"grads\[0\]: expected the shape of params\[0\]"):
        triton_step(params, [g.view(2, 8), grads[1]], exp_avgs, exp_avg_sqs, t=2, **kw)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    triton_step(params, grads, exp_avgs, exp_avg_sqs, t=2, **kw)  # the accepted tensors still run


# --------------------------------------------------------------------------- lr and step values on the device

def triton_step_tensors(state, lr, step):
    adamw._triton_step(*state, lr, step, 0.9, 0.999, 1e-8, 0.1, False, block=16, num_warps=1)


@pytest.mark.parametrize("lr, step, name", [
    (0.01, 0.0, "step"), (0.01, -1.0, "step"), (0.01, math.nan, "step"), (0.01, math.inf, "step"),
    (math.nan, 1.0, "lr"), (math.inf, 1.0, "lr"), (-0.01, 1.0, "lr"), (math.nan, 0.0, "lr and step"),
])
def test_triton_refuses_bad_lr_or_step_on_the_device(lr, step, name):
    """lr/step tensors on the params' device are checked by the kernel: it changes nothing and flags the
    value, which the op raises (at once under the interpreter; on CUDA, see test_gpu_refused_step_raises)."""
    device = "cuda" if HAS_CUDA else "cpu"
    state = make_state([(37,), (5, 13)], DTYPES["fp32"], device)
    before = [[x.clone() for x in seq] for seq in state]
    lr_t, step_t = torch.tensor(lr, device=device), torch.tensor(step, device=device)
    with pytest.raises(ValueError, match=f"^{name}: expected lr finite and >= 0 and step finite and >= 1"):
        triton_step_tensors(state, lr_t, step_t)
        adamw.raise_if_refused(device)
    for seq, old in zip(state, before):
        assert all(torch.equal(t, o) for t, o in zip(seq, old))
    adamw.raise_if_refused(device)  # raised once, then cleared
    triton_step_tensors(state, torch.tensor(0.01, device=device), torch.tensor(1.0, device=device))
    assert not torch.equal(state[0][0], before[0][0])


@pytest.mark.skipif(HAS_CUDA, reason="CPU tensors on the CUDA path are read on the host (test below)")
def test_raise_if_refused_reads_the_flag():
    adamw._refusals_for(torch.device("cpu")).flag.fill_(2)
    with pytest.raises(ValueError, match="^step:"):
        adamw.raise_if_refused()
    adamw.raise_if_refused()


# --------------------------------------------------------------------------- bad targets of the fused loss

def flag_bad_target(device):
    """What the fused cross-entropy leaves after a batch with a target >= V: its flag set."""
    from custom_ops.linear_cross_entropy import linear_cross_entropy

    hidden, weight = torch.randn(4, 8, device=device), torch.randn(11, 8, device=device)
    targets = torch.tensor([0, 11, 3, -100], device=device)
    assert torch.isnan(linear_cross_entropy(hidden, weight, targets))


@pytest.mark.parametrize("path", ["cpu_op", "triton"])
def test_bad_targets_skip_the_update_and_raise(path):
    """While the fused cross-entropy's bad-target flag is set the update is skipped whole (its gradients
    are NaN) and a ValueError names targets: at once on the CPU and under the interpreter, raised once."""
    from custom_ops.linear_cross_entropy import check_targets_flag

    device = "cuda" if path == "triton" and HAS_CUDA else "cpu"
    state = make_state([(37,), (5, 13)], DTYPES["fp32"], device)
    before = [[x.clone() for x in seq] for seq in state]
    step_fn = op_step if path == "cpu_op" else triton_step
    kw = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, torch_semantics=False)
    flag_bad_target(device)
    with pytest.raises(ValueError, match=r"^targets: expected values in \[0, V\) or ignore_index"):
        step_fn(*state, t=1, **kw)
        adamw.raise_if_refused(device)
    for seq, old in zip(state, before):
        assert all(torch.equal(t, o) for t, o in zip(seq, old))
    check_targets_flag()  # reported once: the cross-entropy's flag was cleared with it
    adamw.raise_if_refused(device)
    step_fn(*state, t=1, **kw)
    assert not torch.equal(state[0][0], before[0][0])


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's flag is read at once (CUDA: test_gpu_bad_targets...)")
def test_check_targets_flag_clears_the_refusal_it_reports():
    """A refusal the kernel recorded for a bad target, reported by check_targets_flag() first, is not
    raised again by the next update."""
    from custom_ops.linear_cross_entropy import check_targets_flag

    adamw._refusals_for(torch.device("cpu")).flag.fill_(adamw.REFUSED_TARGETS.value | adamw.REFUSED_STEP.value)
    flag_bad_target("cpu")
    with pytest.raises(ValueError, match="^targets:"):
        check_targets_flag()
    with pytest.raises(ValueError, match="^step:"):  # the other refusal stays
        adamw.raise_if_refused()
    adamw.raise_if_refused()


@pytest.mark.parametrize("torch_semantics", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_multi_tensor_matches_cpu(torch_semantics):
    """Realistic bf16 shapes and two other dtype groups in one call, lr/step on the device and changed
    in place; each step compared from the same state with the CPU path (rounding may flip 1 ulp)."""
    shapes = [(4096, 4096), (11008, 512), (4096,), (1,), (333, 77)]
    groups = [DTYPES["bf16"], DTYPES["mixed"], DTYPES["fp32"]]
    gpu_state = [[], [], [], []]
    for dtypes in groups:
        for seq, part in zip(gpu_state, make_state(shapes, dtypes, "cuda", grad_scale=1e-2)):
            seq.extend(part)
    lr, step = torch.tensor(0.0, device="cuda"), torch.tensor(0.0, device="cuda")
    for t, lr_value in [(1, 1e-3), (2, 2e-3), (3, 5e-4)]:
        cpu_state = [[x.cpu() for x in seq] for seq in gpu_state]
        lr.fill_(lr_value)
        step.fill_(t)
        fused_adamw(*gpu_state, lr=lr, step=step, eps=1e-6, weight_decay=0.1, torch_semantics=torch_semantics)
        fused_adamw(*cpu_state, lr=lr_value, step=t, eps=1e-6, weight_decay=0.1, torch_semantics=torch_semantics)
        for gpu_seq, cpu_seq in zip(gpu_state, cpu_state):
            for g, c in zip(gpu_seq, cpu_seq):
                if g.dtype == BF16:  # same fp32 math up to rounding: bf16 results rarely differ at all
                    torch.testing.assert_close(g.cpu(), c, rtol=2**-7, atol=1e-6)
                    same = (g.cpu() == c).double().mean().item()
                    assert same > 0.99, f"only {same:.4f} of a {tuple(g.shape)} bf16 tensor equal"
                else:
                    torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_compiles_with_inductor():
    def train_update(params, grads, exp_avgs, exp_avg_sqs, lr, step):
        torch.ops.cstack.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, step, 0.9, 0.999, 1e-8, 0.01,
                                      False)

    compiled = torch.compile(train_update, fullgraph=True)
    eager_state = make_state([(4096, 1024), (4096,)], DTYPES["bf16"], "cuda")
    compiled_state = [[x.clone() for x in seq] for seq in eager_state]
    for t in (1, 2):
        lr, step = torch.tensor(1e-3, device="cuda"), torch.tensor(float(t), device="cuda")
        train_update(*eager_state, lr, step)
        compiled(*compiled_state, lr, step)
    for eager_seq, compiled_seq in zip(eager_state, compiled_state):
        for e, c in zip(eager_seq, compiled_seq):
            torch.testing.assert_close(c, e, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_refused_step_raises_at_the_next_call():
    """On CUDA the kernel's refusal surfaces without a sync: at the next call once the flag's copy
    has landed, or at raise_if_refused()."""
    state = make_state([(4096,), (333, 77)], DTYPES["bf16"], "cuda")
    before = [[x.clone() for x in seq] for seq in state]
    lr, step = torch.tensor(1e-3, device="cuda"), torch.tensor(0.0, device="cuda")
    fused_adamw(*state, lr=lr, step=step)  # refused on the device: no error yet
    torch.cuda.synchronize()
    for seq, old in zip(state, before):
        assert all(torch.equal(t, o) for t, o in zip(seq, old))
    step.fill_(1.0)
    with pytest.raises(ValueError, match="^step: expected"):
        fused_adamw(*state, lr=lr, step=step)
    fused_adamw(*state, lr=lr, step=step)
    step.fill_(math.nan)
    fused_adamw(*state, lr=lr, step=step)
    with pytest.raises(ValueError, match="^step: expected"):
        adamw.raise_if_refused("cuda")
    step.fill_(2.0)
    fused_adamw(*state, lr=lr, step=step)
    adamw.raise_if_refused()
    with pytest.raises(ValueError, match=r"step: expected a finite step number >= 1, got 0.0"):
        fused_adamw(*state, lr=1e-3, step=torch.tensor(0.0))  # a CPU step: read on the host


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_bad_targets_skip_the_update_without_a_sync():
    """On CUDA the kernel reads the cross-entropy's flag: it skips the update, and the refusal is raised
    at the next call once its copy has landed, or by check_targets_flag() (then only once)."""
    from custom_ops.linear_cross_entropy import check_targets_flag

    state = make_state([(4096,), (333, 77)], DTYPES["bf16"], "cuda")
    before = [[x.clone() for x in seq] for seq in state]
    lr, step = torch.tensor(1e-3, device="cuda"), torch.tensor(1.0, device="cuda")
    flag_bad_target("cuda")
    fused_adamw(*state, lr=lr, step=step)  # skipped on the device: no error yet
    torch.cuda.synchronize()
    for seq, old in zip(state, before):
        assert all(torch.equal(t, o) for t, o in zip(seq, old))
    with pytest.raises(ValueError, match="^targets: expected"):
        fused_adamw(*state, lr=lr, step=step)
    check_targets_flag()  # cleared with the refusal
    flag_bad_target("cuda")
    fused_adamw(*state, lr=lr, step=step)
    with pytest.raises(ValueError, match="^targets: expected"):
        check_targets_flag()
    adamw.raise_if_refused()  # reported once
    fused_adamw(*state, lr=lr, step=step)
    adamw.raise_if_refused()
    torch.cuda.synchronize()
    assert not torch.equal(state[0][0], before[0][0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_new_plan_waits_for_no_gpu_work():
    """Tensors at new addresses (a plan miss, as a step's fresh gradients are) launch the update behind
    queued work without waiting for it: the host keeps its lead into the next step."""
    state = make_state([(4096, 64), (333, 77)], DTYPES["bf16"], "cuda")
    expected = [[x.cpu() for x in seq] for seq in state]
    fused_adamw(*expected, lr=1e-3, step=1)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of queued GPU work
    fused_adamw(*state, lr=torch.tensor(1e-3), step=torch.tensor(1.0))
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "the call waited for the GPU's queue to drain (a host sync)"
    for seq, ref in zip(state, expected):
        for g, c in zip(seq, ref):
            torch.testing.assert_close(g.cpu(), c, rtol=2**-7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_mixed_devices_rejected():
    params, grads, exp_avgs, exp_avg_sqs = make_state([(8,)], DTYPES["bf16"], "cuda")
    with pytest.raises(ValueError, match=r"grads\[0\]: expected the device of params\[0\]"):
        fused_adamw(params, [grads[0].cpu()], exp_avgs, exp_avg_sqs, lr=1e-3, step=1)
    with pytest.raises(ValueError, match=r"lr: expected a tensor on the cpu or on the params' device"):
        fused_adamw([p.cpu() for p in params], [g.cpu() for g in grads], [m.cpu() for m in exp_avgs],
                    [v.cpu() for v in exp_avg_sqs], lr=torch.tensor(1e-3, device="cuda"), step=1)
