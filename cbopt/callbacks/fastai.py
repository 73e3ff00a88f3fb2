"""Step callbacks: the pieces optimizers are listed from.

A callback is a plain function `cb(p, **{**state, **hypers}) -> dict | None`, as in fastai. It reads the param `p`
(`p.data`, `p.grad`), its state and its group's hypers by keyword, updates `p.data` and its state in place, and
returns the new state entries it created. It never writes into `p.grad`: `l2_reg` rebinds it (see `run_chain`).
Defaults it needs are attached as `cb.defaults` and merged into the optimizer's hypers; the state it creates is
declared as `cb.state` (and `transient`, `scope`: see `cbopt.chain`).

Callbacks are written once and run in every backend: the per-param loop passes tensors, a bucket backend passes
a list-like stand-in for all the params of a bucket. So a callback uses tensor math (`torch.where`, `clamp`) rather
than Python `if`s on tensor values; branching on hypers or on the step count (plain Python numbers) is fine.

Like torch.optim, callbacks finish their temporaries in place: `(v / d).sqrt_().add_(eps)` does the same float ops
as `(v / d).sqrt() + eps` (so results stay bit-exact with fastai's) with one temporary instead of three.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._torch import computed_once
from ..core.chain import at_first_step, copy_of_param, zeros

__all__ = ['negate_grad', 'weight_decay', 'l2_reg', 'average_grad', 'dampened_grad_avg', 'average_sqr_grad', 'amsgrad_max', 'momentum_step',
           'nesterov_step', 'sgd_step', 'rms_prop_step', 'step_stat', 'debias', 'adam_step', 'radam_step',
           'qhadam_step', 'larc_layer_lr', 'larc_step', 'lamb_step', 'lookahead_keep', 'lookahead_step']


def negate_grad(p, **kwargs):
    "`maximize=True`: the rest of the chain sees `-grad`, so the step climbs the objective; `p.grad` is kept (rebound)."
    p.grad = p.grad.neg()
negate_grad.state = {}
negate_grad.torch_flag = 'maximize'  # first in the chain exactly when torch's group has maximize=True
negate_grad.sparse_grads = True  # (a sparse grad negates as one)


def decays(wd: float, do_wd: bool) -> bool:
    """Whether a decay callback works on `p`: eagerly not when `wd` is 0 (a pass over memory saved), but always when
    traced by torch.compile, where multiplying by 1 is free inside the fused loop and a branch on a float hyper is
    not: dynamo specialises the graph on `wd == 0`, which restarts its analysis (Lion's cold compile on the GPT-2 set:
    15 CPU-s against 13.5) and compiles again when a schedule later makes `wd` nonzero."""
    return do_wd and (torch.compiler.is_compiling() or wd != 0)


def weight_decay(p, lr, wd, do_wd=True, **kwargs):
    "Decoupled weight decay (AdamW-style): shrink `p` by `lr*wd`."
    if decays(wd, do_wd): p.data.mul_(1 - lr * wd)
weight_decay.defaults = dict(wd=0.)
weight_decay.state = {}
weight_decay.torch_flag = 'decoupled_weight_decay'  # torch's flag for decay that shrinks the param (AdamW's)


def l2_reg(p, lr, wd, do_wd=True, **kwargs):
    "L2 regularization: the rest of the chain sees `grad + wd*p` (torch's `weight_decay` in SGD/Adam); `p.grad` is kept."
    if decays(wd, do_wd): p.grad = p.grad.add(p.data, alpha=wd)
l2_reg.defaults = dict(wd=0.)
l2_reg.state = {}


def _l2_sparse(wd=0., **kwargs) -> str | None:
    "L2 decay adds the dense param to the grad: refused for a sparse grad unless `wd` is 0 (torch's words, Adagrad's)."
    return "weight_decay option is not compatible with sparse gradients" if wd != 0 else None
l2_reg.sparse_grads = _l2_sparse


def average_grad(p, mom, dampening=False, grad_avg=None, **kwargs):
    "Moving average of the gradient with `mom`; `dampening=True` weighs the new grad by `1-mom` (Adam's first moment)."
    if grad_avg is None: grad_avg = torch.zeros_like(p.grad.data)
    damp = 1 - mom if dampening else 1.
    grad_avg.mul_(mom).add_(p.grad.data, alpha=damp)
    return {'grad_avg': grad_avg}
average_grad.defaults = dict(mom=0.9)
average_grad.state = dict(grad_avg=zeros)
average_grad.state_kinds = dict(grad_avg='signed')


def dampened_grad_avg(p, mom, dampening=0., grad_avg=None, **kwargs):
    """torch.optim.SGD's momentum buffer: the first step keeps the grad, later ones compute `mom*avg + (1-dampening)*grad`.
    Its first step is told by the buffer's absence, as in torch (`at_first_step`: no zero buffer could stand for it)."""
    if grad_avg is None: return {'grad_avg': p.grad.data.clone()}
    grad_avg.mul_(mom).add_(p.grad.data, alpha=1 - dampening)
    return {'grad_avg': grad_avg}
