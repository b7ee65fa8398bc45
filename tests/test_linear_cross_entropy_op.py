"""cstack::linear_cross_entropy against float64 cross-entropy over the full logits.

Shapes are odd (T=53, V=203, chunks of 16 tokens) so that no block or chunk divides
them; targets 0 and V-1 are always present. On CPU the Triton row kernel runs in the
interpreter on fp32/fp16; bf16 and realistic sizes are the gpu-marked tests.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import custom_ops.linear_cross_entropy as lce
from custom_ops.linear_cross_entropy import (
    check_targets_flag,
    chunk_tokens,
    chunk_tokens_for,
    fwd_chunked,
    linear_cross_entropy,
    xent_rows_triton_,
)
from tests.helpers import HAS_CUDA, INTERPRETER, rel_err

T, D, V, CHUNK = 53, 24, 203, 16
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRETER), reason="needs CUDA or TRITON_INTERPRET=1")


def make_inputs(t, d, v, *, ignore=True, dtype=torch.float32, device="cpu", ignore_index=-100):
    """Logits of a few units (a peaked but not one-hot softmax), targets 0 and V-1 present."""
    hidden = torch.randn(t, d, device=device).to(dtype)
    weight = (torch.randn(v, d, device=device) * 2 / d**0.5).to(dtype)
    targets = torch.randint(0, v, (t,), device=device)
    targets[0], targets[1] = 0, v - 1
    if ignore:
        targets[3::7] = ignore_index
    return hidden, weight, targets


def reference(hidden, weight, targets, ignore_index=-100, reduction="mean", upstream=1.0, bias=None):
    """Loss and gradients (hidden's, weight's, bias's if any) of upstream · cross_entropy(hidden @ weightᵀ + bias)
    in float64."""
    params = [t.detach().double().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logits = params[0] @ params[1].T + (params[2] if bias is not None else 0)
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
    (loss * upstream).backward()
    return loss.detach(), *(p.grad for p in params)


def run_op(hidden, weight, targets, upstream, bias=None, **kwargs):
    params = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    loss = linear_cross_entropy(*params[:2], targets, bias=params[2] if bias is not None else None, **kwargs)
    (loss * upstream).backward()
    return loss.detach(), *(p.grad for p in params)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [True, False])
def test_op_matches_float64(reduction, ignore):
    hidden, weight, targets = make_inputs(T, D, V, ignore=ignore)
    with chunk_tokens(CHUNK):
        loss, gh, gw = run_op(hidden, weight, targets, 3.7, reduction=reduction)
    ref_loss, ref_gh, ref_gw = reference(hidden, weight, targets, reduction=reduction, upstream=3.7)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert rel_err(loss, ref_loss) < 1e-5
    assert rel_err(gh, ref_gh) < 1e-5
    assert rel_err(gw, ref_gw) < 1e-5


@needs_triton
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("ignore", [True, False])
def test_triton_chunk_loop_matches_float64(reduction, ignore):
    """The CUDA path's loop and row kernel, on CPU tensors under the interpreter."""
    hidden, weight, targets = make_inputs(T, D, V, ignore=ignore, device=TRITON_DEVICE)
    with chunk_tokens(CHUNK):
        loss, gh, gw, gb = fwd_chunked(hidden, weight, targets, -100, reduction, xent_rows_triton_)
    assert gb.numel() == 0
    ref_loss, ref_gh, ref_gw = reference(hidden, weight, targets, reduction=reduction)
    tol = 1e-3 if HAS_CUDA else 1e-5  # TF32 matmuls on the GPU
    assert rel_err(loss, ref_loss) < tol
    assert rel_err(gh, ref_gh) < tol
    assert rel_err(gw, ref_gw) < tol


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_rows_several_blocks(dtype):
    """V=203 in blocks of 32: seven blocks, the last one ragged."""
    rows, v, scale = 11, 203, 0.25
    logits = (torch.randn(rows, v, device=TRITON_DEVICE) * 3).to(dtype)
    targets = torch.randint(0, v, (rows,), device=TRITON_DEVICE)
    targets[0], targets[1], targets[4] = 0, v - 1, -100
    x = logits.double()
    valid = targets != -100
    lse = torch.logsumexp(x, 1)
    safe = torch.where(valid, targets, 0)
    ref_loss = torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], 0.0)
    ref_g = (torch.softmax(x, 1) - F.one_hot(safe, v)) * scale * valid[:, None]

    loss_rows = torch.empty(rows, device=TRITON_DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=TRITON_DEVICE)
    scale_t = torch.tensor(scale, device=TRITON_DEVICE)
    xent_rows_triton_(logits, targets, loss_rows, scale_t, flag, -100, block_v=32)

    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert rel_err(loss_rows, ref_loss) < tol
    assert rel_err(logits, ref_g) < tol
    assert (logits[4] == 0).all() and loss_rows[4] == 0
    assert flag.item() == 0


