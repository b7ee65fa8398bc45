"""Compile, on the CPU, the kernels that dispatch runs on one GPU architecture.

    python tests/gpu_compile.py --arch 90   # Hopper: every Triton kernel, and the Gluon kernels
    python tests/gpu_compile.py --arch 100  # Blackwell (B200): every Triton kernel
    ->  one JSON line:
        {"arch": 90, "shared_limit": bytes, "shared": {"<kernel> <config>": bytes, ...},
         "over": [names whose shared memory exceeds shared_limit],
         "spills": {"hopper_bwd <dtype>": bytes of register spill stores per thread, ...}}  (sm_90 only)

Triton's compiler and the ptxas it ships (ptxas-blackwell for sm_100) run without a GPU, so
CPU CI can catch what the interpreter cannot: a kernel that does not compile for a GPU we
cannot run, a tile config whose pipeline needs more shared memory than a block may have, or
a change that makes a Gluon kernel spill registers (their speed hangs on them:
docs/decisions.md). The Gluon kernels are compiled for sm_90 only: they use wgmma, which sm_100
does not have, and dispatch never runs them there (``hopper_kernels_accept``). Run as its own
process because the test session defines the kernels in interpreter mode.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.compiler as tc
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from custom_ops.adamw import configs as adamw_configs  # noqa: E402
from custom_ops.adamw import triton_kernels as adamw_kernels  # noqa: E402
from custom_ops.attention import configs, gluon_backward, gluon_common, gluon_forward, triton_kernels  # noqa: E402
from custom_ops.batched_qr import configs as qr_configs  # noqa: E402
from custom_ops.batched_qr import triton_kernels as qr_kernels  # noqa: E402
from custom_ops.linear_cross_entropy import configs as xent_configs  # noqa: E402
from custom_ops.linear_cross_entropy import triton_kernels as xent_kernels  # noqa: E402
from custom_ops.newton_schulz import configs as ns_configs  # noqa: E402
from custom_ops.newton_schulz import triton_kernels as ns_kernels  # noqa: E402
from custom_ops.rope import configs as rope_configs  # noqa: E402
from custom_ops.rope import triton_kernels as rope_kernels  # noqa: E402

# The most shared memory one thread block may opt into: 227 KiB on sm_90 and on sm_100
# (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability").
SHARED_LIMIT = {90: 232_448, 100: 232_448}
VOCAB = 151_936  # the step's vocabulary (compile_stack/config.py): the row kernel's V is a constexpr


def _options(t: configs.Tiles) -> dict:
    return {"num_warps": t.num_warps, "num_stages": t.num_stages}


def _desc(rows: int, d: int) -> str:
    return f"tensordesc<bf16[1,1,{rows},{d}]>"


def attention_sources(d: int):
    """(name, ASTSource, compile options) of the causal bf16 forward, dK/dV, dQ and delta kernels for head dim d."""
    cfg = configs.CONFIGS[(d, torch.bfloat16)]
    scalars = {"qk_scale": "fp32", "H": "i32", "SQ": "i32", "SK": "i32"}
    for name, fn, outputs in (("fwd", triton_kernels._attn_fwd_kernel, ("o_desc",)),
                              ("dkdv", triton_kernels._attn_bwd_dkdv_kernel, ("dk_desc", "dv_desc")),
                              ("dq", triton_kernels._attn_bwd_dq_kernel, ("dq_desc",))):
        t = getattr(cfg, name)
        sig = {"q_desc": _desc(t.block_m, d), "k_desc": _desc(t.block_n, d), "v_desc": _desc(t.block_n, d)}
        if name != "fwd":
            sig["do_desc"] = _desc(t.block_m, d)
        sig.update({o: _desc(t.block_n if name == "dkdv" else t.block_m, d) for o in outputs})
        sig.update({"LSE": "*fp32"} if name == "fwd" else {"LSE": "*fp32", "DELTA": "*fp32", "scale": "fp32"})
        sig.update(scalars)
        constexprs = {"IS_CAUSAL": True, "HEAD_D": d, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "PREC": "tf32"}
        sig.update({k: "constexpr" for k in constexprs})
        yield f"{name} D{d}", tc.ASTSource(fn=fn, signature=sig, constexprs=constexprs), _options(t)
    yield f"delta D{d}", delta_source(d, configs.DELTA_BLOCK_M, with_lse=False), {}


def delta_source(d: int, rows: int, with_lse: bool):
    """The delta kernel (launched with Triton's default warps and stages); with_lse: the Gluon backward's row stats."""
    constexprs = {"HEAD_D": d, "BLOCK_M": rows, "WITH_LSE": with_lse}
    sig = {"o_desc": _desc(rows, d), "do_desc": _desc(rows, d), "LSE": "*fp32", "DELTA": "*fp32", "H": "i32",
           "SQ": "i32", **{k: "constexpr" for k in constexprs}}
    return tc.ASTSource(fn=triton_kernels._attn_bwd_delta_kernel, signature=sig, constexprs=constexprs)


def row_kernel_sources():
    """(name, ASTSource, compile options) of the fused cross-entropy's row kernel (bf16 logits, the step's
    vocabulary) and of the AdamW kernel (bf16 params and states), at their launch configs."""
    block_v = xent_configs.block_v_for(VOCAB)
    constexprs = {"V": VOCAB, "BLOCK_V": block_v}
    sig = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "loss_ptr": "*fp32", "scale_ptr": "*fp32",
           "flag_ptr": "*i32", "ignore_index": "i32", **{k: "constexpr" for k in constexprs}}
    yield (f"xent_rows V{VOCAB}", tc.ASTSource(fn=xent_kernels._xent_rows_kernel, signature=sig, constexprs=constexprs),
           {"num_warps": xent_configs.num_warps_for(block_v)})
    bf16 = adamw_kernels._TL_DTYPES[torch.bfloat16]
    constexprs = {"P_DTYPE": bf16, "G_DTYPE": bf16, "M_DTYPE": bf16, "V_DTYPE": bf16, "TORCH_SEMANTICS": True,
                  "BLOCK": adamw_configs.BLOCK}
    sig = {"table_ptr": "*i64", "block_tensor_ptr": "*i32", "lr_ptr": "*fp32", "step_ptr": "*fp32",
           "flag_ptr": "*i32", "targets_flag_ptr": "*i32",
           **{k: "fp32" for k in ("beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "log_beta1", "log_beta2",
                                  "eps", "weight_decay")},
           **{k: "constexpr" for k in constexprs}}
    yield ("adamw bf16", tc.ASTSource(fn=adamw_kernels._adamw_kernel, signature=sig, constexprs=constexprs),
           {"num_warps": adamw_configs.NUM_WARPS})


def rope_sources():
    """(name, ASTSource, compile options) of the RoPE kernel at D=128 in bf16: each pairing, both
    directions, half-width tables, and HF's full-width ones."""
    sig = {**{k: "*bf16" for k in ("src", "cos", "sin", "dst")}, **{k: "i32" for k in ("n_rows", "n1", "n2")},
           **{f"{t}_s{i}": "i64" for t in ("src", "cos", "sin") for i in range(3)}}
    variants = [(i, o, inv, False) for i in (False, True) for o in (False, True) for inv in (False, True)]
    for interleaved_in, interleaved_out, inverse, full in variants + [(False, False, False, True)]:
        constexprs = {"HALF": 64, "FULL_TABLE": full, "INTERLEAVED_IN": interleaved_in,
                      "INTERLEAVED_OUT": interleaved_out, "INVERSE": inverse, "BLOCK": rope_configs.BLOCK_ROWS}
        name = f"rope in{'I' if interleaved_in else 'H'} out{'I' if interleaved_out else 'H'}" \
               f"{' inverse' if inverse else ''}{' full' if full else ''}"
        signature = {**sig, **{k: "constexpr" for k in constexprs}}
        yield (name, tc.ASTSource(fn=rope_kernels._rope_kernel, signature=signature, constexprs=constexprs),
               {"num_warps": rope_configs.NUM_WARPS})