dampened_grad_avg.defaults = dict(mom=0.9, dampening=0.)
dampened_grad_avg.state = dict(grad_avg=at_first_step(zeros))  # (created by the first step: absent before, as torch's)
dampened_grad_avg.state_kinds = dict(grad_avg='signed')


def average_sqr_grad(p, sqr_mom, dampening=True, sqr_avg=None, **kwargs):
    "Moving average of the squared gradient with `sqr_mom` (Adam's second moment)."
    if sqr_avg is None: sqr_avg = torch.zeros_like(p.grad.data)
    damp = 1 - sqr_mom if dampening else 1.
    sqr_avg.mul_(sqr_mom).addcmul_(p.grad.data, p.grad.data, value=damp)
    return {'sqr_avg': sqr_avg}
average_sqr_grad.defaults = dict(sqr_mom=0.99)
average_sqr_grad.state = dict(sqr_avg=zeros)
average_sqr_grad.state_kinds = dict(sqr_avg='nonnegative')


def amsgrad_max(p, sqr_avg, max_sqr_avg=None, **kwargs):
    "AMSGrad: the running maximum of the second moment, `max_sqr_avg` (torch's `max_exp_avg_sq`), which the step then uses."
    if max_sqr_avg is None: max_sqr_avg = torch.zeros_like(p.data)
    max_sqr_avg.clamp_(min=sqr_avg)  # clamp(min=t) is torch.maximum, NaNs included
    return {'max_sqr_avg': max_sqr_avg}
amsgrad_max.state = dict(max_sqr_avg=zeros)
amsgrad_max.state_kinds = dict(max_sqr_avg='nonnegative')
amsgrad_max.torch_state = dict(max_exp_avg_sq='max_sqr_avg')
amsgrad_max.torch_flag = 'amsgrad'  # in the chain exactly when torch's group has amsgrad=True


def sgd_step(p, lr, **kwargs):
    "Plain SGD step: `p -= lr * grad`."
    p.data.add_(p.grad.data, alpha=-lr)
sgd_step.state = {}
sgd_step.additive = True  # `p.data += update`: cbopt.kahan can compensate it
sgd_step.sparse_grads = True  # (a dense param adds a sparse grad, as torch's SGD does)


def momentum_step(p, lr, grad_avg, **kwargs):
    "SGD with momentum: `p -= lr * grad_avg`."
    p.data.add_(grad_avg, alpha=-lr)
momentum_step.state = {}
momentum_step.torch_state = dict(momentum_buffer='grad_avg')  # torch.optim.SGD's name for its momentum
momentum_step.additive = True  # `p.data += update`: cbopt.kahan can compensate it


def nesterov_step(p, lr, mom, grad_avg, **kwargs):
    "Nesterov momentum, as torch.optim.SGD: `p -= lr * (grad + mom*grad_avg)`."
    p.data.add_(p.grad.data.add(grad_avg, alpha=mom), alpha=-lr)
