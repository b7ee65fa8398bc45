"""Hugging Face Llama, unedited, at Llama-3-8B widths: our ``compile_step`` against stock
``torch.compile`` of the same step and against Liger-Kernel (``apply_liger_kernel_to_llama`` +
``torch.compile``), step time and peak memory, on one GPU.

The model: ``LlamaForCausalLM`` of ``LlamaConfig(hidden 4096, 32 heads, 8 KV heads, FFN 14336,
vocabulary 128256)`` with ``--layers`` layers (4), bf16 weights, ``torch.optim.AdamW``, random
tokens, the step ``loss = model(ids, labels=ids).loss; loss.backward(); opt.step();
opt.zero_grad()`` as a user writes it. Each (variant, tokens) runs in a process of its own
(Liger patches transformers' classes for the process; peaks are not shared). Step time is the
median of ``--steps`` steps after ``--warmup`` (CUDA events); peak memory is
``max_memory_allocated`` over the timed steps. A variant out of memory is reported as such.

transformers is the machine's; when missing, and Liger-Kernel when missing, they are installed
offline from ``.device/wheels`` (``pip download liger-kernel --no-deps -d .device/wheels``;
transformers and the pure-Python packages it needs in ``.device/wheels/hf``) into a temporary folder.

    python benchmarks/bench_hf.py --log-dir $OUT/bench_hf --json $OUT/bench_hf.json
    python benchmarks/bench_hf.py --tokens 8192 --variants ours,liger --steps 5
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".device" / "wheels"
VARIANTS = ("ours", "stock", "liger")
SIZES = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
             vocab_size=128256)


def ensure(module: str, wheels: list[Path], site: Path) -> None:
    """Import ``module``, installing ``wheels`` offline into ``site`` first if it is missing."""
    if site.is_dir() and str(site) not in sys.path:  # installed there by an earlier process
        sys.path.insert(0, str(site))
    try:
        __import__(module)
        return
    except ImportError:
        pass
    if not wheels:
        raise SystemExit(f"{module} is missing and no wheels for it are in {WHEELS}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), *map(str, wheels)], check=True)
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    __import__(module)


def run_one(variant: str, tokens: int, layers: int, steps: int, warmup: int, site: Path) -> dict:
    """One variant at one size, in this process."""
    import torch

    sys.path.insert(0, str(ROOT))
    ensure("transformers", sorted((WHEELS / "hf").glob("*.whl")), site)
    import transformers

    if variant == "liger":
        ensure("liger_kernel", sorted(WHEELS.glob("liger_kernel-*.whl")), site)
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()  # before the model is built: it patches the classes
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES, num_hidden_layers=layers, max_position_embeddings=tokens,
                                      use_cache=False)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa",
                                                           dtype=torch.bfloat16)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SIZES["vocab_size"], (1, tokens), device="cuda")

    def train_step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    if variant == "ours":
        import compile_stack
        step = compile_stack.compile_step(train_step)
    else:
        step = torch.compile(train_step)
    result = dict(variant=variant, tokens=tokens, layers=layers, device=torch.cuda.get_device_name(),
                  torch=torch.__version__, transformers=transformers.__version__)
    try:
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        result["first_step_s"] = round(time.perf_counter() - start, 1)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end))
        result.update(step_ms=round(statistics.median(times), 2), peak_gib=round(
            torch.cuda.max_memory_allocated() / 2**30, 2), loss=round(loss.item(), 4))
    except torch.OutOfMemoryError as e:
        result.update(error=f"out of memory: {str(e).splitlines()[0]}")
    if variant == "ours":
        result["passes"] = dict(step.report.replacements)
        result["notes"] = list(step.report.notes)
        result["block_graphs"] = step.block_graphs
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,32768", help="comma-separated sequence lengths (batch 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--log-dir", type=Path, default=Path("bench_hf_logs"))
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # variant:tokens, run in this process
    args = p.parse_args()
    variants = args.variants.split(",")
    bad = sorted(set(variants) - set(VARIANTS))
    if bad:
        p.error(f"--variants: unknown {bad}; expected some of {list(VARIANTS)}")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    site = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_hf_site"  # offline installs, outside the logs
    if args.one:
        variant, n = args.one.split(":")
        print("RESULT " + json.dumps(run_one(variant, int(n), args.layers, args.steps, args.warmup, site)))
        return
    results = []
    for n in tokens:
        for variant in variants:
            log = args.log_dir / f"{variant}_{n}.log"
            with open(log, "w") as f:
                proc = subprocess.run([sys.executable, __file__, "--one", f"{variant}:{n}", "--layers",
                                       str(args.layers), "--steps", str(args.steps), "--warmup", str(args.warmup),
                                       "--log-dir", str(args.log_dir)], stdout=subprocess.PIPE,
                                      stderr=f, text=True, cwd=ROOT)
            found = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(found[-1]) if found else dict(variant=variant, tokens=n,
                                                               error=f"exit {proc.returncode}, see {log}")
            results.append(result)
            print(json.dumps(result), flush=True)
    by = {(r["variant"], r["tokens"]): r for r in results}
    for n in tokens:
        ours, liger = by.get(("ours", n), {}), by.get(("liger", n), {})
        if "step_ms" in ours and "step_ms" in liger:
            print(f"tokens {n}: ours {ours['step_ms']} ms / {ours['peak_gib']} GiB, liger {liger['step_ms']} ms / "
                  f"{liger['peak_gib']} GiB: {liger['step_ms'] / ours['step_ms']:.3f}x Liger's speed")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
