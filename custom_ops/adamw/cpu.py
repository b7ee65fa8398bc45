"""The plain-torch AdamW the op runs on CPU tensors: per tensor, fp32 math, each result rounded
once to its storage dtype (as the kernel does)."""
import math

import torch


def torch_step(params, grads, exp_avgs, exp_avg_sqs, lr: float, t: float, beta1, beta2, eps, weight_decay,
               torch_semantics):
    """One AdamW step in place; ``lr`` and ``t`` are host numbers the caller has checked."""
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32, g32, m32, v32 = (x.to(torch.float32, copy=True) for x in (p, g, m, v))
        p32.mul_(1 - lr * weight_decay)
        m32.mul_(beta1).add_(g32, alpha=1 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
        if torch_semantics:
            p32.addcdiv_(m32, v32.sqrt().div_(math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        else:
            p32.addcdiv_(m32, v32.sqrt().add_(eps), value=-lr * math.sqrt(bc2) / bc1)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)
