"""User-written AdamW optimizers through ``compile_step``: each compiles, equals eager and is fused
on every step (``passes/adamw.py``, ``passes/param_data.py``); the non-AdamW ones are left alone.

Counts: ``run_case`` accumulates the pass's fused calls over every optimizer graph compiled, so
``{"adamw": 1}`` over 3 steps means one optimizer graph, fused. An optimizer whose state is created
lazily on its first step is compiled twice (the first call sees an empty state and takes the
creating branch; the second a different branch): ``{"adamw": 2}``, fused on both graphs.
"""
import math

import pytest
import torch
from torch import nn

from passes import registry
from tests.user_corpus import VOCAB, run_case

pytestmark = pytest.mark.filterwarnings("ignore")


def model():
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, VOCAB))


def no_decay_on_biases(params, lr=1e-2, **kw):
    params = list(params)
    return [{"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0, "lr": lr * 3}]


# ---- torch.optim -------------------------------------------------------------------------------

@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single"])
def test_torch_adamw(foreach):
    run_case(model, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=foreach),
             expect={"adamw": 1})


def test_torch_adamw_param_groups():
    run_case(model, make_optimizer=lambda ps: torch.optim.AdamW(no_decay_on_biases(ps), lr=1e-2, weight_decay=0.1),
             expect={"adamw": 2})  # one call per group, one graph


def test_torch_adamw_tensor_lr():
    # (torch.optim refuses a tensor lr with foreach=True and capturable=False.)
    run_case(model, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), weight_decay=0.1,
                                                                foreach=False),
             expect={"adamw": 1})


SCHEDULERS = {
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_torch_adamw_with_scheduler(scheduler):
    # lr is a symbol from the first compile (compile_step): a new lr each step, one graph, fused.
    run_case(model, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False),
             make_scheduler=SCHEDULERS[scheduler], expect={"adamw": 1})


@pytest.mark.parametrize("foreach", [True, None], ids=["foreach", "default"])
def test_torch_adamw_foreach_with_scheduler_compiles_once(foreach):
    # The foreach form passes 1 - lr·wd to _foreach_mul_ as a Python scalar, which Dynamo cannot keep
    # symbolic (each new lr would recompile); compile_step runs torch.optim's per-parameter form
    # instead, the same update, which keeps lr a symbol and is fused the same.
    optimizer = []
    run_case(model, make_optimizer=lambda ps: optimizer.append(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                                                 foreach=foreach)) or optimizer[-1],
             make_scheduler=SCHEDULERS["cosine"], expect={"adamw": 1})
    assert optimizer[0].param_groups[0]["foreach"] is foreach  # the user's setting, as it was


@pytest.mark.parametrize("foreach", [True, None], ids=["foreach", "default"])
def test_torch_adamw_made_capturable_by_dynamo_compiles_once(foreach, monkeypatch, tmp_path):
    """On a GPU, Dynamo's first trace of a torch.optim step sets ``capturable`` in the user's
    param groups whose state does not exist yet. The step must still run in the per-parameter
    form from the second call on: in the foreach form it compiled again (45 s at the full size
    on the H200) with lr baked in, each new lr another compile. Dynamo's GPU-only mutation is
    made to happen here on the CPU too (where foreach=None is the per-parameter form anyway)."""
    from torch._dynamo.variables.optimizer import OptimizerVariable

    dynamos = OptimizerVariable._set_capturable

    def as_on_a_gpu(self, tx):
        for group in self.value.param_groups:
            if "capturable" in group and not any(p in self.value.state for p in group["params"]):
                group["capturable"] = True
        dynamos(self, tx)

    monkeypatch.setattr(OptimizerVariable, "_set_capturable", as_on_a_gpu)
    optimizer = []
    run_case(model, make_optimizer=lambda ps: optimizer.append(torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1,
                                                                                 foreach=foreach)) or optimizer[-1],
             make_scheduler=SCHEDULERS["cosine"], expect={"adamw": 1}, cache_dir=tmp_path)
    assert optimizer[0].param_groups[0]["capturable"] and optimizer[0].param_groups[0]["foreach"] is foreach


def test_torch_adamw_with_clipping():
    """Fused, and the clip's scaling of every gradient by their global norm (each reads all of
    them) is no update the pass notes."""
    run_case(model, clip=1.0, expect={"adamw": 1})
    assert not any(n.startswith("adamw:") for n in registry.current().notes), registry.current().notes


# ---- not AdamW: left alone ---------------------------------------------------------------------

