"""The modern optimizers users install from other packages, as cbopt optimizers: `Lion` (lion-pytorch's `Lion`),
`Adan` and `AdEMAMix` (pytorch-optimizer's), `StableAdamW` (torch-optimi's), `ScheduleFreeSGD` and `ScheduleFreeAdamW`
(schedulefree's `SGDScheduleFree` and `AdamWScheduleFree`).

Each has its reference's defaults and numerics (within float rounding of the reference class, tested step by step),
torch's `maximize`, and `kahan_sum` (Kahan-compensated updates for bf16/fp16 params, `cbopt.kahan`) where torch-optimi
offers it (Lion, Adan, StableAdamW).
Hyper names are fastai's where fastai has the hyper (`mom`/`sqr_mom` for `betas`, `wd` for `weight_decay`, `eps`),
the reference's otherwise.
"""
from __future__ import annotations

from typing import Any

from functools import partial

from ..callbacks.fastai import average_grad, average_sqr_grad, l2_reg, step_stat, weight_decay
from ..callbacks.modern import (adam_normalize_grad, adan_avgs, adan_step, ademamix_step, debiased_avgs, lion_avg,
                               lion_step, proximal_decay, schedule_free_step, schedule_free_weight, slow_grad_avg,
                               stable_adamw_step, stable_decay, stable_lr)
from ..core.hypers import torch_keywords
from ..optimizer import Optimizer, takes_state_precision
from ..callbacks.compensated import kahan_chain
from .fastai import _decay, maximizing

__all__ = ['Lion', 'Adan', 'AdEMAMix', 'StableAdamW', 'ScheduleFreeSGD', 'ScheduleFreeAdamW']


@takes_state_precision
@torch_keywords()  # lion-pytorch's betas and weight_decay too
def Lion(params: Any, lr: float | slice = 1e-4, mom: float = 0.9, sqr_mom: float = 0.99, wd: float = 0.,
         maximize: bool = False, kahan_sum: bool = False, backend: str = "auto") -> Optimizer:
    """lion-pytorch's `Lion`: `mom`, `sqr_mom` are its `betas`, `wd` its `weight_decay`, decoupled as there (`p *= 1 -
    lr * wd` before the step). State: `grad_avg` (its `exp_avg`)."""
    cbs = maximizing(kahan_chain([weight_decay, lion_step, lion_avg], kahan_sum), maximize)
    return Optimizer(params, cbs, lr=lr, mom=mom, sqr_mom=sqr_mom, wd=wd,
                     backend=backend)


