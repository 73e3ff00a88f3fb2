"""Step callbacks for the modern optimizers their users install from other packages: Lion (lion-pytorch), Adan and
AdEMAMix (pytorch-optimizer), StableAdamW (torch-optimi), and schedule-free SGD and AdamW (schedulefree). Listed into
optimizers in `cbopt.modern_optimizers`.

Each follows its reference's float ops where it can, so the results stay within rounding of the reference's class;
what cbopt already has is reused (`weight_decay`, `l2_reg`, `average_sqr_grad`, `step_stat`). Everything is tensor
math, so every callback runs per param, per bucket and compiled; the only Python branches are on hypers and the step.
A callback whose only effect on the param is `p.data += update` declares `additive = True`: `cbopt.kahan` can then
give it Kahan-compensated summation (see `cbopt.kahan`).
"""
from __future__ import annotations

import torch

from .chain import zeros

__all__ = ['lion_step', 'lion_avg']


def lion_step(p, lr, mom, grad_avg=None, **kwargs):
    """Lion (Chen et al. 2023): step by the sign of the grad interpolated with its average, `mom` (beta1) of the way
    towards the average: `p -= lr * sign(mom * grad_avg + (1 - mom) * grad)`, lion-pytorch's float ops."""
    if grad_avg is None: grad_avg = torch.zeros_like(p.data)
    p.data.add_(grad_avg.mul(mom).add_(p.grad.data, alpha=1 - mom).sign_(), alpha=-lr)
    return {'grad_avg': grad_avg}
lion_step.defaults = dict(mom=0.9)
lion_step.state = dict(grad_avg=zeros)
lion_step.additive = True


def lion_avg(p, sqr_mom, grad_avg, **kwargs):
    "Lion's average of the grads, updated after the step at its own rate `sqr_mom` (beta2)."
    grad_avg.mul_(sqr_mom).add_(p.grad.data, alpha=1 - sqr_mom)
lion_avg.defaults = dict(sqr_mom=0.99)
lion_avg.state = {}