def newton_schulz_sources():
    """(name, ASTSource, compile options) of the Newton–Schulz kernels at their launch tiles, bf16: the
    symmetric product of X (row-major, and column-major read in place: XT) and of A with the
    polynomial's epilogue, and the update's GEMM (both layouts of X)."""
    s, g = ns_configs.TILES.syrk, ns_configs.TILES.gemm

    def desc(rows: int, cols: int, transposed: bool = False) -> str:  # as _Stacked.desc makes them
        return f"tensordesc<bf16[{cols},{rows}]>" if transposed else f"tensordesc<bf16[{rows},{cols}]>"

    for label, has_s, xt in (("X Xᵀ", False, False), ("X Xᵀ XT", False, True), ("bA + cA²", True, False)):
        constexprs = {"XT": xt, "HAS_S": has_s, "BLOCK": s.block, "SPLIT": s.split, "BLOCK_K": s.block_k,
                      "PREC": "tf32", **({} if has_s else {"s_desc": None})}
        sig = {"x_desc": desc(s.block, s.block_k, xt), "xc_desc": desc(s.split * s.block, s.block_k, xt),
               "s_desc": desc(s.block, s.split * s.block) if has_s else "constexpr",
               "out_desc": desc(s.block, s.block), "alpha": "fp32", "beta": "fp32", "ROWS": "i32", "K": "i32",
               **{k: "constexpr" for k in constexprs if k != "s_desc"}}
        yield (f"ns_syrk {label}", tc.ASTSource(fn=ns_kernels._syrk_kernel, signature=sig, constexprs=constexprs),
               {"num_warps": s.num_warps, "num_stages": s.num_stages})
    for xt in (False, True):
        constexprs = {"XT": xt, "BLOCK_M": g.block_m, "BLOCK_N": g.block_n, "BLOCK_K": g.block_k,
                      "GROUP_M": g.group_m, "PREC": "tf32"}
        sig = {"b_desc": desc(g.block_m, g.block_k), "x_desc": desc(g.block_k, g.block_n, xt),
               "xe_desc": desc(g.block_m, g.block_n, xt), "out_desc": desc(g.block_m, g.block_n), "a": "fp32",
               "ROWS": "i32", "N": "i32", **{k: "constexpr" for k in constexprs}}
        yield (f"ns_gemm{' XT' if xt else ''}", tc.ASTSource(fn=ns_kernels._gemm_kernel, signature=sig,
                                                                constexprs=constexprs),
               {"num_warps": g.num_warps, "num_stages": g.num_stages})


