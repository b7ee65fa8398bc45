"""One AdamW step over the full 8B model's parameters (bf16): ours vs torch fused, vs the copy floor.

Prints ms and GB/s (7 streams of 2 bytes per parameter: read p, g, m, v; write
p, m, v), the floor that the device copy bandwidth measured in this run sets,
the first-call overhead (pointer tables built) and the host time of a cached
call, and a small (BLOCK, num_warps) sweep. Writes $OUT/bench_adamw.json when
OUT is set. Needs ~61 GiB of GPU memory; about 50 s on an H200.

    PYTHONPATH=. python benchmarks/bench_adamw.py     # from the repository root
"""
import json
import os
import time

import torch
import triton

from benchmarks.results import append_result
from compile_stack.memory_plan.sizes import GIB
from custom_ops import adamw
from custom_ops.adamw import fused_adamw

LAYERS, D, D_FF, VOCAB = 34, 4096, 11008, 151936
BYTES_PER_PARAM = 7 * 2


def model_shapes():
    block = 4 * [(D, D)] + 2 * [(D_FF, D)] + [(D, D_FF)] + 2 * [(D,)]
    return LAYERS * block + [(VOCAB, D), (VOCAB, D), (D,)]


def bench_ms(fn):
    return triton.testing.do_bench(fn, warmup=200, rep=1500, return_mode="median")


def main():
    dev = torch.device("cuda")
    shapes = model_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)

    src = torch.empty(2**30, dtype=torch.bfloat16, device=dev)  # 2 GiB
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * src.nbytes / copy_ms / 1e6
    del src, dst
    floor_ms = BYTES_PER_PARAM * n / copy_gbs / 1e6

    def gbs(ms):
        return BYTES_PER_PARAM * n / ms / 1e6

    params = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) * 1e-2 for s in shapes]
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]
    state = (params, grads, exp_avgs, exp_avg_sqs)
    lr = torch.tensor(1e-5, device=dev)
    step = torch.tensor(1.0, device=dev)

    # Compile the kernel on a tiny set first, so the first full call times the table build only.
    tiny = [[torch.zeros(8, device=dev, dtype=torch.bfloat16)] for _ in range(4)]
    fused_adamw(*tiny, lr=lr, step=step)
    torch.cuda.synchronize()
    adamw._plans.clear()
    t0 = time.perf_counter()
    fused_adamw(*state, lr=lr, step=step)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3

    ours_ms = bench_ms(lambda: fused_adamw(*state, lr=lr, step=step))
    torch.cuda.synchronize()
    calls = 20
    t0 = time.perf_counter()
    for _ in range(calls):
        fused_adamw(*state, lr=lr, step=step)
    host_ms = (time.perf_counter() - t0) * 1e3 / calls  # launch returns before the kernel ends
    torch.cuda.synchronize()

    sweep = []
    for block, num_warps in [(1024, 4), (1024, 8), (2048, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16),
                             (8192, 32)]:
        ms = bench_ms(lambda: adamw._triton_step(*state, lr, step, 0.9, 0.999, 1e-8, 0.01, False,
                                                 block=block, num_warps=num_warps))
        sweep.append({"block": block, "num_warps": num_warps, "ms": ms, "GB/s": gbs(ms)})
    adamw._plans.clear()

    # torch's fused AdamW on the same tensors; its moments are ours, so no second 32 GB of state.
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    for p, m, v in zip(params, exp_avgs, exp_avg_sqs):
        opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=dev), "exp_avg": m, "exp_avg_sq": v}
    torch_ms = bench_ms(opt.step)

    peak_gib = torch.cuda.max_memory_allocated() / GIB
    rows = [
        ("copy floor (7 x 2 B x N / copy bw)", floor_ms),
        ("cstack fused_adamw_ (ours)", ours_ms),
        ("torch.optim.AdamW(fused=True)", torch_ms),
    ]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"params {n:,} bf16 in {len(shapes)} tensors; copy bandwidth {copy_gbs:,.0f} GB/s (2 GiB, read+write)")
    print(f"{'':38s} {'ms':>8s} {'GB/s':>8s} {'of floor':>9s}")
    for name, ms in rows:
        print(f"{name:38s} {ms:8.2f} {gbs(ms):8.0f} {floor_ms / ms:8.1%}")
    print(f"first call (tables built, kernel already compiled): {first_ms:.1f} ms wall, synced")
    print(f"host time of a cached call: {host_ms:.3f} ms")
    print(f"peak GPU memory {peak_gib:.1f} GiB")
    print("sweep (BLOCK, num_warps): " + ", ".join(f"({s['block']},{s['num_warps']}) {s['ms']:.2f}" for s in sweep))

    figures = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "params": n, "tensors": len(shapes), "copy_GBps": copy_gbs, "floor_ms": floor_ms,
        "ours_ms": ours_ms, "ours_GBps": gbs(ours_ms), "torch_fused_ms": torch_ms, "torch_fused_GBps": gbs(torch_ms),
        "first_call_ms": first_ms, "host_ms_cached_call": host_ms, "peak_GiB": peak_gib,
        "block": adamw.BLOCK, "num_warps": adamw.NUM_WARPS, "sweep": sweep,
    }
    append_result(f"AdamW, {n:,} bf16 params, {figures['device']}", f"{ours_ms:.1f} ms",
                  f"torch fused {torch_ms:.1f} ms", extra={"figures": figures})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_adamw.json"), "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
