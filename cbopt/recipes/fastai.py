"""Prebuilt optimizers: each is a list of callbacks, with fastai's names, hyper names and defaults. A recipe whose
chain torch has a fused kernel for registers it here, so the engine never needs to know the recipes."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import product
from typing import Any

from ..callbacks.fastai import (adam_step, amsgrad_max, average_grad, average_sqr_grad, dampened_grad_avg, l2_reg, lamb_step,
                        larc_layer_lr, larc_step, lookahead_keep, lookahead_step, momentum_step, negate_grad, nesterov_step,
                        qhadam_step, radam_step, rms_prop_step, sgd_step, step_stat, weight_decay)
from ..engine import register_kernel
from ..engine.kernels import fused_adam, fused_adamw, fused_sgd
from ..core.hypers import torch_keywords
from ..callbacks.compensated import kahan_chain
from ..optimizer import Optimizer, rechain, takes_state_precision

__all__ = ['adam_chain', 'sgd_chain', 'maximizing', 'lookahead', 'SGD', 'RMSProp', 'Adam', 'RAdam', 'QHAdam', 'Larc', 'Lamb',
           'Lookahead', 'ranger']


def _decay(decouple_wd: bool) -> list:
    "Decoupled weight decay (AdamW-style) or L2 regularization (torch's `weight_decay`)."
    return [weight_decay] if decouple_wd else [l2_reg]


def maximizing(cbs: list, maximize: bool = True) -> list:
    """The chain `cbs`, climbing the objective with `maximize` (torch's flag): `negate_grad` first, so the rest of the
    chain (L2 included, as in torch) sees `-grad`. Listed only when asked, so a minimizing chain pays nothing."""
    return [negate_grad, *cbs] if maximize else list(cbs)


def adam_chain(step: Callable = adam_step, decouple_wd: bool = True, amsgrad: bool = False) -> list:
    """The callbacks of Adam and its relatives (RAdam, Lamb): decay, both moments (with `amsgrad`, the running maximum
    of the second), the step count, then `step`."""
    return _decay(decouple_wd) + [partial(average_grad, dampening=True), average_sqr_grad,
                                  *([amsgrad_max] if amsgrad else []), step_stat, step]


# cbopt's AdamW is exactly torch's fused AdamW, and its Adam with L2 (`decouple_wd=False`) torch's fused Adam, with
# their amsgrad and maximize flags
for _decouple, _kernel in ((True, fused_adamw), (False, fused_adam)):
    for _amsgrad in (False, True):
        for _maximize in (False, True):
            register_kernel(maximizing(adam_chain(decouple_wd=_decouple, amsgrad=_amsgrad), _maximize),
                            partial(_kernel, maximize=_maximize, amsgrad=_amsgrad))
del _decouple, _kernel, _amsgrad, _maximize


def sgd_chain(decouple_wd: bool = True, momentum: bool = False, dampened: bool = False, nesterov: bool = False) -> list:
    """SGD's callbacks: decay, then the plain step, or with `momentum` the momentum buffer (torch's, which keeps the
    first grad whole and then weighs grads by `1 - dampening`, if `dampened`) and the momentum (`nesterov`) step."""
    cbs = _decay(decouple_wd)
    if momentum: cbs.append(dampened_grad_avg if dampened else average_grad)
    cbs.append(sgd_step if not momentum else nesterov_step if nesterov else momentum_step)
    return cbs


# every SGD chain is torch's fused SGD (with decoupled decay only at zero decay: the kernel decays by L2)
for _decouple, _maximize, (_mom, _damp, _nesterov) in product(
        (True, False), (False, True), ((False, False, False), (True, False, False), (True, True, False), (True, False, True))):
    register_kernel(maximizing(sgd_chain(_decouple, _mom, _damp, _nesterov), _maximize),
                    partial(fused_sgd, momentum=_mom, dampened=_damp, nesterov=_nesterov, maximize=_maximize,
                            decoupled=_decouple))
del _decouple, _maximize, _mom, _damp, _nesterov


@takes_state_precision
@torch_keywords()
def SGD(params: Any, lr: float | slice = 1e-3, mom: float = 0., wd: float = 0., decouple_wd: bool = True,
        nesterov: bool = False, dampening: float = 0., maximize: bool = False, kahan_sum: bool = False,
        backend: str = "auto") -> Optimizer:
    """SGD, with optional momentum (`nesterov` and `dampening` as in torch.optim.SGD) and weight decay; `kahan_sum`:
    Kahan-compensated updates for bf16/fp16 params (torch-optimi's; see `cbopt.kahan`)."""
    if nesterov and (mom == 0 or dampening != 0): raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    cbs = sgd_chain(decouple_wd, mom != 0, dampening != 0, nesterov)
    extra = dict(dampening=dampening) if dampening != 0 and mom != 0 else {}  # (no momentum: torch ignores it too)
    return Optimizer(params, maximizing(kahan_chain(cbs, kahan_sum), maximize), lr=lr, mom=mom, wd=wd, **extra,
                     backend=backend)


@takes_state_precision
@torch_keywords(alpha='sqr_mom')
def RMSProp(params: Any, lr: float | slice = 1e-3, mom: float = 0., sqr_mom: float = 0.99, eps: float = 1e-8,
            wd: float = 0., decouple_wd: bool = True, maximize: bool = False, backend: str = "auto") -> Optimizer:
    "RMSProp, with optional momentum on the grads."
    cbs = _decay(decouple_wd) + ([average_sqr_grad] if mom == 0 else [average_grad, average_sqr_grad]) + [rms_prop_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom, sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@takes_state_precision
@torch_keywords()
def Adam(params: Any, lr: float | slice = 1e-3, mom: float = 0.9, sqr_mom: float = 0.99, eps: float = 1e-5,
         wd: float = 0.01, decouple_wd: bool = True, amsgrad: bool = False, maximize: bool = False,
         kahan_sum: bool = False, backend: str = "auto") -> Optimizer:
    """Adam; with `decouple_wd=True` (the default) this is AdamW. `amsgrad=True` steps with the running maximum of the
    second moment (torch's `amsgrad`; state `max_sqr_avg`, torch's `max_exp_avg_sq`). `kahan_sum`: Kahan-compensated
    updates for bf16/fp16 params (torch-optimi's; see `cbopt.kahan`)."""
    cbs = kahan_chain(adam_chain(adam_step, decouple_wd, amsgrad), kahan_sum)
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom,
                     sqr_mom=sqr_mom, eps=eps, wd=wd, backend=backend)


@takes_state_precision
@torch_keywords()
def RAdam(params: Any, lr: float | slice = 1e-3, mom: float = 0.9, sqr_mom: float = 0.99, eps: float = 1e-5,
          wd: float = 0., beta: float = 0., decouple_wd: bool = True, maximize: bool = False,
          kahan_sum: bool = False, backend: str = "auto", torch_eps: bool = False) -> Optimizer:
    """Rectified Adam; `beta > 0` makes it SAdam (softplus on the denominator); `kahan_sum` as in `Adam`;
    `torch_eps=True`: `eps` added before debiasing, as torch.optim.RAdam (see `radam_step`)."""
    step = partial(radam_step, torch_eps=True) if torch_eps else radam_step
    cbs = kahan_chain(adam_chain(step, decouple_wd), kahan_sum)
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom, sqr_mom=sqr_mom,
                     eps=eps, wd=wd, beta=beta, backend=backend)