def batched_qr_sources():
    """(name, ASTSource, compile options) of the batched QR's kernels at their largest launch shapes:
    the whole-matrix tile (forming Q and R, or geqrf's form), the register panel, the streamed panel
    and the apply kernel (to the trailing columns, and backwards to form Q)."""
    cfg = qr_configs.DEFAULT
    ints = {k: "i32" for k in ("m", "n", "k", "k0", "nref", "blk", "nblocks")}
    tile = {"src_ptr": "*fp32", "a_ptr": "*fp32", "tau_ptr": "*fp32", "t_ptr": "*fp32", "q_ptr": "*fp32",
            "r_ptr": "*fp32", **ints}
    side = int(cfg.tile_max ** 0.5)
    for name, rows, cols, want in (("qr_tile Q,R", side, side, "Q"), ("qr_tile geqrf", side, side, "A"),
                                   ("qr_panel", cfg.panel_max // cfg.nb, cfg.nb, "AT")):
        constexprs = {"ROWS": rows, "COLS": cols, "WANT_A": "A" in want, "WANT_T": "T" in want,
                      "WANT_Q": "Q" in want, "PRECISION": cfg.precision}
        yield (f"{name} {rows}x{cols}", tc.ASTSource(fn=qr_kernels._tile_kernel, signature={
            **tile, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs),
            {"num_warps": qr_configs.tile_warps(rows * cols)})
    constexprs = {"NB": cfg.nb, "BM": cfg.stream_bm, "PRECISION": cfg.precision}
    sig = {"a_ptr": "*fp32", "tau_ptr": "*fp32", "t_ptr": "*fp32", **ints, **{k: "constexpr" for k in constexprs}}
    yield ("qr_panel_stream", tc.ASTSource(fn=qr_kernels._panel_stream_kernel, signature=sig, constexprs=constexprs),
           {"num_warps": cfg.stream_warps})
    for trans_t in (True, False):
        constexprs = {"NB": cfg.nb, "BM": cfg.bm, "BN": cfg.bn, "TRANS_T": trans_t, "PRECISION": cfg.precision}
        sig = {"a_ptr": "*fp32", "t_ptr": "*fp32", "c_ptr": "*fp32", **{k: "i32" for k in (
            "m", "n", "k0", "nref", "blk", "nblocks", "ldc", "col0", "col1")}, **{k: "constexpr" for k in constexprs}}
        yield (f"qr_apply{' Tᵀ' if trans_t else ''}", tc.ASTSource(fn=qr_kernels._apply_kernel, signature=sig,
                                                                   constexprs=constexprs),
               {"num_warps": cfg.apply_warps})


def _gluon_desc(rows: int, dtype: torch.dtype, d: int) -> str:
    return mangle_type(gluon_common._rows_desc(torch.empty(512, d, dtype=dtype), rows))


def hopper_sources():
    """(name, source, compile options) of the Gluon forward and backward for each head dim they take
    (causal bf16 with v, and the backward's dO, heads-major and sequence-major, non-causal fp16), and of the two Triton
    kernels only their path runs: the row-stats delta and the dQ cast."""
    fwd = configs.HOPPER_FWD
    for d, bwd in configs.HOPPER_BWD.items():
        for dtype, causal, v_seq in ((torch.bfloat16, True, False), (torch.bfloat16, True, True),
                                     (torch.float16, False, False)):
            tma_epilogue = configs.HOPPER_BWD_TMA_EPILOGUE[d]
            dkdv = _gluon_desc(bwd.block_n, dtype, d) if tma_epilogue else mangle_type(torch.empty(0, dtype=dtype))
            kernels = {
                "hopper_fwd": (gluon_forward._attn_fwd_hopper_kernel, fwd, {
                    "q_desc": _gluon_desc(fwd.block_m, dtype, d), "k_desc": _gluon_desc(fwd.block_n, dtype, d),
                    "v_desc": _gluon_desc(fwd.block_n, dtype, d), "o_desc": _gluon_desc(fwd.block_m // 2, dtype, d),
                    "LSE": "*fp32", "qk_scale": "fp32", "SQ": "i32", "SK": "i32",
                }, {"COMPUTE_REGS": configs.HOPPER_FWD_COMPUTE_REGS}),
                "hopper_bwd": (gluon_backward._attn_bwd_hopper_kernel, bwd, {
                    "q_desc": _gluon_desc(bwd.block_m, dtype, d), "k_desc": _gluon_desc(bwd.block_n, dtype, d),
                    "v_desc": _gluon_desc(bwd.block_n, dtype, d), "do_desc": _gluon_desc(bwd.block_m, dtype, d),
                    "dq_desc": mangle_type(gluon_backward._fragments_desc(torch.empty(512, d))),
                    "DK": dkdv, "DV": dkdv,
                    "STATS": "*fp32", "qk_scale": "fp32", "scale": "fp32", "SQ": "i32", "SK": "i32",
                }, {"PEEL_DIAGONAL": causal and configs.HOPPER_BWD_PEEL_DIAGONAL[d], "TMA_EPILOGUE": tma_epilogue,
                    "DO_SEQUENCE_MAJOR": v_seq, "num_warps": bwd.num_warps}),
            }
            for name, (fn, t, sig, extra) in kernels.items():
                constexprs = {"IS_CAUSAL": causal, "HEAD_D": d, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n,
                              "STAGES": t.num_stages, "V_SEQUENCE_MAJOR": v_seq, **extra}
                sig.update({k: "constexpr" for k in constexprs})
                yield (f"{name} {str(dtype)[6:]}{' v sequence-major' if v_seq else ''}{'' if d == 128 else f' D{d}'}",
                       GluonASTSource(fn=fn, signature=sig, constexprs=constexprs), _options(t))
        yield f"delta_stats D{d}", delta_source(d, configs.HOPPER_BWD_ROWS, with_lse=True), {}
        yield (f"dq_from_fragments bf16 D{d}",
               tc.ASTSource(fn=gluon_backward._attn_dq_from_fragments_kernel,
                            signature={"ACC": "*fp32", "DQ": "*bf16", "HEAD_D": "constexpr"}, constexprs={"HEAD_D": d}),
               {"num_warps": 8})  # as dq_from_fragments launches it


PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def spill_bytes(ptx: str) -> int:
    """Bytes of register spill stores per thread that ptxas reports for ``ptx`` on sm_90a."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_LIMIT), required=True,
                        help="compute capability major·10 + minor: 90 (H100/H200) or 100 (B200)")
    arch = parser.parse_args().arch
    sources = [s for d in configs.HEAD_DIMS for s in attention_sources(d)] + [
        *row_kernel_sources(), *newton_schulz_sources(), *batched_qr_sources(), *rope_sources()]
    if arch == 90:
        sources += hopper_sources()
    shared, spills = {}, {}
    for name, src, options in sources:
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        shared[name] = kernel.metadata.shared
        if name.startswith("hopper"):
            spills[name] = spill_bytes(kernel.asm["ptx"])
    over = sorted(name for name, n in shared.items() if n > SHARED_LIMIT[arch])
    print(json.dumps({"arch": arch, "shared_limit": SHARED_LIMIT[arch], "shared": shared, "over": over,
                      "spills": spills}))


if __name__ == "__main__":
    main()
