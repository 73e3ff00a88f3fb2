"""torch.optim's other algorithms as cbopt optimizers: `Adagrad`, `Adadelta`, `Adamax`, `NAdam`, `ASGD`, `Rprop`,
`Adafactor`.

Each has torch's defaults and numerics (within float rounding of the torch class), and reads that class's state_dict.
Hyper names are fastai's where fastai has the hyper, torch's otherwise: torch's `betas` are `mom`/`sqr_mom`,
`weight_decay` is `wd` (L2 by default, as in torch; `decouple_wd=True` for AdamW-style decay), Adadelta's `rho` is
`sqr_mom`, Rprop's `etas` and `step_sizes` are `etaminus`/`etaplus` and `step_size_min`/`step_size_max` (the names of
torch's functional API: a hyper is one number per group). `maximize=True` (torch's flag) lists `negate_grad` first.
"""
from __future__ import annotations

from functools import partial
from typing import Any

from .callbacks import average_grad, average_sqr_grad, step_stat, weight_decay
from .hypers import torch_keywords
from .optimizer import Optimizer
from .optimizers import _decay, maximizing
from .torch_callbacks import (adadelta_step, adafactor_step, adagrad_step, adamax_step, asgd_step, factored_sqr_grad,
                              inf_norm_grad, nadam_step, relative_step_size, rprop_step, sqr_grad_sum)

__all__ = ['Adagrad', 'Adadelta', 'Adamax', 'NAdam', 'ASGD', 'Rprop', 'Adafactor']


def _check(ok: bool, msg: str) -> None:
    "torch's constructor checks for the hypers cbopt's own rules do not know (`cbopt.hypers.HYPER_RULES`)."
    if not ok: raise ValueError(msg)