@takes_state_precision
@torch_keywords()
def QHAdam(params: Any, lr: float | slice = 1e-3, mom: float = 0.999, sqr_mom: float = 0.999, nu_1: float = 0.7,
           nu_2: float = 1.0, eps: float = 1e-8, wd: float = 0., decouple_wd: bool = True, maximize: bool = False,
           backend: str = "auto") -> Optimizer:
    "Quasi-hyperbolic Adam."
    cbs = _decay(decouple_wd) + [partial(average_grad, dampening=True), partial(average_sqr_grad, dampening=True),
                                 step_stat, qhadam_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, nu_1=nu_1, nu_2=nu_2, mom=mom, sqr_mom=sqr_mom, eps=eps,
                     wd=wd, backend=backend)


@takes_state_precision
@torch_keywords()
def Larc(params: Any, lr: float | slice = 1e-3, mom: float = 0.9, clip: bool = True, trust_coeff: float = 0.02,
         eps: float = 1e-8, wd: float = 0., decouple_wd: bool = True, maximize: bool = False,
         backend: str = "auto") -> Optimizer:
    "LARC (`clip=True`) or LARS (`clip=False`): layer-wise adaptive learning rates."
    cbs = _decay(decouple_wd) + ([average_grad] if mom != 0 else []) + [partial(larc_layer_lr, clip=clip), larc_step]
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, mom=mom, trust_coeff=trust_coeff, eps=eps, wd=wd,
                     backend=backend)


@takes_state_precision
@torch_keywords()
def Lamb(params: Any, lr: float | slice = 1e-3, mom: float = 0.9, sqr_mom: float = 0.99, eps: float = 1e-5,
         wd: float = 0., decouple_wd: bool = True, maximize: bool = False, backend: str = "auto") -> Optimizer:
    "LAMB: Adam with a layer-wise trust ratio."
    return Optimizer(params, maximizing(adam_chain(lamb_step, decouple_wd), maximize), lr=lr, mom=mom, sqr_mom=sqr_mom,
                     eps=eps, wd=wd, backend=backend)


def lookahead(cbs: list) -> list:
    "A chain with Lookahead around it: keep the slow weights before the chain, move towards them after."
    return [lookahead_keep, *cbs, lookahead_step]


def Lookahead(opt: Optimizer, k: int = 6, alpha: float = 0.5) -> Optimizer:
    "`opt` with Lookahead: every `k` steps its params move back `1-alpha` of the way to slow weights (same backend)."
    if not 0 <= alpha <= 1: raise ValueError(f"Invalid alpha value: {alpha} (expected 0 <= alpha <= 1: Lookahead's step towards the fast weights)")
    if getattr(opt, 'in_backward', False):  # its hooks would keep stepping the params: twice per step
        raise TypeError("Lookahead(InBackward(opt)) would step every param twice: wrap the other way, InBackward(Lookahead(opt))")
    return rechain(opt, lookahead, k=k, alpha=alpha)


@takes_state_precision
@torch_keywords()
def ranger(params: Any, lr: float | slice = 1e-3, mom: float = 0.95, wd: float = 0.01, eps: float = 1e-6, k: int = 6,
           alpha: float = 0.5, backend: str = "auto", **kwargs) -> Optimizer:
    "RAdam with Lookahead (fastai's `ranger`)."
    return Lookahead(RAdam(params, lr=lr, mom=mom, wd=wd, eps=eps, backend=backend, **kwargs), k=k, alpha=alpha)