@takes_state_precision
@torch_keywords(betas=('mom', 'diff_mom', 'sqr_mom'), weight_decouple='decouple_wd')  # pytorch-optimizer's names too
def Adan(params: Any, lr: float | slice = 1e-3, mom: float = 0.98, diff_mom: float = 0.92, sqr_mom: float = 0.99,
         eps: float = 1e-8, wd: float = 0., decouple_wd: bool = False, maximize: bool = False, kahan_sum: bool = False, backend: str = "auto") -> Optimizer:
    """pytorch-optimizer's `Adan`: its `betas` are `mom`, `diff_mom`, `sqr_mom`, its `weight_decay` `wd`. Its weight
    decay is Adan's proximal one (`p /= 1 + lr*wd` after the step) unless `decouple_wd` (its `weight_decouple`: `p *=
    1 - lr*wd` before). State: `grad_avg`, `diff_avg`, `sqr_avg`, `prev_grad` (its `exp_avg`, `exp_avg_diff`,
    `exp_avg_sq`, and `previous_grad` with the sign flipped) and `step`. Its `max_grad_norm` is not offered: clip with
    `cbopt.GradientClippingOptimizer` (torch's formula, not the same eps)."""
    cbs = ([weight_decay] if decouple_wd else []) + [step_stat, adan_avgs, adan_step] + ([] if decouple_wd else [proximal_decay])
    cbs = maximizing(kahan_chain(cbs, kahan_sum), maximize)
    return Optimizer(params, cbs, lr=lr, mom=mom, diff_mom=diff_mom, sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@takes_state_precision
@torch_keywords(betas=('mom', 'sqr_mom', 'slow_mom'), alpha='slow_alpha', weight_decouple='decouple_wd')
def AdEMAMix(params: Any, lr: float | slice = 1e-3, mom: float = 0.9, sqr_mom: float = 0.999, slow_mom: float = 0.9999,
             slow_alpha: float = 5., t_alpha_beta3: float | None = None, eps: float = 1e-8, wd: float = 0.,
             decouple_wd: bool = False, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """pytorch-optimizer's `AdEMAMix`: its `betas` are `mom`, `sqr_mom`, `slow_mom` (the slow average's rate), its
    `alpha` is `slow_alpha` (the slow average's weight; Lookahead's `alpha` is another hyper), `t_alpha_beta3` warms
    both up over that many steps; `wd` is L2 unless `decouple_wd` (its `weight_decouple`). State: `grad_avg`,
    `sqr_avg`, `slow_avg` (its `exp_avg`, `exp_avg_sq`, `exp_avg_slow`) and `step`."""
    cbs = _decay(decouple_wd) + [partial(average_grad, dampening=True), average_sqr_grad, step_stat, slow_grad_avg,
                                 ademamix_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom, sqr_mom=sqr_mom, slow_mom=slow_mom, slow_alpha=slow_alpha,
                     t_alpha_beta3=t_alpha_beta3, eps=eps, wd=wd, backend=backend)


@takes_state_precision
@torch_keywords()
def StableAdamW(params: Any, lr: float | slice = 1e-3, mom: float = 0.9, sqr_mom: float = 0.99, eps: float = 1e-6,
                wd: float = 1e-2, maximize: bool = False, kahan_sum: bool = False, backend: str = "auto") -> Optimizer:
    """torch-optimi's `StableAdamW`: AdamW whose lr is divided, per param, by the RMS of `grad / sqrt(sqr_avg)` where
    that exceeds 1, for weight decay and step alike. `mom`, `sqr_mom` are its `betas`, `wd` its `weight_decay`. Its
    moments are optimi's debiased ones. State: `grad_avg`, `sqr_avg` (its `exp_avg`, `exp_avg_sq`) and `step`."""
    cbs = maximizing(kahan_chain([step_stat, debiased_avgs, stable_lr, stable_decay, stable_adamw_step], kahan_sum), maximize)
    return Optimizer(params, cbs, lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@takes_state_precision
@torch_keywords()
def ScheduleFreeSGD(params: Any, lr: float | slice = 1.0, mom: float = 0.9, wd: float = 0., warmup_steps: int = 0,
                    r: float = 0., weight_lr_power: float = 2., maximize: bool = False, backend: str = "auto") -> Optimizer:
    """schedulefree's `SGDScheduleFree`: `mom` is its `momentum`, `wd` its `weight_decay` (L2, at `y`). As there, it
    starts in eval mode and refuses to step until `opt.train()`; `opt.eval()` puts the averaged weights in the params
    (before validating or saving), `opt.train()` puts them back. cbopt's fastai integration does both for a Learner.
    State: `z`, `step`, `weight_sum`, `lr_max` (schedulefree keeps the last three per group: `k`, ...)."""
    if not 0 < mom < 1: raise ValueError(f"Momentum must be between 0 and 1 exclusive: {mom}")
    cbs = maximizing([step_stat, schedule_free_weight, l2_reg, schedule_free_step], maximize)
    return Optimizer(params, cbs, lr=lr, mom=mom, wd=wd, warmup_steps=warmup_steps, r=r, weight_lr_power=weight_lr_power,
                     backend=backend)


@takes_state_precision
@torch_keywords()
def ScheduleFreeAdamW(params: Any, lr: float | slice = 2.5e-3, mom: float = 0.9, sqr_mom: float = 0.999,
                      eps: float = 1e-8, wd: float = 0., warmup_steps: int = 0, r: float = 0., weight_lr_power: float = 2.,
                      maximize: bool = False, backend: str = "auto") -> Optimizer:
    """schedulefree's `AdamWScheduleFree`: `mom`, `sqr_mom` are its `betas`, `wd` its `weight_decay` (added to the
    normalized grad, at `y`). Modes as `ScheduleFreeSGD`'s (`opt.train()` before stepping, `opt.eval()` to evaluate).
    State: `z`, `sqr_avg` (its `exp_avg_sq`), `step`, `weight_sum`, `lr_max`."""
    cbs = maximizing([step_stat, schedule_free_weight, average_sqr_grad, adam_normalize_grad, l2_reg, schedule_free_step],
                     maximize)
    return Optimizer(params, cbs, lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=wd, warmup_steps=warmup_steps, r=r,
                     weight_lr_power=weight_lr_power, backend=backend)