nesterov_step.state = {}
nesterov_step.torch_state = dict(momentum_buffer='grad_avg')
nesterov_step.torch_flag = 'nesterov'
nesterov_step.additive = True  # `p.data += update`: cbopt.kahan can compensate it


def rms_prop_step(p, lr, sqr_avg, eps, grad_avg=None, **kwargs):
    "RMSProp step: divide the grad (or its average) by `sqrt(sqr_avg) + eps`."
    denom = sqr_avg.sqrt().add_(eps)
    p.data.addcdiv_((grad_avg if grad_avg is not None else p.grad.data), denom, value=-lr)
rms_prop_step.defaults = dict(eps=1e-8)
rms_prop_step.state = {}
rms_prop_step.torch_state = dict(square_avg='sqr_avg')  # (fastai's momentum average has no torch name: torch's differs)


def step_stat(p, step=0, **kwargs):
    "Count the steps taken by `p` (a Python int, so it never holds a tensor back)."
    return {'step': step + 1}
step_stat.state = dict(step=0)
step_stat.state_kinds = dict(step='exact')
step_stat.torch_state = dict(step='step')  # a tensor in torch's state_dicts, a Python int here
step_stat.sparse_grads = True  # (it reads no grad)


def debias(mom: float, damp: float, step: int) -> float:
    "Bias correction of a moving average with `mom` after `step` steps."
    res = damp * (1 - mom ** step) / (1 - mom)
    # a count as a tensor (the traced step's, float64, one per bucket): the correction computed once, not per vector
    # of each param's elements, where inductor would inline its `pow` into every param's loop
    return res if isinstance(step, (int, float)) else computed_once(res)


def adam_step(p, lr, mom, step, sqr_mom, grad_avg, sqr_avg, eps, max_sqr_avg=None, **kwargs):
    "Adam step from the debiased moments (the second one's running maximum with AMSGrad: `amsgrad_max`)."
    debias1 = debias(mom, 1 - mom, step)
    debias2 = debias(sqr_mom, 1 - sqr_mom, step)
    v = sqr_avg if max_sqr_avg is None else max_sqr_avg
    p.data.addcdiv_(grad_avg, (v / debias2).sqrt_().add_(eps), value=-lr / debias1)
adam_step.defaults = dict(eps=1e-5)
adam_step.state = {}
adam_step.torch_state = dict(exp_avg='grad_avg', exp_avg_sq='sqr_avg')
adam_step.additive = True  # `p.data += update`: cbopt.kahan can compensate it


def radam_step(p, lr, mom, step, sqr_mom, grad_avg, sqr_avg, eps, beta, torch_eps=False, **kwargs):
    """RAdam step: Adam rectified by the variance of the adaptive lr; plain momentum SGD while that is undefined.
    fastai adds `eps` to the debiased root, `sqrt(v/bc2) + eps`; with `torch_eps=True` (a chain constant, which
    `cbopt.optim.RAdam` sets) it is added before debiasing, `(sqrt(v) + eps) / sqrt(bc2)`, as torch.optim.RAdam does."""
    debias1 = debias(mom, 1 - mom, step)
    debias2 = debias(sqr_mom, 1 - sqr_mom, step)
    r_inf = 2 / (1 - sqr_mom) - 1
    r = r_inf - 2 * step * sqr_mom ** step / (1 - sqr_mom ** step)
    if r > 5:
        v = math.sqrt(((r - 4) * (r - 2) * r_inf) / ((r_inf - 4) * (r_inf - 2) * r))
        if torch_eps: denom = sqr_avg.sqrt().add_(eps).div_(math.sqrt(debias2))
        else:
            denom = (sqr_avg / debias2).sqrt_()
            if eps: denom.add_(eps)
        if beta: denom = F.softplus(denom, beta)
        p.data.addcdiv_(grad_avg, denom, value=-lr * v / debias1)
    else: p.data.add_(grad_avg, alpha=-lr / debias1)
