"""Fused multi-tensor AdamW: ``torch.ops.cstack.fused_adamw_``.

One optimizer step over all parameters in one Triton launch per dtype group
(params, grads, moments each bf16, fp16 or fp32; math in fp32, each result
rounded once to its storage dtype). The kernel reads every tensor through a
device-side table of raw data pointers, so the whole model is one grid.

``lr`` and ``step`` are 0-d float32 tensors read by the kernel from device
memory: a new lr or step value needs no recompile of a graph and no host sync.

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

Bad targets of the fused cross-entropy (custom_ops/linear_cross_entropy.py): that
op leaves NaN gradients and sets its per-device flag (``targets_flag(device)``)
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

Semantics (REFERENCE.md §2), step t = ``step`` (already incremented):
  reference (default):  p ← p − lr·wd·p;  m ← β₁m + (1−β₁)g;  v ← β₂v + (1−β₂)g²;
                        p ← p − lr·√(1−β₂ᵗ)/(1−β₁ᵗ) · m / (√v + eps)
  torch_semantics=True: as torch.optim.AdamW, eps inside the bias correction:
                        p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + eps)

Only parameters that have a gradient are passed: the caller skips the rest.
"""
import math
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from custom_ops import linear_cross_entropy
from custom_ops.checks import FLOAT_DTYPES, check_tensor, require, runs_triton

# Elements and warps per program: 8 elements a thread (one 16-byte bf16 vector
# per stream) keeps registers low enough for 2 programs an SM. On the H200,
# 2048/8 ran at 95% of copy bandwidth (1024/4 the same within noise); 4096/8 (16 a thread,
# 1 program an SM) at 62%.
BLOCK = 2048
NUM_WARPS = 8
# Plans kept: a training loop alternates between very few pointer sets.
_CACHE_SIZE = 8

# Bits of the per-device error flag the kernel sets when it refuses lr / step, or skips the update
# because the fused cross-entropy flagged a bad target (module docstring).
REFUSED_LR = tl.constexpr(1)
REFUSED_STEP = tl.constexpr(2)
REFUSED_TARGETS = tl.constexpr(4)
TARGETS_MESSAGE = ("targets: expected values in [0, V) or ignore_index; the fused cross-entropy saw an "
                   "out-of-range target (its gradients are NaN)")

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _one_minus_pow(log_beta, t):
    """1 − βᵗ = −expm1(t·ln β); a series where 1 − exp would cancel (small t·|ln β|)."""
    x = t * log_beta
    series = -x * (1 + x / 2 * (1 + x / 3 * (1 + x / 4 * (1 + x / 5 * (1 + x / 6 * (1 + x / 7))))))
    return tl.where(x > -0.5, series, 1 - tl.exp(x))


