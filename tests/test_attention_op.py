"""cstack::flash_attention_fwd / _bwd against a float64 masked-softmax reference.

CPU tests cover the torch path (through the ops and autograd); interpreter tests call
the Triton launchers on tiny CPU tensors; GPU tests run the Triton kernels in bf16/fp16,
and on an sm_90 GPU the Gluon forward and backward (which the interpreter cannot run: on the
CPU tests/test_gpu_compile.py compiles them for sm_90); a CPU test checks which GPUs and inputs
dispatch gives them.
"""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from custom_ops import attention as A
from tests.helpers import HAS_CUDA, INTERPRETER, rel_err

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-3}
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def reference(q, k, v, dout, is_causal, scale):
    """float64 masked softmax attention; returns out, lse, dq, dk, dv."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * scale
    if is_causal:
        n = s.shape[-1]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), -math.inf)
    out = torch.softmax(s, dim=-1) @ v64
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), q64.grad, k64.grad, v64.grad


def make(shape, dtype, device, layout):
    """A random tensor of `shape`, stored contiguously or in one of three strided layouts.

    transposed: [B, S, H, D] viewed as [B, H, S, D] (what splitting heads gives; [S, N, D] as
    [N, S, D] for 3-d shapes);
    padded: a slice of rows twice as long; colmajor: the last dim is not the dense one.
    """
    *lead, s, d = shape
    if layout == "contiguous":
        t = torch.randn(shape, dtype=dtype, device=device)
    elif layout == "transposed":
        t = torch.randn(*lead[:-1], s, lead[-1], d, dtype=dtype, device=device).transpose(-3, -2)
    elif layout == "padded":
        t = torch.randn(*lead, s, 2 * d, dtype=dtype, device=device)[..., d:]
    else:
        t = torch.randn(*lead, d, s, dtype=dtype, device=device).transpose(-1, -2)
    assert t.shape == shape and (layout == "contiguous") == t.is_contiguous()
    return t


def make_qkv(b, h, sq, sk, d, dtype, device="cpu", layout="contiguous", three_d=False):
    lead = (b * h,) if three_d else (b, h)
    return [make((*lead, s, d), dtype, device, layout) for s in (sq, sk, sk)]


def assert_close(got, ref, dtype, names=("out", "lse", "dq", "dk", "dv")):
    for name, g, r in zip(names, got, ref):
        assert g.shape == r.shape, name
        err = rel_err(g, r)
        assert err <= TOL[dtype], f"{name}: rel err {err:.2e} > {TOL[dtype]:.0e}"


def run_op(q, k, v, dout, is_causal, scale):
    """Forward through the public function and the op, backward through autograd."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = A.flash_attention(q, k, v, is_causal=is_causal, scale=scale)
    lse = torch.ops.cstack.flash_attention_fwd(q.detach(), k.detach(), v.detach(), is_causal, scale)[1]
    out.backward(dout)
    return out, lse, q.grad, k.grad, v.grad


# --------------------------------------------------------------------------- CPU (torch path)