@pytest.mark.parametrize("make_optimizer", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),  # L2: the decay is added to the gradient
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
], ids=["adam_l2", "amsgrad"])
def test_not_adamw_is_left_alone(make_optimizer):
    run_case(model, make_optimizer=make_optimizer, expect={"adamw": 0}, notes=["adamw: left"])


# ---- hand-written ------------------------------------------------------------------------------

class CourseAdamW(torch.optim.Optimizer):
    """The course's AdamW: state created lazily in ``self.state[p]``, an int step, in-place moments."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                step_size = group["lr"] * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
                p.addcdiv_(m, v.sqrt().add_(group["eps"]), value=-step_size)


class DataAdamW(torch.optim.Optimizer):
    """No ``no_grad``: updates through ``p.data``; moments computed out of place and stored back,
    created with ``state.get``; the step a tensor; decay after the moments; bias correction by ``**``."""

    def __init__(self, params, lr=1e-2, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    def step(self):
        b1, b2, eps = 0.9, 0.95, 1e-8
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                g = p.grad.data
                state["step"] = state.get("step", torch.tensor(0.0)) + 1
                m = state.get("m", torch.zeros_like(p.data))
                v = state.get("v", torch.zeros_like(p.data))
                state["m"] = b1 * m + (1 - b1) * g
                state["v"] = b2 * v + (1 - b2) * g * g
                m_hat = state["m"] / (1 - b1 ** state["step"])
                v_hat = state["v"] / (1 - b2 ** state["step"])
                p.data -= group["lr"] * group["weight_decay"] * p.data
                p.data -= group["lr"] * m_hat / (v_hat ** 0.5 + eps)


class ScheduledAdamW:
    """Not a torch Optimizer: moments made up front, the step count an int attribute, lerp_, and an
    lr computed inside ``step`` from it (linear warmup, then cosine); ``p.data = ...``."""

    def __init__(self, params, lr=1e-2, weight_decay=0.1, warmup=2, total=10):
        self.params = list(params)
        self.lr, self.weight_decay, self.warmup, self.total = lr, weight_decay, warmup, total
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.count = 0

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def schedule(self):
        if self.count <= self.warmup:
            return self.lr * self.count / self.warmup
        progress = (self.count - self.warmup) / (self.total - self.warmup)
        return self.lr * 0.5 * (1 + math.cos(math.pi * progress))

    @torch.no_grad()
    def step(self):
        self.count += 1
        lr = self.schedule()
        for p, m, v in zip(self.params, self.m, self.v):
            p.data = p.data * (1 - lr * self.weight_decay)
            m.lerp_(p.grad, 0.1)
            v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
            bc1, bc2 = 1 - 0.9 ** self.count, 1 - 0.999 ** self.count
            p.data = p.data - lr / bc1 * m / ((v / bc2).sqrt() + 1e-8)


def test_course_adamw():
    # State created on the first step: that compile sees an empty state, the second a full one.
    run_case(model, make_optimizer=CourseAdamW, expect={"adamw": 2})


def test_course_adamw_param_groups_and_scheduler():
    run_case(model, make_optimizer=lambda ps: CourseAdamW(no_decay_on_biases(ps)),
             make_scheduler=SCHEDULERS["step"], expect={"adamw": 6})


def test_data_adamw_without_no_grad():
    run_case(model, make_optimizer=DataAdamW, expect={"adamw": 2})


def test_scheduled_adamw_lr_computed_in_step():
    # The count is a symbol from the first compile; the Python branch on it (warmup, then cosine) is a
    # guard: steps 1-2 run one graph, steps 3-4 another, both fused.
    run_case(model, make_optimizer=ScheduledAdamW, expect={"adamw": 2}, steps=4)


class AttrAdamW(CourseAdamW):
    """The course's AdamW with its step count an attribute of a ``torch.optim.Optimizer`` subclass:
    Dynamo 2.13 drops attribute stores on such an optimizer (it would keep ``step_count`` at 0), so
    ``compile_step`` runs this step eagerly: same results, nothing fused."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.step_count = 0

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                bc1, bc2 = 1 - beta1 ** self.step_count, 1 - beta2 ** self.step_count
                p.addcdiv_(m / bc1, (v / bc2).sqrt() + group["eps"], value=-group["lr"])


def test_optimizer_subclass_assigning_attributes_runs_eagerly():
    run_case(model, make_optimizer=AttrAdamW, expect={"adamw": 0}, notes=["optimizer: AttrAdamW.step runs eagerly"])