@triton.jit
def _update_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, numel, lr, t, beta1, beta2, one_minus_beta1, one_minus_beta2,
                  log_beta1, log_beta2, eps, weight_decay, TORCH_SEMANTICS: tl.constexpr, MASKED: tl.constexpr):
    """Load, update in fp32, store rounded once. Unmasked blocks keep 16-byte vector accesses:
    a mask against a numel of unknown divisibility would make every access scalar."""
    if MASKED:
        mask = offs < numel
    else:
        mask = None
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)

    bc1 = _one_minus_pow(log_beta1, t)
    bc2 = _one_minus_pow(log_beta2, t)
    p = p - lr * weight_decay * p
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    if TORCH_SEMANTICS:
        denom = tl.sqrt_rn(v) * (1 / tl.sqrt_rn(bc2)) + eps
        p = p - (lr / bc1) * tl.div_rn(m, denom)
    else:
        p = p - (lr * tl.sqrt_rn(bc2) / bc1) * tl.div_rn(m, tl.sqrt_rn(v) + eps)

    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(
    table_ptr, block_tensor_ptr, lr_ptr, step_ptr, flag_ptr, targets_flag_ptr,
    beta1, beta2, one_minus_beta1, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr,
    TORCH_SEMANTICS: tl.constexpr, BLOCK: tl.constexpr,
):
    """One BLOCK of one tensor: the block map names the tensor, its table row the rest.

    Table row (int64): p, g, m, v data pointers, numel, index of the tensor's first block.
    1 − β and ln β come from the host in float64: 1 − β computed in fp32 from an fp32 β
    is off by up to 1.3e-5 (β₂ = 0.999) and flips the rounding of ~1% of bf16 moments.
    An lr that is not finite and >= 0, or a step that is not finite and >= 1, turns every
    update into NaN/Inf, and so do the gradients of a step whose cross-entropy set its
    bad-target flag (targets_flag_ptr nonzero): then no program updates anything and program 0
    ORs REFUSED_LR / REFUSED_STEP / REFUSED_TARGETS into the flag.
    """
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_tensor_ptr + pid).to(tl.int64) * 6
    # Data pointers are 16-byte aligned (checked on the host): vector accesses.
    p_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(P_DTYPE)), 16)
    g_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(G_DTYPE)), 16)
    m_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(M_DTYPE)), 16)
    v_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(V_DTYPE)), 16)
    numel = tl.load(row + 4)
    start = (pid - tl.load(row + 5)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    lr = tl.load(lr_ptr)
    t = tl.load(step_ptr)
    # NaN fails both comparisons of each pair.
    lr_ok = (lr >= 0) & (lr < float("inf"))
    t_ok = (t >= 1) & (t < float("inf"))
    targets_ok = tl.load(targets_flag_ptr) == 0
    if lr_ok & t_ok & targets_ok:
        if start + BLOCK <= numel:
            _update_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, numel, lr, t, beta1, beta2, one_minus_beta1,
                          one_minus_beta2, log_beta1, log_beta2, eps, weight_decay, TORCH_SEMANTICS, MASKED=False)
        else:
            _update_block(p_ptr, g_ptr, m_ptr, v_ptr, offs, numel, lr, t, beta1, beta2, one_minus_beta1,
                          one_minus_beta2, log_beta1, log_beta2, eps, weight_decay, TORCH_SEMANTICS, MASKED=True)
    elif pid == 0:
        code = tl.where(lr_ok, 0, REFUSED_LR) | tl.where(t_ok, 0, REFUSED_STEP) \
            | tl.where(targets_ok, 0, REFUSED_TARGETS)
        tl.atomic_or(flag_ptr, code)


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


def _build_plan(params, grads, exp_avgs, exp_avg_sqs, block):
    """Per dtype group: a [n, 6] int64 table on the device and a block → tensor map (int32)."""
    device = params[0].device
    groups = {}
    for quad in zip(params, grads, exp_avgs, exp_avg_sqs):
        if quad[0].numel():
            groups.setdefault(tuple(t.dtype for t in quad), []).append(quad)
    plan = []
    for dtypes, quads in groups.items():
        rows, first = [], 0
        for quad in quads:
            numel = quad[0].numel()
            rows.append([t.data_ptr() for t in quad] + [numel, first])
            first += triton.cdiv(numel, block)
        table = torch.tensor(rows, dtype=torch.int64).to(device)
        blocks = table[:, 4].add(block - 1).div(block, rounding_mode="floor")
        ids = torch.arange(len(quads), dtype=torch.int32, device=device)
        block_tensor = torch.repeat_interleave(ids, blocks, output_size=first)
        plan.append((tuple(_TL_DTYPES[d] for d in dtypes), table, block_tensor))
    return plan


_plans: "OrderedDict[tuple, list]" = OrderedDict()


