"""Muon with an auxiliary AdamW, written the plain way (as ``reference.AdamW`` is).

A hidden weight matrix is updated by its momentum made orthogonal: five
Newton–Schulz iterations, written out below in plain bf16 torch, push every
singular value of the update towards 1. Everything else (embeddings, the LM
head, norms, biases) is updated by AdamW, the reference's update. Nothing here
calls our ops: compiled, the Newton–Schulz pass (passes/newton_schulz) makes
each matrix's iterations one ``newton_schulz`` call and the AdamW pass makes
the AdamW updates one fused call.

    Muon(params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
         adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=0.01)

``params`` is either
- an iterable of parameters (``model.parameters()``, as ``run_step.py
  --optimizer compile_stack.workloads.muon:Muon`` passes it). Muon takes the *hidden
  matrices*: 2-D parameters whose larger side is at most ``HIDDEN_ASPECT`` (4)
  times the smaller. The 8B model's 4096×4096 attention projections and its
  11008×4096 and 4096×11008 MLP matrices are hidden; its 151936×4096 embedding
  and LM head (37 times as long as wide: a vocabulary, not a hidden layer) and
  its 1-D norms go to AdamW;
- or a list of param-group dicts, each with ``"use_muon": True`` or ``False``
  (MuonWithAuxAdam's convention). A group may set its own ``lr``,
  ``momentum``, ``nesterov``, ``ns_steps``, ``weight_decay`` (Muon groups) or
  ``lr``, ``betas``, ``eps``, ``weight_decay`` (AdamW groups); the rest come
  from the arguments above.

Muon's update of a matrix p of r rows and c columns, gradient g:

    buf ← momentum·buf + g
    u   ← g + momentum·buf  (nesterov)  or  buf
    u   ← newton_schulz5(u)·√max(1, r/c)
    p   ← p·(1 − lr·weight_decay) − lr·u

All state (momentum buffers, AdamW's moments) is made here, so a compiled
step has no branch that creates it.
"""
import math

import torch

from custom_ops.checks import require

# Muon's quintic: five iterations map every singular value of a normalised matrix into about [0.7, 1.2].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# A 2-D parameter is a hidden matrix when its larger side is at most this many times its smaller.
HIDDEN_ASPECT = 4
_MUON_KEYS = ("lr", "momentum", "nesterov", "ns_steps", "weight_decay")
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")


def is_hidden_matrix(p: torch.Tensor) -> bool:
    """Whether Muon takes ``p`` when given plain parameters."""
    return p.dim() == 2 and 0 < max(p.shape) <= HIDDEN_ASPECT * min(p.shape)


def newton_schulz5(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """G's nearest semi-orthogonal matrix, roughly: bf16, the wide orientation, normalised, then
    ``steps`` iterations of X ← aX + (bA + cA²)X with A = XXᵀ."""
    a, b, c = NS_COEFFICIENTS
    X = G.bfloat16()
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X


class Muon:
    """Muon for hidden matrices, AdamW for the rest (see the module docstring)."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0,
                 adamw_lr=1e-3, adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=0.01):
        muon = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        adamw = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
        params = list(params)
        if not any(isinstance(group, dict) for group in params):
            params = [{"params": [p for p in params if is_hidden_matrix(p)], "use_muon": True},
                      {"params": [p for p in params if not is_hidden_matrix(p)], "use_muon": False}]
        self.groups = []
        for i, group in enumerate(params):
            require(isinstance(group, dict) and "params" in group and isinstance(group.get("use_muon"), bool),
                    f"params[{i}]", "a param-group dict with 'params' and a 'use_muon' flag (True or False)", group)
            defaults = muon if group["use_muon"] else adamw
            unknown = sorted(set(group) - {"params", "use_muon", *defaults})
            require(not unknown, f"params[{i}]", f"keys among params, use_muon, {', '.join(defaults)}", unknown)
            group = {**defaults, **group, "params": list(group["params"])}
            if group["use_muon"]:
                for j, p in enumerate(group["params"]):
                    require(p.dim() == 2, f"params[{i}]['params'][{j}]", "a 2-D parameter (Muon's)",
                            f"shape {tuple(p.shape)}")
                group["momentum_buffer"] = [torch.zeros_like(p) for p in group["params"]]
            else:
                group["exp_avg"] = [torch.zeros_like(p) for p in group["params"]]
                group["exp_avg_sq"] = [torch.zeros_like(p) for p in group["params"]]
            if group["params"]:
                self.groups.append(group)
        self.t = 0

    def zero_grad(self, set_to_none=True):
        for group in self.groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self):
        self.t += 1
        for group in self.groups:
            if group["use_muon"]:
                self.muon_update(group)
            else:
                self.adamw_update(group)

    def muon_update(self, group):
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        for p, buf in zip(group["params"], group["momentum_buffer"]):
            if p.grad is None:
                continue
            g = p.grad
            buf.mul_(momentum).add_(g)
            u = g + momentum * buf if group["nesterov"] else buf
            u = newton_schulz5(u, group["ns_steps"])
            scale = max(1, p.size(0) / p.size(1)) ** 0.5
            p.mul_(1 - lr * weight_decay)
            p.sub_(lr * scale * u)

    def adamw_update(self, group):
        """The reference AdamW's update (decay with lr first, eps outside the bias correction)."""
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        alpha = lr * math.sqrt(1 - beta2**self.t) / (1 - beta1**self.t)
        for p, m, v in zip(group["params"], group["exp_avg"], group["exp_avg_sq"]):
            if p.grad is None:
                continue
            g = p.grad
            p.sub_(lr * weight_decay * p)
            m.mul_(beta1).add_((1 - beta1) * g)
            v.mul_(beta2).add_((1 - beta2) * g * g)
            p.sub_(alpha * m / (torch.sqrt(v) + eps))