radam_step.defaults = dict(eps=1e-5, beta=0.)
radam_step.state = {}
radam_step.torch_state = dict(exp_avg='grad_avg', exp_avg_sq='sqr_avg')
radam_step.additive = True  # `p.data += update`: cbopt.kahan can compensate it


def qhadam_step(p, lr, mom, sqr_mom, sqr_avg, nu_1, nu_2, step, grad_avg, eps, **kwargs):
    "Quasi-hyperbolic Adam: mix the raw grad with the debiased moments by `nu_1` and `nu_2`."
    debias1 = debias(mom, 1 - mom, step)
    debias2 = debias(sqr_mom, 1 - sqr_mom, step)
    g = p.grad.data
    p.data.addcdiv_(((1 - nu_1) * g) + (nu_1 * (grad_avg / debias1)),
                    (((1 - nu_2) * g ** 2) + (nu_2 * (sqr_avg / debias2))).sqrt_().add_(eps),
                    value=-lr)
qhadam_step.defaults = dict(eps=1e-8, nu_1=0.7, nu_2=1.0)
qhadam_step.state = {}


def larc_layer_lr(p, lr, trust_coeff, wd, eps, clip=True, **kwargs):
    "LARC/LARS: a layer-wise lr from the ratio of the param norm to the grad norm (clipped at `lr` for LARC)."
    p_norm, g_norm = torch.linalg.vector_norm(p.data), torch.linalg.vector_norm(p.grad.data)
    local_lr = lr * trust_coeff * p_norm / (g_norm + p_norm * wd + eps)
    return {'local_lr': local_lr.clamp(max=lr) if clip else local_lr}
larc_layer_lr.defaults = dict(trust_coeff=0.02, wd=0., eps=1e-8)
larc_layer_lr.state = {}
larc_layer_lr.transient = ('local_lr',)  # used this step only: never checkpointed
larc_layer_lr.scope = 'tensor'  # norms over the whole param


def larc_step(p, local_lr, grad_avg=None, **kwargs):
    "Step with the layer-wise `local_lr` on the grad (or its average)."
    p.data.sub_((p.grad.data if grad_avg is None else grad_avg) * local_lr)
larc_step.state = {}


def lamb_step(p, lr, mom, step, sqr_mom, grad_avg, sqr_avg, eps, **kwargs):
    "LAMB step: the Adam update rescaled by the trust ratio `|p| / |update|` (capped at 10, 1 when either is 0)."
    debias1 = debias(mom, 1 - mom, step)
    debias2 = debias(sqr_mom, 1 - sqr_mom, step)
    r1 = p.data.pow(2).mean().sqrt()
    update = (grad_avg / debias1).div_((sqr_avg / debias2).sqrt_().add_(eps))
    r2 = update.pow(2).mean().sqrt()
    q = torch.where((r1 == 0) | (r2 == 0), 1., (r1 / r2).clamp(max=10))
    p.data.sub_(update * (lr * q))
lamb_step.defaults = dict(eps=1e-6, wd=0.)
lamb_step.state = {}
lamb_step.scope = 'tensor'


def lookahead_keep(p, slow_p=None, **kwargs):
    "Lookahead, first half: remember the slow weights as they were before the first fast step."
    if slow_p is None: return {'slow_p': p.data.clone()}
lookahead_keep.state = dict(slow_p=copy_of_param)
lookahead_keep.state_kinds = dict(slow_p='exact')


def lookahead_step(p, k, alpha, la_step=0, slow_p=None, **kwargs):
    "Lookahead, second half: every `k` steps move the slow weights `alpha` of the way to `p`, and restart `p` there."
    la_step += 1
    if la_step % k == 0:
        slow_p.add_(p.data - slow_p, alpha=alpha)
        p.data.copy_(slow_p)
    return {'la_step': la_step}
lookahead_step.defaults = dict(k=6, alpha=0.5)
lookahead_step.state = dict(la_step=0)
lookahead_step.state_kinds = dict(la_step='exact')