CPU_CASES = [  # b, h, sq, sk, d, causal
    (2, 3, 1, 1, 16, True),
    (1, 2, 17, 17, 32, True),
    (2, 2, 67, 67, 64, False),
    (1, 2, 67, 45, 128, False),
    (1, 2, 300, 300, 64, True),  # crosses the 256-query chunk
    (1, 1, 260, 513, 32, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,sq,sk,d,causal", CPU_CASES)
def test_cpu_matches_reference(b, h, sq, sk, d, causal, dtype):
    q, k, v = make_qkv(b, h, sq, sk, d, dtype)
    dout = torch.randn_like(q)
    scale = 0.7 / math.sqrt(d)
    got = run_op(q, k, v, dout, causal, scale)
    ref = reference(q, k, v, dout, causal, scale)
    if sq == 1:  # one visible key: dq = dk = 0 exactly, so compare absolutely
        assert_close(got[:2] + got[4:], ref[:2] + ref[4:], dtype, ("out", "lse", "dv"))
        assert got[2].abs().max() < 1e-6 and got[3].abs().max() < 1e-6
    else:
        assert_close(got, ref, dtype)


@pytest.mark.parametrize("layout,three_d", [("transposed", False), ("padded", True), ("colmajor", False), ("contiguous", True)])
def test_cpu_layouts(layout, three_d):
    q, k, v = make_qkv(2, 3, 45, 45, 32, torch.float32, layout=layout, three_d=three_d)
    dout = torch.randn_like(q)
    got = run_op(q, k, v, dout, True, 1 / math.sqrt(32))
    assert_close(got, reference(q, k, v, dout, True, 1 / math.sqrt(32)), torch.float32)


def test_cpu_sum_backward_and_default_scale():
    """o.sum() hands the backward an expanded (stride-0) gradient; scale defaults to 1/sqrt(D)."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 33, 33, 16, torch.float32))
    A.flash_attention(q, k, v).sum().backward()
    ref = reference(q, k, v, torch.ones_like(q), True, 0.25)
    assert_close((q.grad, k.grad, v.grad), ref[2:], torch.float32, ("dq", "dk", "dv"))


def test_lse_is_not_differentiable():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 1, 9, 9, 16, torch.float32))
    out, lse = torch.ops.cstack.flash_attention_fwd(q, k, v, True, 0.25)
    assert out.requires_grad and not lse.requires_grad


def assert_laid_out_like_v(out, dq, dk, dv, v):
    """The ops' layout rule (``custom_ops/attention/layouts.py``): out and dv like v, dq and dk dense."""
    def significant(t):  # strides of dims of size 1 mean nothing
        return [st for size, st in zip(t.shape, t.stride()) if size != 1]

    assert significant(out) == significant(A.empty_like_v(out.shape, out.dtype, v)), ("out", out.stride(), v.stride())
    assert significant(dv) == significant(A.empty_like_v(v.shape, v.dtype, v)), ("dv", dv.stride(), v.stride())
    assert dq.is_contiguous() and dk.is_contiguous()


@pytest.mark.parametrize("layout,three_d", [("transposed", False), ("transposed", True), ("contiguous", False),
                                            ("padded", False), ("colmajor", True)])
def test_outputs_laid_out_like_v(layout, three_d):
    """Split from a [B, S, H·D] projection, v is sequence-major, and so are out and dv: merging heads
    after attention, and dv's way back into the projection, are views. Any other v gives dense
    outputs. The fake ops (what the compiler plans with) agree with the CPU ones."""
    q, k, v = make_qkv(2, 3, 45, 40, 32, torch.float32, layout=layout, three_d=three_d)
    assert A.is_sequence_major(v) == (layout == "transposed")
    dout = torch.randn(q.shape)
    out, lse = torch.ops.cstack.flash_attention_fwd(q, k, v, False, 0.2)
    dq, dk, dv = torch.ops.cstack.flash_attention_bwd(dout, q, k, v, out, lse, False, 0.2)
    assert_laid_out_like_v(out, dq, dk, dv, v)
    if layout == "transposed":  # heads merged by a view
        merged = out.transpose(-3, -2)
        assert merged.is_contiguous() and torch.equal(merged.reshape(-1), out.transpose(-3, -2).contiguous().reshape(-1))
    ref = reference(q, k, v, dout, False, 0.2)
    assert_close((out, lse, dq, dk, dv), ref, torch.float32)
    with FakeTensorMode() as mode:
        fq, fk, fv, fdo = (mode.from_tensor(t) for t in (q, k, v, dout))
        fout, flse = torch.ops.cstack.flash_attention_fwd(fq, fk, fv, False, 0.2)
        assert_laid_out_like_v(fout, *torch.ops.cstack.flash_attention_bwd(fdo, fq, fk, fv, fout, flse, False, 0.2), fv)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("causal", [True, False])
def test_opcheck(causal, layout):
    q, k, v = make_qkv(1, 2, 19, 19, 16, torch.float32, layout=layout)
    q.requires_grad_()
    torch.library.opcheck(torch.ops.cstack.flash_attention_fwd.default, (q, k, v, causal, 0.25))
    out, lse = torch.ops.cstack.flash_attention_fwd(q.detach(), k, v, causal, 0.25)
    args = (torch.randn_like(out), q.detach(), k, v, out, lse, causal, 0.25)
    torch.library.opcheck(torch.ops.cstack.flash_attention_bwd.default, args)


# --------------------------------------------------------------------------- Triton kernels, interpreter

INTERP_CASES = [  # b, h, sq, sk, d, causal, dtype, layout, three_d
    (1, 2, 17, 17, 16, True, torch.float32, "contiguous", False),
    (1, 1, 67, 67, 32, True, torch.float16, "contiguous", False),
    (2, 1, 33, 50, 16, False, torch.float32, "contiguous", False),
    (1, 1, 1, 1, 16, True, torch.float32, "contiguous", True),
    (1, 2, 40, 40, 32, False, torch.float16, "transposed", False),
    (2, 1, 24, 24, 16, True, torch.float32, "padded", True),
    (1, 1, 20, 20, 64, True, torch.float32, "colmajor", True),
    (1, 1, 17, 23, 128, False, torch.float16, "contiguous", False),
]


@pytest.mark.skipif(not INTERPRETER, reason="interpreter run of the kernels (CPU only)")
@pytest.mark.parametrize("b,h,sq,sk,d,causal,dtype,layout,three_d", INTERP_CASES)
def test_triton_kernels_interpreted(scalar_loop_bounds, b, h, sq, sk, d, causal, dtype, layout, three_d):
    q, k, v = make_qkv(b, h, sq, sk, d, dtype, layout=layout, three_d=three_d)
    dout = make(q.shape, dtype, "cpu", layout)  # transposed: the merged heads' gradient, read in place
    scale = 1 / math.sqrt(d)
    out, lse = A.triton_fwd(q, k, v, causal, scale)
    dq, dk, dv = A.triton_bwd(dout, q, k, v, out, lse, causal, scale)
    assert_laid_out_like_v(out, dq, dk, dv, v)
    ref = reference(q, k, v, dout, causal, scale)
    if sq == 1:
        assert_close((out, lse, dv), (ref[0], ref[1], ref[4]), dtype, ("out", "lse", "dv"))
        assert dq.abs().max() < 1e-6 and dk.abs().max() < 1e-6
    else:
        assert_close((out, lse, dq, dk, dv), ref, dtype)


def test_tma_layouts_kept_or_copied():
    """Views a TMA descriptor can read are passed as they are; others become dense copies."""
    transposed = make((2, 3, 40, 32), torch.float16, "cpu", "transposed")
    assert A._as_4d(transposed).data_ptr() == transposed.data_ptr()  # head split: strides aligned
    odd_rows = torch.randn(1, 2, 8, 17)[..., 1:]  # row stride 68 bytes, start 4 bytes in
    dense = A._as_4d(odd_rows)
    assert dense.is_contiguous() and torch.equal(dense, odd_rows)
    assert A._as_4d(torch.randn(3, 8, 16)).shape == (1, 3, 8, 16)
    shared_heads = torch.randn(2, 1, 8, 16).expand(2, 4, 8, 16)  # one K for 4 heads, stride 0
    assert A._as_4d(shared_heads).stride(1) == 8 * 16


@pytest.mark.skipif(not INTERPRETER, reason="interpreter run of the kernels (CPU only)")
def test_triton_kernels_broadcast_heads(scalar_loop_bounds):
    """K and V shared by all heads (an expanded, stride-0 head dim) read like any other layout."""
    q, dout = torch.randn(1, 3, 20, 16), torch.randn(1, 3, 20, 16)
    k, v = (torch.randn(1, 1, 20, 16).expand(1, 3, 20, 16) for _ in range(2))
    out, lse = A.triton_fwd(q, k, v, True, 0.25)
    grads = A.triton_bwd(dout, q, k, v, out, lse, True, 0.25)
    assert_close((out, lse, *grads), reference(q, k, v, dout, True, 0.25), torch.float32)


@pytest.mark.parametrize("head_d", A.HOPPER_HEAD_DIMS)
def test_dq_fragment_order_is_the_accumulators(head_d):
    """The Gluon backward's dQ tile is stored in its wgmma accumulator's register order (each
    thread's pair, lanes, its other registers, warps): what keeps those stores free of bank
    conflicts. Checked against Triton's own linear layout of the accumulator."""
    from triton._C.libtriton import gluon_ir, ir
    context = ir.context()
    ir.load_dialects(context)
    builder = gluon_ir.GluonOpBuilder(context)
    layout = A._dq_layout(head_d, A.HOPPER_BWD[head_d].num_warps // 4)
    regs = builder.to_linear_layout(layout._to_ir(builder), [A.HOPPER_BWD_ROWS, head_d])
    order = regs.reg_bases[:1] + regs.lane_bases + regs.reg_bases[1:] + regs.warp_bases
    assert A._dq_fragments(head_d).offset_bases == order


@pytest.mark.skipif(not INTERPRETER, reason="interpreter run of the kernels (CPU only)")
@pytest.mark.parametrize("head_d", A.HOPPER_HEAD_DIMS)
def test_dq_from_fragments_puts_tiles_back_in_row_order(head_d):
    """The fp32 dQ buffer, tiles in fragment order, comes back row-major and cast (two heads of
    two tiles)."""
    rows, cols = torch.arange(64).view(-1, 1), torch.arange(head_d).view(1, -1)
    offsets = torch.zeros(64, head_d, dtype=torch.long)  # each element's offset, from the layout's bases
    for bit, (row, col) in enumerate(A._dq_fragments(head_d).offset_bases):
        offsets |= (((rows & row) | (cols & col)) != 0).long() << bit
    offsets, tile = offsets.flatten(), 64 * head_d
    assert torch.equal(offsets.sort().values, torch.arange(tile))  # a permutation of the tile
    dq = torch.randn(1, 2, 2 * 64, head_d)
    buffer = torch.empty(dq.numel() // tile, tile)
    buffer[:, offsets] = dq.view(-1, tile)
    got = A.dq_from_fragments(buffer.view(dq.shape), torch.float16)
    assert got.dtype == torch.float16 and got.shape == dq.shape
    assert torch.equal(got, dq.half())
    assert not torch.equal(buffer.view(dq.shape), dq)  # the order does differ


@pytest.mark.skipif(not INTERPRETER, reason="interpreter run of the kernels (CPU only)")
def test_row_stats_for_the_gluon_backward():
    """Given lse, the delta kernel writes each 64-row tile's lse·log2(e) then its delta."""
    rows = A.HOPPER_BWD_ROWS
    out, dout = (torch.randn(1, 3, 2 * rows, 32) for _ in range(2))
    lse = torch.randn(1, 3, 2 * rows)
    stats = A._delta(out, dout, lse)
    assert stats.shape == (6, 2, rows)
    torch.testing.assert_close(stats[:, 0], (lse * A.LOG2E).view(6, rows))
    torch.testing.assert_close(stats[:, 1], (out * dout).sum(-1).view(6, rows))
    torch.testing.assert_close(A._delta(out, dout), (out * dout).sum(-1))  # without lse: delta alone


# --------------------------------------------------------------------------- empty batch or heads

EMPTY_SHAPES = [(0, 2, 8, 16), (1, 0, 8, 16), (0, 8, 16)]


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_empty_batch_or_heads_through_the_ops(shape):
    """A zero batch or head dim: empty out and lse, and empty gradients, from the op and autograd."""
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    out = A.flash_attention(q, k, v)
    lse = torch.ops.cstack.flash_attention_fwd(q.detach(), k.detach(), v.detach(), True, 0.25)[1]
    assert out.shape == shape and lse.shape == shape[:-1] and lse.dtype == torch.float32
    out.sum().backward()
    assert q.grad.shape == k.grad.shape == v.grad.shape == shape


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_empty_batch_or_heads_triton_launchers(shape):
    """The Triton launchers return empty results instead of failing to build a descriptor or grid."""
    q, k, v, dout = (torch.randn(shape, dtype=torch.float16) for _ in range(4))
    out, lse = A.triton_fwd(q, k, v, True, 0.25)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    grads = A.triton_bwd(dout, q, k, v, out, lse, True, 0.25)
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, k, v)]


@pytest.mark.parametrize("shape", [(0, 2, 128, 128), (1, 0, 128, 128)])
def test_empty_batch_or_heads_hopper_launchers(shape):
    """The Gluon launchers return before any launch (so this runs on the CPU)."""
    q, k, v, dout = (torch.randn(shape, dtype=torch.bfloat16) for _ in range(4))
    out, lse = A.hopper_fwd(q, k, v, True, 0.25)
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    grads = A.hopper_bwd(dout, q, k, v, out, lse, True, 0.25)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# --------------------------------------------------------------------------- bad input


def _qkv(**kw):
    base = dict(q=(1, 2, 8, 16), k=(1, 2, 8, 16), v=(1, 2, 8, 16))
    base.update(kw)
    return [torch.randn(s) if isinstance(s, tuple) else s for s in (base["q"], base["k"], base["v"])]


BAD_FWD = [  # (q, k, v, is_causal, scale), name in the message
    ((*_qkv(k=(1, 3, 8, 16)), True, 0.25), "k"),  # heads differ
    ((*_qkv(k=(2, 2, 8, 16)), True, 0.25), "k"),  # batch differs
    ((*_qkv(k=(1, 2, 8, 32), v=(1, 2, 8, 32)), True, 0.25), "k"),  # head dim differs
    ((*_qkv(v=(1, 2, 9, 16)), False, 0.25), "v"),  # Sk of v != Sk of k
    ((*_qkv(q=(1, 2, 8, 512), k=(1, 2, 8, 512), v=(1, 2, 8, 512)), True, 0.25), "q"),  # D > 256
    ((*_qkv(q=(1, 2, 8, 48), k=(1, 2, 8, 48), v=(1, 2, 8, 48)), True, 0.25), "q"),  # D not a tile size
    ((*_qkv(q=(2, 1, 2, 8, 16)), True, 0.25), "q"),  # rank 5
    ((*_qkv(k=(2, 8, 16)), True, 0.25), "k"),  # rank differs
    ((*_qkv(q=(1, 2, 6, 16)), True, 0.25), "is_causal"),  # causal with Sq != Sk
    ((*_qkv(q=(1, 2, 0, 16), k=(1, 2, 0, 16), v=(1, 2, 0, 16)), False, 0.25), "q"),  # empty
    ((*_qkv(), True, -1.0), "scale"),
    ((*_qkv(), True, float("nan")), "scale"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("args,name", BAD_FWD)
def test_bad_input_fwd(args, name, device):
    """Real (cpu) and fake (meta) implementations both reject the input before any work."""
    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
    with pytest.raises(ValueError, match=f"^{name}:"):
        torch.ops.cstack.flash_attention_fwd(*args)


@pytest.mark.parametrize("which,bad", [
    ("q", lambda t: t.to(torch.int32)),
    ("k", lambda t: t.to(torch.float64)),
    ("k", lambda t: t.to(torch.bfloat16)),
    ("v", lambda t: t.to(torch.float16)),
    ("v", lambda t: t.to("meta")),
])
def test_bad_dtype_or_device(which, bad):
    args = dict(zip("qkv", _qkv()))
    args[which] = bad(args[which])
    with pytest.raises(ValueError, match=f"^{which}:"):
        torch.ops.cstack.flash_attention_fwd(args["q"], args["k"], args["v"], True, 0.25)


def test_bad_input_public_function():
    with pytest.raises(ValueError, match="^q:"):
        A.flash_attention(torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16))
    with pytest.raises(ValueError, match="^is_causal:"):
        A.flash_attention(*_qkv(q=(1, 2, 4, 16)), is_causal=True)
    for scale in ("x", True, [0.5], torch.tensor(0.5)):
        with pytest.raises(ValueError, match="^scale:"):
            A.flash_attention(*_qkv(), scale=scale)
    with pytest.raises(ValueError, match="^scale:"):
        A.flash_attention(*_qkv(), scale=0)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", ["dout", "out", "lse"])
def test_bad_input_bwd(name, device):
    q, k, v = (t.to(device) for t in _qkv())
    args = dict(dout=torch.randn_like(q), out=torch.randn_like(q), lse=torch.randn(q.shape[:-1], device=device))
    args[name] = args[name][..., :5] if name == "lse" else args[name].to(torch.float16)
    with pytest.raises(ValueError, match=f"^{name}:"):
        torch.ops.cstack.flash_attention_bwd(args["dout"], q, k, v, args["out"], args["lse"], True, 0.25)


# --------------------------------------------------------------------------- GPU (Triton kernels compiled)

GPU_CASES = [  # b, h, sq, sk, d, causal, layout
    (2, 4, 1000, 1000, 64, True, "contiguous"),
    (1, 4, 1000, 1000, 128, True, "transposed"),
    (1, 3, 777, 1029, 128, False, "contiguous"),
    (2, 2, 1, 1, 64, True, "contiguous"),
    (1, 2, 1031, 1031, 32, True, "transposed"),
    (1, 2, 513, 513, 256, True, "contiguous"),
    (1, 2, 300, 300, 16, False, "padded"),
    (2, 2, 129, 129, 64, True, "colmajor"),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,sq,sk,d,causal,layout", GPU_CASES)
def test_gpu_matches_reference(b, h, sq, sk, d, causal, layout, dtype):
    q, k, v = make_qkv(b, h, sq, sk, d, dtype, "cuda", layout)
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(d)
    got = run_op(q, k, v, dout, causal, scale)
    ref = reference(q, k, v, dout, causal, scale)
    if sq == 1:
        assert_close((got[0], got[1], got[4]), (ref[0], ref[1], ref[4]), dtype, ("out", "lse", "dv"))
    else:
        assert_close(got, ref, dtype)


HOPPER_CASES = [  # b, h, sq, sk, causal, layout, scale: whole 128-row tiles
    (2, 3, 384, 384, True, "contiguous", None),
    (1, 2, 1024, 1024, True, "transposed", None),
    (2, 3, 256, 256, False, "transposed", None),
    (1, 3, 256, 640, False, "contiguous", None),
    (2, 1, 128, 128, True, "padded", 0.5),  # one key tile; a sharper softmax
    (1, 2, 512, 128, False, "colmajor", None),
]
sm90 = pytest.mark.skipif(not (HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)), reason="needs an sm_90 GPU")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_d", A.HOPPER_HEAD_DIMS)
@pytest.mark.parametrize("b,h,sq,sk,causal,layout,scale", HOPPER_CASES)
def test_gpu_hopper_kernels_match_reference(b, h, sq, sk, causal, layout, scale, head_d, dtype):
    """The Gluon forward and backward, called directly and through the ops (which must choose them)."""
    q, k, v = make_qkv(b, h, sq, sk, head_d, dtype, "cuda", layout)
    dout = torch.randn_like(q)
    scale = scale or 1 / math.sqrt(head_d)
    assert A.uses_hopper_kernels(q, k)
    ref = reference(q, k, v, dout, causal, scale)
    out, lse = A.hopper_fwd(q, k, v, causal, scale)
    assert_close((out, lse), ref[:2], dtype, ("out", "lse"))
    assert_close(A.hopper_bwd(dout, q, k, v, out, lse, causal, scale), ref[2:], dtype, ("dq", "dk", "dv"))
    assert_close(run_op(q, k, v, dout, causal, scale), ref, dtype)


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_hopper_kernels_step_layouts(dtype):
    """The step's mix: q and k dense, v and dO split from [B, S, H·D] projections. v is read in
    place and out and dv come back in its layout; dO is copied dense (its tiles are read once per
    key tile: in place measured slower, docs/decisions.md)."""
    q, k = make_qkv(2, 3, 384, 384, 128, dtype, "cuda")[:2]
    v, dout = (make((2, 3, 384, 128), dtype, "cuda", "transposed") for _ in range(2))
    ref = reference(q, k, v, dout, True, 0.125)
    out, lse = A.hopper_fwd(q, k, v, True, 0.125)
    assert_close((out, lse), ref[:2], dtype, ("out", "lse"))
    grads = A.hopper_bwd(dout, q, k, v, out, lse, True, 0.125)
    assert_close(grads, ref[2:], dtype, ("dq", "dk", "dv"))
    assert_laid_out_like_v(out, *grads, v)


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3), (12, 0), (8, 0), (8, 9)])
def test_dispatch_picks_gluon_on_sm90_only(capability):
    """The Gluon kernels are Hopper-only (wgmma): an sm_90 GPU takes them for the inputs they
    cover, sm_100 (the B200), sm_120 and pre-Hopper GPUs the Triton ones, whose one tile table
    tests/test_gpu_compile.py checks for sm_100 too (CPU only)."""
    hopper = capability == (9, 0)
    assert A.hopper_kernels_accept(capability, 128, torch.bfloat16, 1024, 1024) == hopper
    assert A.hopper_kernels_accept(capability, 128, torch.float16, 256, 640) == hopper
    assert A.hopper_kernels_accept(capability, 64, torch.bfloat16, 16384, 16384) == hopper  # the 2025 row's shape
    for d, dtype, sq, sk in ((32, torch.bfloat16, 1024, 1024), (256, torch.bfloat16, 1024, 1024),
                             (64, torch.float32, 1024, 1024), (128, torch.float32, 1024, 1024),
                             (128, torch.bfloat16, 1000, 1000), (128, torch.float16, 256, 200)):
        assert not A.hopper_kernels_accept(capability, d, dtype, sq, sk), (d, dtype, sq, sk)


