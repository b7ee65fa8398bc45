"""Compile the attention kernels of the 16-bit tile table, and the Gluon forward and backward,
for Hopper (sm_90) on the CPU.

    python tests/sm90_compile.py  ->  one JSON line:
        {"shared": {"<kernel> D<d>": bytes, ..., "hopper_bwd <dtype>": bytes, "hopper_fwd <dtype>": bytes},
         "spills": {"hopper_bwd <dtype>": bytes of register spill stores per thread, "hopper_fwd <dtype>": ...}}

Triton's compiler and the ptxas it ships run without a GPU, so CPU CI can catch what the
interpreter cannot: a kernel that does not compile for the GPU, a tile config whose
pipeline needs more shared memory than an SM has, or a change that makes a Gluon kernel
spill registers (their speed hangs on them: BENCHMARKS.md). Run as its own process
because the test session defines the kernels in interpreter mode.
"""
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
from custom_ops.attention import configs, gluon_kernels, triton_kernels  # noqa: E402


def _desc(rows: int, d: int) -> str:
    return f"tensordesc<bf16[1,1,{rows},{d}]>"


def kernel_sources(d: int):
    """(name, ASTSource, tiles) of the causal bf16 forward, dK/dV and dQ kernels for head dim d."""
    cfg = configs.CONFIGS[(d, torch.bfloat16)]
    scalars = {"qk_scale": "fp32", "H": "i32", "SQ": "i32", "SK": "i32"}
    for name, fn, outputs in (("fwd", triton_kernels._attn_fwd_kernel, ("O",)),
                              ("dkdv", triton_kernels._attn_bwd_dkdv_kernel, ("DK", "DV")),
                              ("dq", triton_kernels._attn_bwd_dq_kernel, ("DQ",))):
        t = getattr(cfg, name)
        sig = {"q_desc": _desc(t.block_m, d), "k_desc": _desc(t.block_n, d), "v_desc": _desc(t.block_n, d)}
        if name != "fwd":
            sig["do_desc"] = _desc(t.block_m, d)
        sig.update({o: "*bf16" for o in outputs})
        sig.update({"LSE": "*fp32"} if name == "fwd" else {"LSE": "*fp32", "DELTA": "*fp32", "scale": "fp32"})
        sig.update(scalars)
        constexprs = {"IS_CAUSAL": True, "HEAD_D": d, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n, "PREC": "tf32"}
        sig.update({k: "constexpr" for k in constexprs})
        yield name, tc.ASTSource(fn=fn, signature=sig, constexprs=constexprs), t


def _gluon_desc(rows: int, dtype: torch.dtype) -> str:
    return mangle_type(gluon_kernels._rows_desc(torch.empty(512, 128, dtype=dtype), rows))


def gluon_sources():
    """(name, GluonASTSource, tiles) of the Gluon forward and backward: causal bf16 and non-causal fp16."""
    fwd, bwd = configs.HOPPER_FWD, configs.HOPPER_BWD
    for dtype, causal in ((torch.bfloat16, True), (torch.float16, False)):
        tensor = mangle_type(torch.empty(0, dtype=dtype))
        kernels = {
            "hopper_fwd": (gluon_kernels._attn_fwd_hopper_kernel, fwd, {
                "q_desc": _gluon_desc(fwd.block_m, dtype), "k_desc": _gluon_desc(fwd.block_n, dtype),
                "v_desc": _gluon_desc(fwd.block_n, dtype), "o_desc": _gluon_desc(fwd.block_m // 2, dtype),
                "LSE": "*fp32", "qk_scale": "fp32", "SQ": "i32", "SK": "i32",
            }, {"COMPUTE_REGS": configs.HOPPER_FWD_COMPUTE_REGS}),
            "hopper_bwd": (gluon_kernels._attn_bwd_hopper_kernel, bwd, {
                "q_desc": _gluon_desc(bwd.block_m, dtype), "k_desc": _gluon_desc(bwd.block_n, dtype),
                "v_desc": _gluon_desc(bwd.block_n, dtype), "do_desc": _gluon_desc(bwd.block_m, dtype),
                "dq_desc": mangle_type(gluon_kernels._fragments_desc(torch.empty(512, 128))),
                "DK": tensor, "DV": tensor,
                "STATS": "*fp32", "qk_scale": "fp32", "scale": "fp32", "SQ": "i32", "SK": "i32",
            }, {"num_warps": bwd.num_warps}),
        }
        for name, (fn, t, sig, extra) in kernels.items():
            constexprs = {"IS_CAUSAL": causal, "HEAD_D": 128, "BLOCK_M": t.block_m, "BLOCK_N": t.block_n,
                          "STAGES": t.num_stages, **extra}
            sig.update({k: "constexpr" for k in constexprs})
            yield f"{name} {str(dtype)[6:]}", GluonASTSource(fn=fn, signature=sig, constexprs=constexprs), t


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
    shared, spills = {}, {}
    sources = [(f"{name} D{d}", src, t) for d in configs.HEAD_DIMS for name, src, t in kernel_sources(d)]
    for name, src, t in sources + list(gluon_sources()):
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": t.num_warps, "num_stages": t.num_stages})
        shared[name] = kernel.metadata.shared
        if name.startswith("hopper"):
            spills[name] = spill_bytes(kernel.asm["ptx"])
    print(json.dumps({"shared": shared, "spills": spills}))


if __name__ == "__main__":
    main()
