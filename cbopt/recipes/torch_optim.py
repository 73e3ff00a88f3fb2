"""torch.optim's other algorithms as cbopt optimizers: `Adagrad`, `Adadelta`, `Adamax`, `NAdam`, `ASGD`, `Rprop`,
`Adafactor`, `Muon` (with AdamW for the params it does not suit, in the same optimizer).

Each has torch's defaults and numerics (within float rounding of the torch class), and reads that class's state_dict.
Hyper names are fastai's where fastai has the hyper, torch's otherwise: torch's `betas` are `mom`/`sqr_mom`,
`weight_decay` is `wd` (L2 by default, as in torch; `decouple_wd=True` for AdamW-style decay), Adadelta's `rho` is
`sqr_mom`, Rprop's `etas` and `step_sizes` are `etaminus`/`etaplus` and `step_size_min`/`step_size_max` (the names of
torch's functional API: a hyper is one number per group). `maximize=True` (torch's flag) lists `negate_grad` first.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from functools import partial
from itertools import product
from typing import Any

import torch

from ..engine import register_kernel
from ..engine.kernels import fused_adagrad
from ..callbacks.fastai import average_grad, average_sqr_grad, step_stat, weight_decay
from ..core.hypers import torch_keywords
from ..optimizer import Optimizer, takes_state_precision
from .fastai import _decay, adam_chain, maximizing
from ..core.hypers import expand_hyper
from ..core.params import named_groups
from ..callbacks.torch_optim import (adadelta_step, adafactor_step, adagrad_step, adamax_step, asgd_step, factored_sqr_grad,
                              inf_norm_grad, muon_momentum, muon_step, nadam_step, relative_step_size, rprop_step,
                              sqr_grad_sum)

__all__ = ['adagrad_chain', 'Adagrad', 'Adadelta', 'Adamax', 'NAdam', 'ASGD', 'Rprop', 'Adafactor', 'muon_chain',
           'is_hidden_matrix', 'Muon']


def _check(ok: bool, msg: str) -> None:
    "torch's constructor checks for the hypers cbopt's own rules do not know (`cbopt.hypers.HYPER_RULES`)."
    if not ok: raise ValueError(msg)


def adagrad_chain(decouple_wd: bool = False) -> list:
    "Adagrad's callbacks: decay, the step count, the running sum of squared grads, the step."
    return _decay(decouple_wd) + [step_stat, sqr_grad_sum, adagrad_step]


# torch's fused Adagrad (with decoupled decay only at zero decay: the kernel decays by L2)
for _decouple, _maximize in product((False, True), (False, True)):
    register_kernel(maximizing(adagrad_chain(_decouple), _maximize),
                    partial(fused_adagrad, maximize=_maximize, decoupled=_decouple))
del _decouple, _maximize


@takes_state_precision
@torch_keywords()
def Adagrad(params: Any, lr: float | slice = 1e-2, lr_decay: float = 0., initial_accumulator_value: float = 0.,
            eps: float = 1e-10, wd: float = 0., decouple_wd: bool = False, maximize: bool = False,
            backend: str = "auto") -> Optimizer:
    """torch.optim.Adagrad (`weight_decay` is `wd`). The running sum of squared grads is the state `sqr_sum` (torch's
    `sum`), set to `initial_accumulator_value` at the first step (torch sets it at construction), and `step`."""
    _check(lr_decay >= 0, f"Invalid lr_decay value: {lr_decay}")
    _check(initial_accumulator_value >= 0, f"Invalid initial_accumulator_value value: {initial_accumulator_value}")
    return Optimizer(params, maximizing(adagrad_chain(decouple_wd), maximize), lr=lr, lr_decay=lr_decay,
                     initial_accumulator_value=initial_accumulator_value, eps=eps, wd=wd, backend=backend)


@takes_state_precision
@torch_keywords(rho='sqr_mom')
def Adadelta(params: Any, lr: float | slice = 1.0, sqr_mom: float = 0.9, eps: float = 1e-6, wd: float = 0.,
             decouple_wd: bool = False, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.Adadelta: `sqr_mom` is torch's `rho`, `wd` its `weight_decay`. State: `sqr_avg` (torch's
    `square_avg`), `delta_sqr_avg` (torch's `acc_delta`, the average of the squared updates) and `step` (as torch's,
    which a torch state_dict must hold; the math does not use it)."""
    cbs = _decay(decouple_wd) + [average_sqr_grad, step_stat, adadelta_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@takes_state_precision
@torch_keywords()
def Adamax(params: Any, lr: float | slice = 2e-3, mom: float = 0.9, sqr_mom: float = 0.999, eps: float = 1e-8,
           wd: float = 0., decouple_wd: bool = False, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.Adamax: `mom`, `sqr_mom` are torch's `betas`, `wd` its `weight_decay`. State: `grad_avg` (torch's
    `exp_avg`), `inf_norm` (torch's `exp_inf`) and `step`."""
    cbs = _decay(decouple_wd) + [partial(average_grad, dampening=True), inf_norm_grad, step_stat, adamax_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@takes_state_precision
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


@takes_state_precision
@torch_keywords()
def ASGD(params: Any, lr: float | slice = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6,
         wd: float = 0., decouple_wd: bool = False, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.ASGD (`wd` is its `weight_decay`). The averaged params, torch's `state[p]['ax']`, are
    `opt.state[p]['param_avg']` (by name: `opt.named_state_dict()['state'][fqn]['param_avg']`); before step `t0` they are
    the params themselves. torch also keeps `eta` and `mu` in state: cbopt computes them from `step`, `lr` and the
    hypers (so after a change of lr, the next step uses the new lr at once, where torch's `eta` lags one step)."""
    cbs = _decay(decouple_wd) + [step_stat, asgd_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, lambd=lambd, alpha=alpha, t0=t0, wd=wd, backend=backend)


@takes_state_precision
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


@takes_state_precision
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


def muon_chain() -> list:
    "Muon's callbacks: decoupled weight decay, the momentum (Nesterov's by default), the orthogonalized step."
    return [weight_decay, muon_momentum, muon_step]


# name parts of the params Muon's users give AdamW though they are matrices: embeddings and the output head
NOT_HIDDEN = ('embed', 'wte', 'wpe', 'lm_head', 'head', 'output', 'classifier', 'fc_out')


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's default choice: a 2-D param that is not an embedding or the output head, by its FQN (a part of the name
    containing 'embed', or one of `NOT_HIDDEN`: 'wte', 'lm_head', 'head', ...)."""
    parts = name.split('.')
    return p.ndim == 2 and not any('embed' in part or part in NOT_HIDDEN for part in parts)


ADAMW = dict(lr=1e-3, mom=0.9, sqr_mom=0.999, eps=1e-8, wd=0.01)  # torch.optim.AdamW's defaults


@takes_state_precision
@torch_keywords()
def Muon(params: Any, lr: float | slice = 1e-3, wd: float = 0.1, mom: float = 0.95, nesterov: bool = True,
         ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315), eps: float = 1e-7, ns_steps: int = 5,
         adjust_lr_fn: str | None = None, muon_params: Callable[[str, torch.Tensor], bool] | Collection[str] = is_hidden_matrix,
         adamw: Mapping | None = None, maximize: bool = False, backend: str = "auto") -> Optimizer:
    """torch.optim.Muon for the hidden matrices, AdamW for every other param, in one optimizer: each given group is
    split into a Muon group and an AdamW group (per-group chains). `muon_params` picks the Muon params: a predicate
    `(fqn, param) -> bool` (default `is_hidden_matrix`: 2-D, not an embedding or the output head) or a collection of
    FQNs. The AdamW groups take `adamw`'s hypers over torch.optim.AdamW's defaults (`ADAMW`). A bare list of 2-D
    params is Muon alone, as torch's. Muon's hypers: `mom` is torch's `momentum`, `wd` its `weight_decay`,
    `ns_coefficients` the hypers `ns_a`, `ns_b`, `ns_c`; state `grad_avg` (torch's `momentum_buffer`)."""
    _check(adjust_lr_fn in (None, 'original', 'match_rms_adamw'),
           f"Adjust learning rate function {adjust_lr_fn} is not supported")
    _check(isinstance(ns_steps, int) and 0 <= ns_steps < 100,
           f"ns_steps must be an int below 100 (Newton-Schulz iterations per step), got {ns_steps!r}")
    a, b, c = ns_coefficients
    if not callable(muon_params):
        chosen = set(muon_params)
        pick = lambda name, p: name in chosen
    else: pick = muon_params
    given = named_groups(params)
    muon = dict(lr=lr, wd=wd, mom=mom, nesterov=nesterov, ns_a=a, ns_b=b, ns_c=c, ns_steps=ns_steps, eps=eps,
                adjust_lr_fn=adjust_lr_fn)
    per_group = {k: expand_hyper(k, v, len(given)) for k, v in muon.items()}  # lr=slice(...) spreads as fastai's
    groups, layers, names = [], [], set()
    for i, g in enumerate(given):
        muon = {k: vs[i] for k, vs in per_group.items()}
        own = {k: v for k, v in g.items() if k not in ('params', 'param_names')}
        pairs = list(zip(g['param_names'], g['params']))
        names |= {n for n, _ in pairs}
        ours = [(n, p) for n, p in pairs if pick(n, p)]
        for n, p in ours:
            if p.ndim != 2: raise ValueError(f"Muon only supports 2D parameters, but {n!r} has size {tuple(p.shape)}")
        rest = [(n, p) for n, p in pairs if not pick(n, p)]
        if ours: groups.append({**muon, **own, 'params': [p for _, p in ours], 'param_names': [n for n, _ in ours]})
        if rest: groups.append({**ADAMW, **(adamw or {}), 'cbs': maximizing(adam_chain(), maximize),
                                'params': [p for _, p in rest], 'param_names': [n for n, _ in rest]})
        layers += [i] * (bool(ours) + bool(rest))
    if not callable(muon_params) and (unknown := chosen - names):
        raise KeyError(f"muon_params names {sorted(unknown)}, which are not among the params")
    opt = Optimizer(groups, maximizing(muon_chain(), maximize), backend=backend)
    opt.split_groups(layers, len(given))  # freeze_to counts the given groups, each split in two here
    return opt
