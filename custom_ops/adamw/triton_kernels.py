"""The Triton AdamW kernel, its plan (the device-side pointer tables) and its launcher ``launch``,
and the per-device error flag the kernel sets when it refuses to update (``raise_if_refused``).

The kernel runs on any CUDA GPU, and on CPU tensors under ``TRITON_INTERPRET=1`` (how the
tests check it). It reads lr and step from device memory, so it checks their values itself
(a host read would be a sync); why it reports through a flag: custom_ops/adamw/op.py.
"""
import math

import torch
import triton
import triton.language as tl

from custom_ops.flags import clear_targets_flag, on_targets_reported, targets_flag

# Bits of the per-device error flag the kernel sets when it refuses lr / step, or skips the update
# because the fused cross-entropy flagged a bad target.
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
    p = p * (1 - lr * weight_decay)  # as torch.optim: an infinite p stays so at lr·wd = 0
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


def build_plan(params, grads, exp_avgs, exp_avg_sqs, block):
    """Per dtype group: a [n, 6] int64 table on the device and a block → tensor map (int32).

    Built without waiting for the GPU: a step whose gradients land at new addresses builds a
    plan at every call, and a sync there would leave the host no lead into the next step."""
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
        # From pinned memory, so the copy waits for no GPU work (a pageable one syncs the stream).
        table = torch.tensor(rows, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        blocks = table[:, 4].add(block - 1).div(block, rounding_mode="floor")
        ids = torch.arange(len(quads), dtype=torch.int32, device=device)
        block_tensor = torch.repeat_interleave(ids, blocks, output_size=first)
        plan.append((tuple(_TL_DTYPES[d] for d in dtypes), table, block_tensor))
    return plan


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
                clear_targets_flag(self.device)  # reported here, once
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
    """Run when the cross-entropy's check reports a bad target (``custom_ops.flags``), so that the
    refusal this op recorded for the same target is not raised a second time."""
    for state in _refusals.values():
        state.forget_targets()


on_targets_reported(forget_refused_targets)


def launch(plan, lr, step, beta1, beta2, eps, weight_decay, torch_semantics, block, num_warps):
    """One launch per dtype group of ``plan`` (``build_plan``'s, non-empty), on its device.

    First raises a refusal an earlier launch flagged whose host copy has landed (no sync); after
    the launches, starts the copy of the flag (on CUDA) or reads it (the interpreter: host memory).
    """
    device = plan[0][1].device
    refusals = _refusals_for(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if refusals.pending and not capturing and refusals.copied.query():
        refusals.pending = False
        refusals.raise_if_set(int(refusals.host[0]))
    lr, step = lr.to(device, non_blocking=True), step.to(device, non_blocking=True)
    targets = targets_flag(device)
    log_beta1 = math.log(beta1) if beta1 > 0 else -math.inf
    log_beta2 = math.log(beta2) if beta2 > 0 else -math.inf
    for (pd, gd, md, vd), table, block_tensor in plan:
        _adamw_kernel[(block_tensor.numel(),)](
            table, block_tensor, lr, step, refusals.flag, targets, beta1, beta2, 1 - beta1, 1 - beta2, log_beta1,
            log_beta2, eps, weight_decay, P_DTYPE=pd, G_DTYPE=gd, M_DTYPE=md, V_DTYPE=vd,
            TORCH_SEMANTICS=torch_semantics, BLOCK=block, num_warps=num_warps,
        )
    if device.type != "cuda":
        refusals.raise_if_set(int(refusals.flag[0]))
    elif not capturing:
        refusals.host.copy_(refusals.flag, non_blocking=True)
        refusals.copied.record()
        refusals.pending = True
