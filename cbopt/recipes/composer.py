"""MosaicML Composer's optimizers, `DecoupledSGDW` and `DecoupledAdamW`, as cbopt optimizers: torch's SGD and AdamW
with Composer's decay, `fully_decoupled_wd` (`p *= 1 - wd * lr / initial_lr`, before the step), and Composer's
argument names and defaults. Composer's own classes pin an old torch; these run with cbopt's backends and checkpoints.
"""
from __future__ import annotations

from functools import partial
from typing import Any

from ..callbacks.composer import fully_decoupled_wd
from ..callbacks.fastai import adam_step, amsgrad_max, average_grad, average_sqr_grad, step_stat
from ..engine import register_kernel
from ..engine.kernels import fused_adamw
from ..optimizer import Optimizer, takes_state_precision
from .fastai import sgd_chain

__all__ = ['decoupled_adamw_chain', 'DecoupledSGDW', 'DecoupledAdamW']


def decoupled_adamw_chain(amsgrad: bool = False) -> list:
    "Composer's AdamW: its decay first (as Composer decays before the moments), both moments, the step count, the step."
    return [fully_decoupled_wd, partial(average_grad, dampening=True), average_sqr_grad,
            *([amsgrad_max] if amsgrad else []), step_stat, adam_step]


def fused_decoupled_adamw(b, hyper, amsgrad: bool = False, **scales):
    """torch's fused AdamW kernel for Composer's chain: its decay `lr * wd'` is Composer's `wd * lr / initial_lr` at
    `wd' = wd / initial_lr` (within rounding). None (the chain runs) for an `initial_lr` that is 0 or a tensor."""
    ilr = hyper['initial_lr']
    if isinstance(ilr, bool) or not isinstance(ilr, (int, float)) or ilr == 0: return None
    return fused_adamw(b, {**hyper, 'wd': hyper['wd'] / ilr}, amsgrad=amsgrad, **scales)


for _amsgrad in (False, True):
    register_kernel(decoupled_adamw_chain(_amsgrad), partial(fused_decoupled_adamw, amsgrad=_amsgrad))
del _amsgrad


@takes_state_precision
def DecoupledSGDW(params: Any, lr: float, momentum: float = 0., dampening: float = 0., weight_decay: float = 0.,
                  nesterov: bool = False, backend: str = "auto") -> Optimizer:
    """Composer's `DecoupledSGDW`: torch's SGD (momentum buffer `grad_avg`, torch's `momentum_buffer`; `nesterov`,
    `dampening` as there) with Composer's decay: each step shrinks a param by `weight_decay * lr / initial_lr`,
    `initial_lr` being its group's lr when the group joined. Composer's arguments and defaults (`lr` has none).
    Composer logs a warning for `weight_decay >= 1e-3`; cbopt does not (it is a value, not a mistake)."""
    if nesterov and (momentum == 0 or dampening != 0): raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    cbs = [fully_decoupled_wd, *sgd_chain(True, momentum != 0, dampening != 0, nesterov)[1:]]
    extra = dict(dampening=dampening) if dampening != 0 else {}
    return Optimizer(params, cbs, lr=lr, mom=momentum, wd=weight_decay, **extra, backend=backend)


@takes_state_precision
def DecoupledAdamW(params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                   weight_decay: float = 1e-5, amsgrad: bool = False, backend: str = "auto") -> Optimizer:
    """Composer's `DecoupledAdamW`: Adam whose decay shrinks a param by `weight_decay * lr / initial_lr` per step
    (`initial_lr`: its group's lr when the group joined), so `DecoupledAdamW(weight_decay=w)` is torch's
    `AdamW(weight_decay=w / initial_lr)`. Composer's defaults: `betas=(0.9, 0.95)`, `weight_decay=1e-5`. State as
    cbopt's Adam: `grad_avg`, `sqr_avg` (torch's `exp_avg`, `exp_avg_sq`), `max_sqr_avg` with `amsgrad`, `step`.
    torch's fused AdamW kernel runs it where it applies (`fused_decoupled_adamw`)."""
    mom, sqr_mom = betas
    return Optimizer(params, decoupled_adamw_chain(amsgrad), lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=weight_decay,
                     backend=backend)
