"""The ``cstack::fused_adamw_`` op, its argument checks, the CUDA path's plan cache, and
``fused_adamw``, the function user code calls.

CUDA tensors run the Triton kernel (``triton_kernels``), CPU tensors ``cpu.torch_step``.

Bad input is refused before any tensor changes, with a ValueError naming the
argument: list lengths, dtypes, shapes, devices, layout, alignment, memory
shared between tensors the op writes (or between a grad and one of them), and
the Python-number hyperparameters (finite, in range). lr and step values:
  - on the CPU path, and on the CUDA path when lr/step are CPU tensors, they are
    read on the host (no GPU sync) and checked: lr finite and >= 0, step finite
    and >= 1;
  - when they are device tensors, reading them would be a host sync, so the
    kernel checks them: on a bad value every program skips its update (no tensor
    changes) and ORs a code into a per-device error flag. The flag is copied to
    pinned host memory after the launch (asynchronously) and the op raises the
    ValueError (naming lr and/or step) at its next call once that copy has
    landed; ``raise_if_refused()`` reads the flag now (a sync: call it where the
    training step already syncs, e.g. next to reading the loss). Under the
    Triton interpreter the flag is read right after the launch.
    ``torch._assert_async`` was not used: a failed device assert kills the CUDA
    context (the process's GPU state is lost) and its message names nothing.

Bad targets of the fused cross-entropy (custom_ops/linear_cross_entropy): that
op leaves NaN gradients and sets the per-device flag of ``custom_ops.flags``
for a target outside [0, V); the update must not run on them. The op reads that
flag on the params' device and, while it is set, skips the whole update (no
tensor changes):
  - on the CPU path it reads the flag on the host and raises ValueError naming
    ``targets`` before any update (and clears the flag: reported once);
  - on the CUDA path (and the Triton kernel under the interpreter) the kernel
    reads it from device memory, no host sync: every program skips, and program 0
    ORs REFUSED_TARGETS into the error flag above, raised like a bad lr/step (at
    the next call, or by ``raise_if_refused()``) as a ValueError naming
    ``targets``; raising it clears the cross-entropy flag too. A
    ``check_targets_flag()`` that raises first clears REFUSED_TARGETS here
    (``forget_refused_targets``). The flag stays set until one of them raises, so
    every update in between is skipped.
"""
import math
from collections import OrderedDict

import torch

from custom_ops.adamw.configs import BLOCK, NUM_WARPS
from custom_ops.adamw.cpu import torch_step
from custom_ops.adamw.triton_kernels import TARGETS_MESSAGE, build_plan, launch
from custom_ops.checks import FLOAT_DTYPES, check_tensor, require, runs_triton
from custom_ops.flags import clear_targets_flag, targets_flag_set


def _check_tensors(params, grads, exp_avgs, exp_avg_sqs):
    """Lists, dtypes, shapes, devices, layout: metadata only (no data reads, no sync)."""
    n = len(params)
    others = (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs))
    for name, seq in others:
        require(len(seq) == n, name, f"a list as long as params ({n})", f"length {len(seq)}")
    for i, p in enumerate(params):
        check_tensor(f"params[{i}]", p, dtypes=FLOAT_DTYPES)
        require(p.device == params[0].device, f"params[{i}]", f"the device of params[0] ({params[0].device})",
                p.device)
        require(p.is_contiguous(), f"params[{i}]", "a contiguous tensor", f"strides {tuple(p.stride())}")
        for name, seq in others:
            t, arg = seq[i], f"{name}[{i}]"
            check_tensor(arg, t, dtypes=FLOAT_DTYPES)
            require(t.shape == p.shape, arg, f"the shape of params[{i}] {tuple(p.shape)}", tuple(t.shape))
            require(t.device == p.device, arg, f"the device of params[{i}] ({p.device})", t.device)
            require(t.is_contiguous(), arg, "a contiguous tensor", f"strides {tuple(t.stride())}")