@pytest.mark.gpu
@sm90
def test_gpu_hopper_dispatch_and_opcheck():
    """Only D=64/128, 16-bit, whole-tile inputs take the Gluon kernels; both ops pass opcheck on them."""
    take = make_qkv(1, 2, 256, 256, 128, torch.bfloat16, "cuda")
    assert A.uses_hopper_kernels(*take[:2])
    others = [  # sq, sk, d, dtype
        (1000, 1000, 128, torch.bfloat16), (256, 256, 32, torch.bfloat16), (256, 256, 128, torch.float32),
        (256, 200, 128, torch.float16),
    ]
    for sq, sk, d, dtype in others:
        assert not A.uses_hopper_kernels(*make_qkv(1, 2, sq, sk, d, dtype, "cuda")[:2]), (sq, sk, d, dtype)
    q, k, v = take
    torch.library.opcheck(torch.ops.cstack.flash_attention_fwd.default, (q, k, v, True, 0.1))
    out, lse = torch.ops.cstack.flash_attention_fwd(q, k, v, True, 0.1)
    args = (torch.randn_like(out), q, k, v, out, lse, True, 0.1)
    torch.library.opcheck(torch.ops.cstack.flash_attention_bwd.default, args)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_fp32_and_3d(d):
    q, k, v = make_qkv(2, 2, 203, 203, d, torch.float32, "cuda", three_d=True)
    dout = torch.randn_like(q)
    assert_close(run_op(q, k, v, dout, True, 0.1), reference(q, k, v, dout, True, 0.1), torch.float32)


@pytest.mark.gpu
@gpu
def test_gpu_sum_backward_matches_cpu_path():
    """Backward of o.sum() (stride-0 gradient) on the 2025 layout, against the CPU op."""
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 4, 2048, 2048, 64, torch.bfloat16, "cuda", "transposed"))
    A.flash_attention(q, k, v).sum().backward()
    qc, kc, vc = (t.detach().cpu().requires_grad_() for t in (q, k, v))
    A.flash_attention(qc.float(), kc.float(), vc.float()).sum().backward()
    for name, g, r in (("dq", q.grad, qc.grad), ("dk", k.grad, kc.grad), ("dv", v.grad, vc.grad)):
        assert rel_err(g, r) <= TOL[torch.bfloat16], name


def test_flop_formulas_count_causal_attention():
    """The partitioner's runtime estimate needs them: without, recomputing attention looks free."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v = (torch.randn(2, 3, 40, 16, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        A.flash_attention(q, k, v, is_causal=True).sum().backward()
    fwd = 4 * 2 * 3 * 40 * 40 * 16 // 2
    assert counter.get_total_flops() == fwd + 5 * fwd // 2