BIAS_TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


@pytest.mark.parametrize("path", ["cpu", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bias_matches_float64(path, dtype, reduction):
    """A head with a bias, T=7, V=13, d=5 in chunks of 3 (the last ragged), rows 3 ignored: the op's d bias
    is the column sum of d logits over the kept rows, in the bias's dtype; fp16 also through Triton."""
    hidden, weight, targets = make_inputs(7, 5, 13, dtype=dtype, device=TRITON_DEVICE if path == "triton" else "cpu")
    bias = torch.randn(13, device=hidden.device).to(dtype)
    with chunk_tokens(3):
        if path == "cpu":  # through autograd, scaled by an upstream gradient
            got = run_op(hidden, weight, targets, 2.5, bias=bias, reduction=reduction)
        else:
            got = fwd_chunked(hidden, weight, targets, -100, reduction, xent_rows_triton_, bias)
    ref = reference(hidden, weight, targets, reduction=reduction, upstream=2.5 if path == "cpu" else 1.0, bias=bias)
    assert got[3].dtype == dtype and got[3].shape == (13,)
    tol = 1e-3 if HAS_CUDA and path == "triton" else BIAS_TOL[dtype]  # TF32 matmuls on the GPU
    for a, e in zip(got, ref):
        assert rel_err(a, e) < tol


def test_bias_all_ignored():
    """No kept row: d bias is 0 like the other gradients (sum), the mean NaN like F.cross_entropy's."""
    hidden, weight, _ = make_inputs(7, 5, 13)
    bias, targets = torch.randn(13), torch.full((7,), -100)
    loss, gh, gw, gb = run_op(hidden, weight, targets, 1.0, bias=bias, reduction="sum")
    assert loss == 0 and (gh == 0).all() and (gw == 0).all() and (gb == 0).all()
    assert torch.isnan(linear_cross_entropy(hidden, weight, targets, bias=bias))


def test_leading_dims_flattened():
    hidden, weight, targets = make_inputs(3 * 11, D, V)
    flat = run_op(hidden, weight, targets, 1.0)
    nested = run_op(hidden.view(3, 11, D), weight, targets.view(3, 11), 1.0)
    assert torch.equal(flat[0], nested[0])
    assert torch.equal(flat[1], nested[1].view(-1, D))
    assert torch.equal(flat[2], nested[2])


def test_ignore_index_inside_vocab():
    """As in F.cross_entropy, targets equal to ignore_index are ignored even when in [0, V)."""
    hidden, weight, targets = make_inputs(T, D, V, ignore_index=7)
    with chunk_tokens(CHUNK):
        got = run_op(hidden, weight, targets, 1.0, ignore_index=7)
    for a, e in zip(got, reference(hidden, weight, targets, ignore_index=7)):
        assert rel_err(a, e) < 1e-5


def test_all_ignored():
    """Mean over zero tokens is NaN (like F.cross_entropy), sum is 0; gradients are 0."""
    hidden, weight, _ = make_inputs(T, D, V)
    targets = torch.full((T,), -100)
    loss, gh, gw = run_op(hidden, weight, targets, 1.0, reduction="sum")
    assert loss == 0 and (gh == 0).all() and (gw == 0).all()
    mean = linear_cross_entropy(hidden, weight, targets)
    assert torch.isnan(mean) and torch.isnan(F.cross_entropy(hidden @ weight.T, targets))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cpu(dtype):
    hidden, weight, targets = make_inputs(T, D, V, dtype=dtype)
    with chunk_tokens(CHUNK):
        loss, gh, gw = run_op(hidden, weight, targets, 2.0)
    assert loss.dtype == gh.dtype == gw.dtype == dtype
    for a, e in zip((loss, gh, gw), reference(hidden, weight, targets, upstream=2.0)):
        assert rel_err(a, e) < 1e-2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("public", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_opcheck(public, reduction, bias):
    hidden, weight, targets = make_inputs(19, 8, 37)
    b = torch.randn(37) if bias else None
    if public:
        args = (hidden.requires_grad_(), weight.requires_grad_(), targets, -100, reduction,
                b.requires_grad_() if bias else None)
        op = torch.ops.cstack.linear_cross_entropy.default
    else:
        args = (hidden, weight, targets, -100, reduction, b)
        op = torch.ops.cstack.linear_cross_entropy_fwd.default
    with chunk_tokens(8):
        torch.library.opcheck(op, args)


def test_compiles_fullgraph():
    """AOTAutograd traces it: the fwd op in the forward graph, a scale in the backward."""
    hidden, weight, targets = make_inputs(T, D, V)

    def step(h, w, t):
        return linear_cross_entropy(h, w, t, reduction="sum") * 0.3

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with chunk_tokens(CHUNK):
        got, want = [], []
        for fn, out in ((compiled, got), (step, want)):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss = fn(h, w, targets)
            loss.backward()
            out += [loss, h.grad, w.grad]
    for a, e in zip(got, want):
        assert rel_err(a, e) < 1e-6


def test_bad_targets_cpu():
    hidden, weight, targets = make_inputs(T, D, V)
    linear_cross_entropy(hidden, weight, targets)
    check_targets_flag()  # good targets: no error
    for bad in (V, -5):
        targets[9] = bad
        h = hidden.clone().requires_grad_()
        loss = linear_cross_entropy(h, weight, targets)
        loss.backward()
        assert torch.isnan(loss) and torch.isnan(h.grad[9]).all()
        with pytest.raises(ValueError, match=r"targets: expected values in \[0, V\) or ignore_index"):
            check_targets_flag()
        check_targets_flag()  # the check reset the flag


@needs_triton
def test_bad_targets_triton():
    rows, v = 6, 50
    logits = torch.randn(rows, v, device=TRITON_DEVICE)
    targets = torch.tensor([0, v, 3, -100, -1, v - 1], device=TRITON_DEVICE)
    loss_rows = torch.empty(rows, device=TRITON_DEVICE)
    flag = torch.zeros(1, dtype=torch.int32, device=TRITON_DEVICE)
    xent_rows_triton_(logits, targets, loss_rows, torch.tensor(1.0, device=TRITON_DEVICE), flag, -100, block_v=16)
    bad = torch.tensor([False, True, False, False, True, False], device=TRITON_DEVICE)
    assert torch.isnan(loss_rows[bad]).all() and torch.isfinite(loss_rows[~bad]).all()
    assert torch.isnan(logits[bad]).all() and torch.isfinite(logits[~bad]).all()
    assert flag.item() == 1


def _bad_input_cases():
    h, w, t = make_inputs(T, D, V)
    yield "hidden", (h.int(), w, t, -100, "mean")
    yield "hidden", (h[0], w, t, -100, "mean")
    yield "weight", (h, w[:, :-1], t, -100, "mean")
    yield "weight", (h, w.double(), t, -100, "mean")
    yield "targets", (h, w, t.float(), -100, "mean")
    yield "targets", (h, w, t[:-1], -100, "mean")
    yield "targets", (h, w, t.to("meta"), -100, "mean")
    yield "reduction", (h, w, t, -100, "none")
    b = torch.randn(V)
    yield "bias", (h, w, t, -100, "mean", b[:-1])
    yield "bias", (h, w, t, -100, "mean", b[None])
    yield "bias", (h, w, t, -100, "mean", b.double())
    yield "bias", (h, w, t, -100, "mean", b.to("meta"))


@pytest.mark.parametrize("entry", ["python", "op", "fake"])
def test_bad_inputs_raise(entry):
    for arg, args in _bad_input_cases():
        with pytest.raises(ValueError, match=f"^{arg}: expected[^\n]*$"):
            if entry == "python":
                linear_cross_entropy(*args)
            elif entry == "op":
                torch.ops.cstack.linear_cross_entropy_fwd(*args)
            else:
                with FakeTensorMode() as mode:
                    fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
                    torch.ops.cstack.linear_cross_entropy_fwd(*fakes)


def test_bad_launcher_args():
    logits = torch.randn(4, 40)
    targets, loss_rows = torch.zeros(4, dtype=torch.int64), torch.empty(4)
    scale, flag = torch.tensor(1.0), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="^logits: expected a contiguous"):
        xent_rows_triton_(logits.t(), targets, loss_rows, scale, flag, -100)
    with pytest.raises(ValueError, match="^block_v: expected a power of two"):
        xent_rows_triton_(logits, targets, loss_rows, scale, flag, -100, block_v=48)
    with pytest.raises(ValueError, match="^loss_rows: expected"):
        xent_rows_triton_(logits, targets, loss_rows[:3], scale, flag, -100)
    with pytest.raises(ValueError, match="^n: expected a positive int"):
        with chunk_tokens(0):
            pass


def test_chunk_bounded_by_budget():
    """The full config's chunk is 4096 tokens (1.16 GiB of bf16 logits), never T·V."""
    n = chunk_tokens_for(65_536, 151_936, 2)
    assert n == 4096 and n * 151_936 * 2 <= lce.CHUNK_BYTES
    assert chunk_tokens_for(100, 1000, 4) == 100  # small problems: one chunk of T
    assert chunk_tokens_for(10, 10**12, 2) == 1  # a huge vocabulary still makes progress


# ---- GPU (bf16, realistic sizes); the lead runs these on the H200 ----

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpu_bf16_matches_float64(reduction):
    hidden, weight, targets = make_inputs(4099, 512, 32_771, dtype=torch.bfloat16, device="cuda")
    with chunk_tokens(1024):
        loss, gh, gw = run_op(hidden, weight, targets, 3.7, reduction=reduction)
    ref_loss, ref_gh, ref_gw = reference(hidden, weight, targets, reduction=reduction, upstream=3.7)
    assert loss.dtype == gh.dtype == gw.dtype == torch.bfloat16
    assert rel_err(loss, ref_loss) < 5e-3
    assert rel_err(gh, ref_gh) < 2e-2
    assert rel_err(gw, ref_gw) < 2e-2
    check_targets_flag()


@gpu
@pytest.mark.gpu
def test_gpu_full_vocab_default_chunks_and_memory():
    """d=4096, V=151,936, T=9000: default 4096-token chunks (three, the last ragged).

    Peak memory above inputs stays within one logits chunk plus the saved and returned
    gradients, far below the 2.7 GB of full logits.
    """
    hidden, weight, targets = make_inputs(9000, 4096, 151_936, dtype=torch.bfloat16, device="cuda")
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(h, w, targets)
    loss.backward()
    torch.cuda.synchronize()
    grads = 2 * (h.numel() + w.numel()) * 2  # saved + returned, bf16
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= lce.CHUNK_BYTES + grads + 64 * 2**20
    ref_loss, ref_gh, ref_gw = reference(hidden, weight, targets)
    assert rel_err(loss, ref_loss) < 5e-3
    assert rel_err(h.grad, ref_gh) < 2e-2
    assert rel_err(w.grad, ref_gw) < 2e-2


@gpu
@pytest.mark.gpu
def test_gpu_bad_target_flag():
    hidden, weight, targets = make_inputs(300, 64, 1000, dtype=torch.bfloat16, device="cuda")
    targets[17] = 1000
    loss = linear_cross_entropy(hidden, weight, targets)
    assert torch.isnan(loss)
    with pytest.raises(ValueError, match="^targets: expected values"):
        check_targets_flag()
    targets[17] = 5
    assert torch.isfinite(linear_cross_entropy(hidden, weight, targets))
    check_targets_flag()


@gpu
@pytest.mark.gpu
def test_gpu_inductor_matches_eager():
    hidden, weight, targets = make_inputs(2053, 256, 10_007, dtype=torch.bfloat16, device="cuda")

    def step(h, w, t):
        return linear_cross_entropy(h, w, t) * 2.0

    compiled = torch.compile(step, fullgraph=True)
    with chunk_tokens(512):
        results = []
        for fn in (compiled, step):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            loss = fn(h, w, targets)
            loss.backward()
            results.append((loss, h.grad, w.grad))
    for a, e in zip(*results):
        assert rel_err(a, e) < 1e-2


@gpu
@pytest.mark.gpu
def test_gpu_opcheck():
    hidden, weight, targets = make_inputs(257, 64, 999, dtype=torch.bfloat16, device="cuda")
    with chunk_tokens(64):
        torch.library.opcheck(
            torch.ops.cstack.linear_cross_entropy.default,
            (hidden.requires_grad_(), weight.requires_grad_(), targets, -100, "mean"),
        )


def test_flop_formula_counts_three_matmuls():
    from torch.utils.flop_counter import FlopCounterMode

    h, w, t = torch.randn(37, 16), torch.randn(101, 16), torch.randint(101, (37,))
    with FlopCounterMode(display=False) as counter:
        torch.ops.cstack.linear_cross_entropy_fwd(h, w, t, -100, "mean")
    assert counter.get_total_flops() == 6 * 37 * 16 * 101
