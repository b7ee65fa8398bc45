"""Time our FlashAttention against torch SDPA (flash and cuDNN backends) on one GPU.

    python benchmarks/bench_attention.py [--shapes a,r,b] [--sweep]

Shapes (causal, bf16): a = B2 H32 S32768 D128 (the 8B model), r = B1 H32 S32768 D128 (one
rank's share of it on two GPUs), b = B1 H16 S16384 D64 (the 2025 FlashAttention row; backward
of o.sum()). For each: forward, backward and
forward+backward in ms and TFLOP/s (causal fwd FLOPs = 4*B*H*S^2*D/2, bwd = 2.5x, fwd+bwd
= 3.5x), peak memory of fwd+bwd, the ratio ours/cuDNN, a relative-error check of ours
against SDPA, and each of our forward and backward paths alone (the Triton kernels; on Hopper
at D=64 and D=128 also the Gluon kernels the ops then run). --sweep also times a few candidate
tile configs for each of our Triton kernels and prints the best, to choose the entries of
custom_ops.attention.CONFIGS. Writes $OUT/bench_attention.json when OUT is set.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import asdict, replace

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from compile_stack.memory_plan.sizes import GIB  # noqa: E402
from custom_ops import attention as A  # noqa: E402
from custom_ops.attention import Tiles  # noqa: E402
from benchmarks.results import append_result  # noqa: E402

SHAPES = {"a": (2, 32, 32768, 128), "r": (1, 32, 32768, 128), "b": (1, 16, 16384, 64)}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

# Candidates for --sweep: (block_m, block_n, num_warps, num_stages). For dkdv block_m is the query
# tile and block_n the key tile each program owns; for fwd and dq the reverse.
SWEEP = {
    128: dict(
        fwd=[(256, 64, 8, 3), (256, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 3), (256, 32, 8, 3)],
        dkdv=[(64, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 4), (32, 128, 8, 3), (64, 64, 4, 3)],
        dq=[(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3)],
    ),
    64: dict(
        fwd=[(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (256, 64, 8, 3), (128, 128, 8, 3)],
        dkdv=[(32, 128, 4, 3), (32, 64, 4, 3), (32, 128, 4, 4), (64, 128, 4, 3), (32, 64, 4, 4), (64, 128, 8, 3),
              (16, 64, 4, 3), (32, 128, 8, 3)],
        dq=[(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 4), (64, 32, 4, 3), (128, 32, 4, 3)],
    ),
}


def bench(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def fwd_flops(b, h, s, d):
    return 4 * b * h * s * s * d / 2


def sdpa(q, k, v, backend):
    with sdpa_kernel(BACKENDS[backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_impl(name, q, k, v, dout):
    """fwd, bwd, fwd+bwd (ms) and fwd+bwd peak memory (GiB) of one implementation."""
    scale = 1 / math.sqrt(q.shape[-1])
    if name == "ours":
        def forward():
            return A.flash_attention(q, k, v, is_causal=True, scale=scale)
    else:
        def forward():
            return sdpa(q, k, v, name)
    with torch.no_grad():
        t_fwd = bench(forward)
    out = forward()
    t_bwd = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    del out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t_all = bench(lambda: torch.autograd.grad(forward().sum(), (q, k, v)))
    peak = (torch.cuda.max_memory_allocated() - base) / GIB
    return dict(fwd_ms=t_fwd, bwd_ms=t_bwd, fwd_bwd_ms=t_all, peak_gib=peak)


def check(q, k, v):
    """Relative errors of our out, dq, dk, dv against the cuDNN SDPA (same inputs, o.sum())."""
    errs = {}
    for name in ("ours", "cudnn"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = A.flash_attention(qq, kk, vv) if name == "ours" else sdpa(qq, kk, vv, name)
        o.sum().backward()
        errs[name] = (o.detach(), qq.grad, kk.grad, vv.grad)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    return {n: rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), errs["ours"], errs["cudnn"])}


def kernel_paths(q, k, v, dout):
    """Each CUDA forward and backward path alone on the same inputs (ms): the Triton kernels, and
    the Gluon kernels where they apply (what the ops run then)."""
    scale = 1 / math.sqrt(q.shape[-1])
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = A.triton_fwd(qd, kd, vd, True, scale)
    forward = {"triton_fwd": A.triton_fwd}
    backward = {"triton_bwd": A.triton_bwd}
    if A.uses_hopper_kernels(qd, kd):
        forward["hopper_fwd"] = A.hopper_fwd
        backward["hopper_bwd"] = A.hopper_bwd
    times = {name: bench(lambda: fn(qd, kd, vd, True, scale)) for name, fn in forward.items()}
    times.update({name: bench(lambda: fn(dout, qd, kd, vd, out, lse, True, scale)) for name, fn in backward.items()})
    return times


def sweep(q, k, v, dout):
    """Time each candidate tile config of fwd, dK/dV and dQ on its own; returns all figures."""
    d = q.shape[-1]
    scale = 1 / math.sqrt(d)
    base = A.pick_config(d, q.dtype)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = A.triton_fwd(qd, kd, vd, True, scale)
    result = {}
    for stage, cands in SWEEP[d].items():
        rows = []
        for cand in cands:
            cfg = replace(base, **{stage: Tiles(*cand)})
            if stage == "fwd":
                fn = lambda: A.triton_fwd(qd, kd, vd, True, scale, cfg)  # noqa: E731
            else:
                fn = lambda: A.triton_bwd(dout, qd, kd, vd, out, lse, True, scale, cfg)  # noqa: E731
            try:
                ms = bench(fn, rep=50)
            except Exception as e:  # a candidate may not fit in shared memory or registers
                print(f"  {stage} {cand}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append((ms, cand))
            print(f"  {stage:5s} {str(cand):20s} {ms:8.3f} ms ({'fwd' if stage == 'fwd' else 'whole bwd'})")
        best = min(rows)
        print(f"  best {stage}: {best[1]} at {best[0]:.3f} ms")
        result[stage] = [dict(tiles=c, ms=ms) for ms, c in rows]
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="a,b", help=f"comma-separated keys of {sorted(SHAPES)} (default: a,b)")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    unknown = [key for key in args.shapes.split(",") if key not in SHAPES]
    if unknown:
        parser.error(f"--shapes: expected keys of {sorted(SHAPES)}, got {unknown}")
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "shapes": {}}
    table = []
    for key in args.shapes.split(","):
        b, h, s, d = SHAPES[key]
        print(f"== shape {key}: B{b} H{h} S{s} D{d} causal bf16; config {A.pick_config(d, torch.bfloat16)}")
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        entry = {"config": asdict(A.pick_config(d, torch.bfloat16)), "rel_err_vs_cudnn": check(q, k, v)}
        print("  rel err vs cuDNN:", {n: f"{e:.2e}" for n, e in entry["rel_err_vs_cudnn"].items()})
        flops = fwd_flops(b, h, s, d)
        for name in ("ours", "flash", "cudnn"):
            r = time_impl(name, q, k, v, dout)
            r.update(fwd_tflops=flops / r["fwd_ms"] * 1e-9, bwd_tflops=2.5 * flops / r["bwd_ms"] * 1e-9,
                     fwd_bwd_tflops=3.5 * flops / r["fwd_bwd_ms"] * 1e-9)
            entry[name] = r
            table.append((key, name, r))
        entry["ours_over_cudnn_fwd_bwd"] = entry["ours"]["fwd_bwd_ms"] / entry["cudnn"]["fwd_bwd_ms"]
        entry["kernel_paths_ms"] = kernel_paths(q, k, v, dout)
        print("  kernel paths alone (ms):", {n: round(ms, 2) for n, ms in entry["kernel_paths_ms"].items()})
        if args.sweep:
            entry["sweep"] = sweep(q, k, v, dout)
        report["shapes"][key] = entry
        ours, cudnn = entry["ours"], entry["cudnn"]
        append_result(f"attention, B{b} H{h} S{s} D{d} causal bf16, {report['device']}",
                      f"fwd {ours['fwd_ms']:.1f} ms, bwd {ours['bwd_ms']:.1f} ms",
                      f"cuDNN {cudnn['fwd_ms']:.1f} / {cudnn['bwd_ms']:.1f} ms", extra={"figures": entry})
        del q, k, v, dout
        torch.cuda.empty_cache()

    print(f"\n{'shape':5s} {'impl':6s} {'fwd ms':>8s} {'TF/s':>6s} {'bwd ms':>8s} {'TF/s':>6s} "
          f"{'f+b ms':>8s} {'TF/s':>6s} {'peak GiB':>9s}")
    for key, name, r in table:
        print(f"{key:5s} {name:6s} {r['fwd_ms']:8.3f} {r['fwd_tflops']:6.0f} {r['bwd_ms']:8.3f} {r['bwd_tflops']:6.0f} "
              f"{r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_tflops']:6.0f} {r['peak_gib']:9.2f}")
    for key, entry in report["shapes"].items():
        print(f"shape {key}: ours/cuDNN fwd+bwd = {entry['ours_over_cudnn_fwd_bwd']:.2f}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_attention.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