@torch_keywords()
def Adagrad(params: Any, lr: float | slice = 1e-2, lr_decay: float = 0., initial_accumulator_value: float = 0.,
            eps: float = 1e-10, wd: float = 0., decouple_wd: bool = False, maximize: bool = False,
            backend: str = "auto") -> Optimizer:
    """torch.optim.Adagrad (`weight_decay` is `wd`). The running sum of squared grads is the state `sqr_sum` (torch's
    `sum`), set to `initial_accumulator_value` at the first step (torch sets it at construction), and `step`."""
    _check(lr_decay >= 0, f"Invalid lr_decay value: {lr_decay}")
    _check(initial_accumulator_value >= 0, f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
    cbs = _decay(decouple_wd) + [step_stat, sqr_grad_sum, adagrad_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, lr_decay=lr_decay,
                     initial_accumulator_value=initial_accumulator_value, eps=eps, wd=wd, backend=backend)


@torch_keywords(rho='sqr_mom')
def Adadelta(params: Any, lr: float | slice = 1.0, sqr_mom: float = 0.9, eps: float = 1e-6, wd: float = 0.,
             decouple_wd: bool = False, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.Adadelta: `sqr_mom` is torch's `rho`, `wd` its `weight_decay`. State: `sqr_avg` (torch's
    `square_avg`) and `delta_sqr_avg` (torch's `acc_delta`, the average of the squared updates)."""
    cbs = _decay(decouple_wd) + [average_sqr_grad, adadelta_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@torch_keywords()
def Adamax(params: Any, lr: float | slice = 2e-3, mom: float = 0.9, sqr_mom: float = 0.999, eps: float = 1e-8,
           wd: float = 0., decouple_wd: bool = False, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.Adamax: `mom`, `sqr_mom` are torch's `betas`, `wd` its `weight_decay`. State: `grad_avg` (torch's
    `exp_avg`), `inf_norm` (torch's `exp_inf`) and `step`."""
    cbs = _decay(decouple_wd) + [partial(average_grad, dampening=True), inf_norm_grad, step_stat, adamax_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@torch_keywords(decoupled_weight_decay='decouple_wd')
def NAdam(params: Any, lr: float | slice = 2e-3, mom: float = 0.9, sqr_mom: float = 0.999, eps: float = 1e-8,
          momentum_decay: float = 4e-3, wd: float = 0., decouple_wd: bool = False, maximize: bool = False,
          backend: str = "auto") -> Optimizer:
    """torch.optim.NAdam: `mom`, `sqr_mom` are torch's `betas`, `wd` its `weight_decay`, `decouple_wd` its
    `decoupled_weight_decay` (NAdamW). State: `grad_avg`, `sqr_avg`, `step` and `mu_product` (a number)."""
    _check(momentum_decay >= 0, f"Invalid momentum_decay value: {momentum_decay}")
    cbs = _decay(decouple_wd) + [partial(average_grad, dampening=True), average_sqr_grad, step_stat, nadam_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps,
                     momentum_decay=momentum_decay, wd=wd, backend=backend)


@torch_keywords()
def ASGD(params: Any, lr: float | slice = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6,
         wd: float = 0., decouple_wd: bool = False, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.ASGD (`wd` is its `weight_decay`). The averaged params, torch's `state[p]['ax']`, are
    `opt.state[p]['param_avg']` (by name: `opt.state_dict()['state'][fqn]['param_avg']`); before step `t0` they are
    the params themselves. torch also keeps `eta` and `mu` in state: cbopt computes them from `step`, `lr` and the
    hypers (so after a change of lr, the next step uses the new lr at once, where torch's `eta` lags one step)."""
    cbs = _decay(decouple_wd) + [step_stat, asgd_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, lambd=lambd, alpha=alpha, t0=t0, wd=wd, backend=backend)


@torch_keywords()
def Rprop(params: Any, lr: float | slice = 1e-2, etas: tuple[float, float] = (0.5, 1.2),
          step_sizes: tuple[float, float] = (1e-6, 50), wd: float = 0., decouple_wd: bool = False,
          maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.Rprop: `etas` become the hypers `etaminus`, `etaplus`, and `step_sizes` `step_size_min`,
    `step_size_max`; `lr` is each step size's value at the first step. State: `prev_grad` (torch's `prev`),
    `step_size` and `step`. torch's Rprop has no weight decay: `wd` (L2 by default) is cbopt's addition."""
    (etaminus, etaplus), (step_size_min, step_size_max) = etas, step_sizes
    _check(0.0 < etaminus < 1.0 < etaplus, f"Invalid eta values: {etaminus}, {etaplus}")
    cbs = _decay(decouple_wd) + [step_stat, rprop_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, etaminus=etaminus, etaplus=etaplus,
                     step_size_min=step_size_min, step_size_max=step_size_max, wd=wd, backend=backend)


@torch_keywords()
def Adafactor(params: Any, lr: float | slice = 1e-2, beta2_decay: float = -0.8,
              eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, wd: float = 0.,
              maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.Adafactor: second moments factored into row and column means for params of 2 or more dims (state
    `row_var`, `col_var`; `variance` for the others; torch's names), averaged with the weight `step**beta2_decay`; the
    step is relative to the param's rms (at least `eps[1]`) and its rms clipped to `d`. `eps` become the hypers `eps1`
    (None: the dtype's epsilon) and `eps2`, torch's functional names; `wd` (torch's `weight_decay`) is decoupled, as
    in torch."""
    eps1, eps2 = eps
    _check(beta2_decay <= 0, f"beta2_decay should be <= 0 but is: {beta2_decay}")
    _check(eps1 is None or eps1 >= 0, f"epsilon1 should be >= 0 but is: {eps1}")
    _check(eps2 >= 0, f"epsilon2 should be >= 0 but is: {eps2}")
    _check(d >= 1, f"Clipping threshold d should be >= 1 but is: {d}")
    cbs = [step_stat, relative_step_size, weight_decay, factored_sqr_grad, adafactor_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, beta2_decay=beta2_decay, eps1=eps1, eps2=eps2, d=d, wd=wd,
                     backend=backend)
