"""``--check``: the compiled step against the eager reference step.

Both start from the same weights and see the same batches for ``STEPS``
steps. The compiled step computes attention, the loss and the update in fp32
inside our kernels while the reference rounds to bf16 after every op, so the
two differ by bf16 rounding, not by zero; the tolerances below are set for
bf16 models and are far below what any wrong rewrite produces (a dropped
mask, scale or bias correction moves these by O(1)).
"""
import json

import torch

from compile_stack.harness.report import log

STEPS = 2
TOLERANCES = {
    "loss_rel_err": 2e-2,  # |loss_c − loss_e| / |loss_e|, worst step
    "grad_rel_err": 5e-2,  # ‖g_c − g_e‖ / ‖g_e‖ over all gradients, last step
    "param_rel_err": 1e-2,  # ‖p_c − p_e‖ / ‖p_e‖ over all parameters, after the steps
}
# fp32 models have no bf16 rounding to hide behind.
FP32_TOLERANCES = {"loss_rel_err": 1e-4, "grad_rel_err": 1e-3, "param_rel_err": 1e-4}


@torch.no_grad()
def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(((x.double() - y.double()) ** 2).sum() for x, y in zip(a, b))
    den = sum((y.double() ** 2).sum() for y in b)
    return float((num / den).sqrt()) if den > 0 else float(num.sqrt())


def compare_steps(compiled_step, eager_step, compiled_model, eager_model, batches) -> dict:
    """Run both steps on ``batches``; return the relative errors and ``ok``."""
    loss_errs = []
    for inputs, targets in batches:
        lc = compiled_step(inputs, targets).detach().double()
        le = eager_step(inputs, targets).detach().double()
        loss_errs.append(((lc - le).abs() / le.abs().clamp_min(1e-12)).item())
    params_c = list(compiled_model.parameters())
    params_e = list(eager_model.parameters())
    grads = [(p.grad, q.grad) for p, q in zip(params_c, params_e) if q.grad is not None]
    result = {
        "loss_rel_err": max(loss_errs),
        "grad_rel_err": _rel([g for g, _ in grads], [h for _, h in grads]),
        "param_rel_err": _rel(params_c, params_e),
    }
    tolerances = FP32_TOLERANCES if params_e[0].dtype == torch.float32 else TOLERANCES
    result["tolerances"] = tolerances
    result["ok"] = all(result[k] <= tol for k, tol in tolerances.items())
    return result


def check_against_eager(ours, code) -> dict:
    """``STEPS`` steps of ours (a ``build.Built``) against the eager step of ``code`` on its
    ``eager_twin``, which is then freed; the errors and ``ok``."""
    log(f"check: {STEPS} steps compiled vs eager from the same weights and data...")
    twin, ours.eager_twin = ours.eager_twin, None
    result = compare_steps(ours.step, code.train_step(twin), ours.model, twin, [ours.batch] * STEPS)
    log(f"check: {json.dumps(result)}")
    return result
