"""The modern optimizers users install from other packages, as cbopt optimizers: `Lion` (lion-pytorch's `Lion`).

Each has its reference's defaults and numerics (within float rounding of the reference class, tested step by step).
Hyper names are fastai's where fastai has the hyper (`mom`/`sqr_mom` for `betas`, `wd` for `weight_decay`, `eps`),
the reference's otherwise.
"""
from __future__ import annotations

from typing import Any

from .callbacks import weight_decay
from .modern_callbacks import lion_avg, lion_step
from .optimizer import Optimizer

__all__ = ['Lion']


def Lion(params: Any, lr: float | slice = 1e-4, mom: float = 0.9, sqr_mom: float = 0.99, wd: float = 0.,
         backend: str = "auto") -> Optimizer:
    """lion-pytorch's `Lion`: `mom`, `sqr_mom` are its `betas`, `wd` its `weight_decay`, decoupled as there (`p *= 1 -
    lr * wd` before the step). State: `grad_avg` (its `exp_avg`)."""
    return Optimizer(params, [weight_decay, lion_step, lion_avg], lr=lr, mom=mom, sqr_mom=sqr_mom, wd=wd,
                     backend=backend)
