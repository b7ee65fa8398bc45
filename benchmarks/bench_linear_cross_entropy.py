"""Fused LM head + cross-entropy, forward+backward, against its floor and the naive version.

Rows (all forward+backward, bf16, timed in this run):
  fused        cstack.linear_cross_entropy (default chunking, or each --sweep size)
  chunked mm   the fused op's chunk loop with the row kernel left out (matmuls + glue)
  floor        the three matmuls alone, unchunked: h@Wᵀ, G@W, Gᵀ@h
  naive        logits → hand-written log-softmax → gather → mean, torch.compile'd
               (at --naive-tokens, T/4 by default: at full T it needs ~20 GB of
               logits per intermediate; out-of-memory is caught and reported)

FLOPs are 6·T·d·V; "vs floor" is floor TFLOP/s over the row's TFLOP/s. Extra memory is
the peak of max_memory_allocated above the inputs, minus the returned gradients.

    python benchmarks/bench_linear_cross_entropy.py                 # full: T=65536 d=4096 V=151936
    python benchmarks/bench_linear_cross_entropy.py --tokens 8192 --sweep 1024,2048,4096,8192
"""
import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compile_stack.memory_plan.sizes import GIB  # noqa: E402
from custom_ops.linear_cross_entropy import (  # noqa: E402
    chunk_tokens,
    chunk_tokens_for,
    fwd_chunked,
    linear_cross_entropy,
)
from benchmarks.results import append_result  # noqa: E402


def naive_loss(hidden, weight, targets):
    """The reference model's head: full logits and a hand-written log-softmax, in bf16."""
    logits = hidden @ weight.T
    z = logits - logits.amax(-1, keepdim=True)
    logp = z - z.exp().sum(-1, keepdim=True).log()
    return -logp.gather(-1, targets[:, None]).mean()


def measure(step, leaves, out_bytes):
    """(median ms, peak extra GiB) of step(); leaves' .grad are reset between runs."""
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base - out_bytes) / GIB
    ms = triton.testing.do_bench(step, warmup=1, rep=2000, grad_to_none=leaves, return_mode="median")
    for t in leaves:
        t.grad = None
    return ms, extra


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=65_536)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--naive-tokens", type=int, default=None, help="T for the naive row (default T/4)")
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--sweep", default="", help="comma-separated chunk sizes (tokens) to time as well")
    args = p.parse_args()
    T, d, V = args.tokens, args.d, args.vocab
    naive_T = args.naive_tokens or max(1, T // 4)
    dev = "cuda"
    torch.manual_seed(0)

    hidden = torch.randn(T, d, device=dev, dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, d, device=dev) * 2 / d**0.5).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (T,), device=dev)
    out_bytes = (hidden.numel() + weight.numel()) * 2
    rows = []

    def add(name, tokens, ms, extra, note=""):
        tflops = 6 * tokens * d * V / (ms * 1e-3) / 1e12 if ms else None
        rows.append({"name": name, "tokens": tokens, "ms": ms, "tflops": tflops, "extra_gib": extra, "note": note})

    # floor: the three matmuls alone, unchunked, into preallocated outputs
    logits = torch.empty(T, V, device=dev, dtype=torch.bfloat16)
    gh = torch.empty_like(hidden)
    gw = torch.empty_like(weight)
    h, w = hidden.detach(), weight.detach()

    def floor():
        torch.mm(h, w.t(), out=logits)
        torch.mm(logits, w, out=gh)
        torch.mm(logits.t(), h, out=gw)

    floor()
    floor_ms = triton.testing.do_bench(floor, warmup=1, rep=2000, return_mode="median")
    add("floor (3 mm)", T, floor_ms, None, "unchunked, preallocated")
    del logits, gh, gw

    default_chunk = chunk_tokens_for(T, V, 2)

    def fused():
        linear_cross_entropy(hidden, weight, targets).backward()

    ms, extra = measure(fused, [hidden, weight], out_bytes)
    add("fused", T, ms, extra, f"chunk {default_chunk}")

    def chunked_mm():
        fwd_chunked(h, w, targets, -100, "mean", lambda *a: None)

    ms, extra = measure(chunked_mm, [], out_bytes)
    add("chunked mm", T, ms, extra, f"chunk {default_chunk}, no row kernel")

    for n in [int(x) for x in args.sweep.split(",") if x]:
        with chunk_tokens(n):
            ms, extra = measure(fused, [hidden, weight], out_bytes)
        add("fused", T, ms, extra, f"chunk {n}")

    if not args.skip_naive:
        nh = hidden.detach()[:naive_T].clone().requires_grad_()
        nw = weight.detach().clone().requires_grad_()
        nt = targets[:naive_T]
        compiled = torch.compile(naive_loss)

        def naive():
            compiled(nh, nw, nt).backward()

        note = f"torch.compile, T={naive_T}" + (" (T/4)" if naive_T * 4 == T else "")
        try:
            ms, extra = measure(naive, [nh, nw], (nh.numel() + nw.numel()) * 2)
            add("naive", naive_T, ms, extra, note)
        except torch.OutOfMemoryError:
            add("naive", naive_T, None, None, note + ": out of memory")
        del nh, nw

    floor_tflops = rows[0]["tflops"]
    print(f"\nlinear+cross-entropy fwd+bwd, bf16, d={d} V={V} T={T}  ({torch.cuda.get_device_name()})")
    print(f"{'row':<12} {'T':>7} {'ms':>9} {'TFLOP/s':>8} {'vs floor':>9} {'extra GiB':>10}  note")
    for r in rows:
        ms = f"{r['ms']:.2f}" if r["ms"] else "-"
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        ratio = f"{floor_tflops / r['tflops']:.3f}x" if r["tflops"] else "-"
        r["vs_floor"] = floor_tflops / r["tflops"] if r["tflops"] else None
        ex = f"{r['extra_gib']:.2f}" if r["extra_gib"] is not None else "-"
        print(f"{r['name']:<12} {r['tokens']:>7} {ms:>9} {tf:>8} {ratio:>9} {ex:>10}  {r['note']}")
    print("targets: fused <= 1.10x floor, <= 2 GiB extra")
    fused_row = rows[1]
    append_result(f"LM head + CE, T {T:,}, d {d:,}, V {V:,}, {torch.cuda.get_device_name()}",
                  f"{fused_row['ms']:.1f} ms, {fused_row['vs_floor']:.3f}× the three-matmul floor, "
                  f"{fused_row['extra_gib']:.2f} GiB extra", f"floor {floor_ms:.1f} ms", extra={"rows": rows})

    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "bench_linear_cross_entropy.json")
        with open(path, "w") as f:
            json.dump({"T": T, "d": d, "V": V, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