def _check_scalars(params, lr, step, beta1, beta2, eps, weight_decay):
    """lr and step as 0-d float32 tensors on the cpu or the params' device; hyperparameter ranges."""
    device = params[0].device if params else None
    for name, t in (("lr", lr), ("step", step)):
        check_tensor(name, t, ndim=0, dtypes=(torch.float32,))
        require(t.device.type == "cpu" or t.device == device, name,
                f"a tensor on the cpu or on the params' device ({device})", t.device)
    require(0 <= beta1 < 1, "beta1", "a value in [0, 1)", beta1)
    require(0 <= beta2 < 1, "beta2", "a value in [0, 1)", beta2)
    require(math.isfinite(eps) and eps >= 0, "eps", "a finite value >= 0", eps)
    require(math.isfinite(weight_decay) and weight_decay >= 0, "weight_decay", "a finite value >= 0", weight_decay)


def _check_values(lr: float | None = None, step: float | None = None) -> None:
    """The values of lr and step, where reading them costs no GPU sync (CPU tensors, numbers)."""
    require(lr is None or (math.isfinite(lr) and lr >= 0), "lr", "a finite value >= 0", lr)
    require(step is None or (math.isfinite(step) and step >= 1), "step", "a finite step number >= 1", step)


def _check_disjoint(params, grads, exp_avgs, exp_avg_sqs):
    """No two tensors the op writes share memory, nor a grad with one of them (grads may share among
    themselves: they are only read). The tensors are contiguous (checked before), so each is the
    byte range [data_ptr, data_ptr + nbytes): one sort of the ranges and a sweep, O(n log n) in C,
    O(n) in Python. Empty tensors hold no memory and are skipped."""
    ranges = []
    for k, (name, seq) in enumerate((("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                                     ("exp_avg_sqs", exp_avg_sqs))):
        written = name != "grads"
        for i, t in enumerate(seq):
            n = t.numel()
            if n:
                start = t.data_ptr()
                ranges.append((start, (k, i), start + n * t.element_size(), written, name))
    ranges.sort()  # ties: the later-listed tensor is the one named
    # The range reaching furthest so far among written tensors, and among grads: any overlap of a
    # later range with an earlier one shows as an overlap with the furthest of its kind.
    furthest = {True: (0, None), False: (0, None)}
    for start, (_, i), end, written, name in ranges:
        arg = f"{name}[{i}]"
        for kind in ((True, False) if written else (True,)):
            reach, other = furthest[kind]
            require(start >= reach, arg, "memory of its own (a tensor the op writes may share memory with "
                    "no other argument)", f"memory shared with {other}")
        if end > furthest[written][0]:
            furthest[written] = (end, arg)


def _check_aligned(params, grads, exp_avgs, exp_avg_sqs):
    """The kernel's vector loads need 16-byte aligned data pointers (fresh allocations are)."""
    for name, seq in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        for i, t in enumerate(seq):
            require(t.data_ptr() % 16 == 0, f"{name}[{i}]", "a 16-byte aligned data pointer",
                    f"address {t.data_ptr():#x}")


def _raise_if_bad_targets(device: torch.device) -> None:
    """The CPU path: the cross-entropy's flag read on the host; raise (and clear it) before any update."""
    if targets_flag_set(device):
        clear_targets_flag(device)
        raise ValueError(f"{TARGETS_MESSAGE} (fused_adamw_ skipped this update: no tensor changed)")


# Plans kept: a training loop alternates between very few pointer sets.
_CACHE_SIZE = 8
_plans: "OrderedDict[tuple, list]" = OrderedDict()


def _plan_key(lists, block):
    """What the plan encodes and what the checks saw: each tensor's address, shape, dtype and whether
    it is contiguous, and the device. Addresses are unique across devices in one process (CUDA's
    unified addressing), and address + shape + dtype of contiguous tensors fix the memory each
    covers, so a hit means every check (alignment and disjointness included) would pass again."""
    return (block, lists[0][0].device if lists[0] else None) \
        + tuple(tuple(map(torch.Tensor.data_ptr, seq)) for seq in lists) \
        + tuple(tuple(map(torch.Tensor.size, seq)) for seq in lists) \
        + tuple(tuple(t.dtype for t in seq) for seq in lists) \
        + tuple(tuple(map(torch.Tensor.is_contiguous, seq)) for seq in lists)


def _triton_step(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay,
                 torch_semantics, block=BLOCK, num_warps=NUM_WARPS):
    """Look up (or check and build) the plan, then one launch per dtype group.

    The plan key (``_plan_key``) holds every fact the tensor checks read, so a hit
    describes tensors already checked, and a repeated step does no per-tensor work
    beyond forming the key. Scalar arguments' types and ranges are checked by the
    caller; lr/step values here (see the module docstring).
    """
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    key = _plan_key(lists, block)
    plan = _plans.get(key)
    if plan is None:
        _check_tensors(*lists)
        _check_aligned(*lists)
        _check_disjoint(*lists)
        plan = build_plan(*lists, block) if params else []
        _plans[key] = plan
        if len(_plans) > _CACHE_SIZE:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    if not plan:
        return
    device = params[0].device
    # lr/step on the host while the params are not: their values cost no sync to read.
    _check_values(lr.item() if lr.device != device else None, step.item() if step.device != device else None)
    launch(plan, lr, step, beta1, beta2, eps, weight_decay, torch_semantics, block, num_warps)


@torch.library.custom_op("cstack::fused_adamw_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"),
                         device_types="cuda")
def fused_adamw_(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], lr: torch.Tensor, step: torch.Tensor,
    beta1: float, beta2: float, eps: float, weight_decay: float, torch_semantics: bool,
) -> None:
    """One AdamW step in place over all given tensors (the Triton kernel on CUDA).

    Every check runs before any tensor changes (ValueError naming the argument). lr and step
    device tensors are checked by the kernel without a host sync: a bad value skips the whole
    update and is raised at the next call, or by ``raise_if_refused()`` (module docstring).
    While the fused cross-entropy's bad-target flag is set on the params' device the update is
    skipped too, and a ValueError naming ``targets`` raised the same way (at once on the CPU).
    """
    _check_scalars(params, lr, step, beta1, beta2, eps, weight_decay)
    require(not params or runs_triton(params[0]), "params[0]", "a CUDA tensor (some argument is on CUDA)",
            params[0].device if params else None)
    _triton_step(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay,
                 torch_semantics)


@fused_adamw_.register_kernel("cpu")
def _fused_adamw_cpu(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay,
                     torch_semantics):
    _check_scalars(params, lr, step, beta1, beta2, eps, weight_decay)
    _check_tensors(params, grads, exp_avgs, exp_avg_sqs)
    _check_disjoint(params, grads, exp_avgs, exp_avg_sqs)
    lr, t = lr.item(), step.item()
    _check_values(lr, t)  # no sync to avoid on the CPU
    if params:
        _raise_if_bad_targets(params[0].device)
    torch_step(params, grads, exp_avgs, exp_avg_sqs, lr, t, beta1, beta2, eps, weight_decay, torch_semantics)


@fused_adamw_.register_fake
def _fused_adamw_fake(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay,
                      torch_semantics):
    """Mutation only, no outputs; bad arguments still fail at trace time (shared memory and lr/step
    values are checked when the op runs: fake tensors have neither addresses nor values)."""
    _check_scalars(params, lr, step, beta1, beta2, eps, weight_decay)
    _check_tensors(params, grads, exp_avgs, exp_avg_sqs)


def fused_adamw(params, grads, exp_avgs, exp_avg_sqs, *, lr, step, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.01, torch_semantics=False) -> None:
    """One AdamW step in place; ``lr`` and ``step`` may be numbers or 0-d float32 tensors.

    ``step`` is this update's step number t (1 for the first update). Pass only
    parameters that have a gradient. Numbers become CPU tensors, which the CUDA
    path copies to the device without a host sync.
    """
    params, grads, exp_avgs, exp_avg_sqs = (list(x) for x in (params, grads, exp_avgs, exp_avg_sqs))
    if not isinstance(lr, torch.Tensor):
        require(isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr >= 0, "lr",
                "a finite number >= 0 or a 0-d float32 tensor", lr)
        lr = torch.tensor(float(lr), dtype=torch.float32)
    if not isinstance(step, torch.Tensor):
        require(isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step) and step >= 1,
                "step", "a finite step number >= 1 or a 0-d float32 tensor", step)
        step = torch.tensor(float(step), dtype=torch.float32)
    require(len(betas) == 2, "betas", "a pair (beta1, beta2)", betas)
    torch.ops.cstack.fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, lr, step, float(betas[0]),
                                  float(betas[1]), float(eps), float(weight_decay), bool(torch_semantics))