class _Refusals:
    """A device's error flag (int32, bits REFUSED_LR / REFUSED_STEP / REFUSED_TARGETS, set by the
    kernel, cleared when raised) and, on CUDA, its pinned host copy and the event that says the copy
    has landed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=True) if cuda else None
        self.copied = torch.cuda.Event() if cuda else None
        self.pending = False  # a copy was issued since the last read

    def raise_if_set(self, code: int) -> None:
        if code:
            self.flag.zero_()
            if self.host is not None:
                self.host.zero_()
            self.pending = False
            args = [a for a, bit in (("lr", REFUSED_LR.value), ("step", REFUSED_STEP.value)) if code & bit]
            messages = []
            if code & REFUSED_TARGETS.value:
                linear_cross_entropy.clear_targets_flag(self.device)  # reported here, once
                messages.append(TARGETS_MESSAGE)
            if args:
                messages.append(f"{' and '.join(args)}: expected lr finite and >= 0 and step finite and >= 1, "
                                f"got a tensor value outside that")
            raise ValueError(f"{'; '.join(messages)} (read on the device by fused_adamw_, which skipped that "
                             f"update: no tensor changed)")

    def forget_targets(self) -> None:
        """Clear REFUSED_TARGETS: check_targets_flag() reported that target (it synced: the copy landed)."""
        self.flag.bitwise_and_(~REFUSED_TARGETS.value)
        if self.host is not None:
            self.host.bitwise_and_(~REFUSED_TARGETS.value)


_refusals: dict = {}


def _refusals_for(device: torch.device) -> _Refusals:
    state = _refusals.get(device)
    if state is None:
        state = _refusals[device] = _Refusals(device)
    return state


def raise_if_refused(device: torch.device | str | None = None) -> None:
    """Raise the ValueError for an lr/step value the kernel refused since the last check (on ``device``,
    or any device used so far). Reads the flag: a host sync on CUDA, so call it where the step syncs."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    for dev, state in list(_refusals.items()):
        if device is None or dev == device:
            state.raise_if_set(int(state.flag.item()))


def forget_refused_targets() -> None:
    """Called by linear_cross_entropy.check_targets_flag() once it raised for a bad target, so that
    the refusal this op recorded for the same target is not raised a second time."""
    for state in _refusals.values():
        state.forget_targets()


def _raise_if_bad_targets(device: torch.device) -> None:
    """The CPU path: the cross-entropy's flag read on the host; raise (and clear it) before any update."""
    flag = linear_cross_entropy._bad_target_flags.get(device)
    if flag is not None and flag.item():
        flag.zero_()
        raise ValueError(f"{TARGETS_MESSAGE} (fused_adamw_ skipped this update: no tensor changed)")


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
        plan = _build_plan(*lists, block) if params else []
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
    refusals = _refusals_for(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if refusals.pending and not capturing and refusals.copied.query():  # an earlier call's flag, landed: no sync
        refusals.pending = False
        refusals.raise_if_set(int(refusals.host[0]))
    lr, step = lr.to(device, non_blocking=True), step.to(device, non_blocking=True)
    targets_flag = linear_cross_entropy.targets_flag(device)
    log_beta1 = math.log(beta1) if beta1 > 0 else -math.inf
    log_beta2 = math.log(beta2) if beta2 > 0 else -math.inf
    for (pd, gd, md, vd), table, block_tensor in plan:
        _adamw_kernel[(block_tensor.numel(),)](
            table, block_tensor, lr, step, refusals.flag, targets_flag, beta1, beta2, 1 - beta1, 1 - beta2, log_beta1,
            log_beta2, eps, weight_decay, P_DTYPE=pd, G_DTYPE=gd, M_DTYPE=md, V_DTYPE=vd,
            TORCH_SEMANTICS=torch_semantics, BLOCK=block, num_warps=num_warps,
        )
    if device.type != "cuda":  # the interpreter: the flag is host memory, free to read now
        refusals.raise_if_set(int(refusals.flag[0]))
    elif not capturing:
        refusals.host.copy_(refusals.flag, non_blocking=True)
        refusals.copied.record()
        refusals.pending = True


def _adamw_torch(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay,
                 torch_semantics):
    """Plain torch, per tensor, fp32 math: the CPU implementation."""
    lr, t = lr.item(), step.item()
    _check_values(lr, t)  # no sync to avoid on the CPU
    if params:
        _raise_if_bad_targets(params[0].device)
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32, g32, m32, v32 = (x.to(torch.float32, copy=True) for x in (p, g, m, v))
        p32.sub_(lr * weight_decay * p32)
        m32.mul_(beta1).add_(g32, alpha=1 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        if torch_semantics:
            p32.addcdiv_(m32, v32.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        else:
            p32.addcdiv_(m32, v32.sqrt().add_(eps), value=-lr * math.sqrt(bc2) / bc1)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)


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
    _adamw_torch(params, grads, exp_avgs, exp_avg_sqs, lr, step, beta1, beta2, eps, weight_decay,
                 torch_semantics)


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
