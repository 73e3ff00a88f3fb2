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

import math

import torch

from .fastai import decays, weight_decay
from ..core.chain import copy_of_param, zeros

__all__ = ['lion_step', 'lion_avg', 'adan_avgs', 'adan_step', 'proximal_decay', 'slow_grad_avg', 'ademamix_step',
           'debiased_avgs', 'stable_lr', 'stable_decay', 'stable_adamw_step', 'schedule_free_weight',
           'adam_normalize_grad', 'schedule_free_step']


def lion_step(p, lr, mom, grad_avg=None, **kwargs):
    """Lion (Chen et al. 2023): step by the sign of the grad interpolated with its average, `mom` (beta1) of the way
    towards the average: `p -= lr * sign(mom * grad_avg + (1 - mom) * grad)`, lion-pytorch's float ops."""
    if grad_avg is None: grad_avg = torch.zeros_like(p.data)
    p.data.add_(grad_avg.mul(mom).add_(p.grad.data, alpha=1 - mom).sign_(), alpha=-lr)
    return {'grad_avg': grad_avg}
lion_step.defaults = dict(mom=0.9)
lion_step.state = dict(grad_avg=zeros)
lion_step.state_kinds = dict(grad_avg='signed')
lion_step.additive = True


def lion_avg(p, sqr_mom, grad_avg, **kwargs):
    "Lion's average of the grads, updated after the step at its own rate `sqr_mom` (beta2)."
    grad_avg.mul_(sqr_mom).add_(p.grad.data, alpha=1 - sqr_mom)
lion_avg.defaults = dict(sqr_mom=0.99)
lion_avg.state = {}


# -- Adan (pytorch-optimizer's Adan: Xie et al. 2022) ----------------------------------------------------------------
def adan_avgs(p, mom, diff_mom, sqr_mom, step, grad_avg=None, diff_avg=None, sqr_avg=None, prev_grad=None, **kwargs):
    """Adan's three averages: of the grads (`mom`, beta1), of their differences from the last grad (`diff_mom`, beta2)
    and of the squares of `grad + diff_mom * difference` (`sqr_mom`, beta3); then keep the grad in `prev_grad`. The
    first step has no difference (pytorch-optimizer starts `previous_grad` at the first grad)."""
    if grad_avg is None: grad_avg, diff_avg, sqr_avg, prev_grad = (torch.zeros_like(p.data) for _ in range(4))
    g = p.grad.data
    if step == 1: prev_grad.copy_(g)
    diff = g - prev_grad
    grad_avg.lerp_(g, 1. - mom)
    diff_avg.lerp_(diff, 1. - diff_mom)
    diff.mul_(diff_mom).add_(g)
    sqr_avg.mul_(sqr_mom).addcmul_(diff, diff, value=1. - sqr_mom)
    prev_grad.copy_(g)
    return {'grad_avg': grad_avg, 'diff_avg': diff_avg, 'sqr_avg': sqr_avg, 'prev_grad': prev_grad}
adan_avgs.defaults = dict(mom=0.98, diff_mom=0.92, sqr_mom=0.99)
adan_avgs.state = dict(grad_avg=zeros, diff_avg=zeros, sqr_avg=zeros, prev_grad=zeros)
adan_avgs.state_kinds = dict(grad_avg='signed', diff_avg='signed', sqr_avg='nonnegative', prev_grad='signed')


def adan_step(p, lr, mom, diff_mom, sqr_mom, eps, step, grad_avg, diff_avg, sqr_avg, **kwargs):
    "Adan's step: the debiased grad average and difference average over the debiased root of `sqr_avg`."
    denom = sqr_avg.sqrt().div_(math.sqrt(1. - sqr_mom ** step)).add_(eps)
    p.data.addcdiv_(grad_avg, denom, value=-lr / (1. - mom ** step))
    p.data.addcdiv_(diff_avg, denom, value=-lr * diff_mom / (1. - diff_mom ** step))
adan_step.defaults = dict(eps=1e-8)
adan_step.state = {}
adan_step.additive = True


def proximal_decay(p, lr, wd, do_wd=True, **kwargs):
    "Adan's default (proximal) weight decay, after the step: `p /= 1 + lr * wd`."
    if decays(wd, do_wd): p.data.div_(1. + lr * wd)
proximal_decay.defaults = dict(wd=0.)
proximal_decay.state = {}


# -- AdEMAMix (pytorch-optimizer's AdEMAMix: Pagliardini et al. 2024) ------------------------------------------------
def _warmup_alpha(slow_alpha: float, t_alpha_beta3: float | None, step: int) -> float:
    "AdEMAMix's weight of the slow average at `step`: warmed up linearly over `t_alpha_beta3` steps."
    if t_alpha_beta3 is None or step >= t_alpha_beta3: return slow_alpha  # (a branch on the step, not min() on
    return step * slow_alpha / t_alpha_beta3                                  # floats: torch.compile guards those)


def _warmup_beta3(mom: float, slow_mom: float, t_alpha_beta3: float | None, step: int) -> float:
    "AdEMAMix's rate of the slow average at `step`: from `mom` to `slow_mom` over `t_alpha_beta3` steps (log-scaled)."
    if t_alpha_beta3 is None or step >= t_alpha_beta3: return slow_mom  # pytorch-optimizer's min(..., slow_mom)
    log1, log3, f = math.log(mom), math.log(slow_mom), step / t_alpha_beta3
    return slow_mom ** (log1 / ((1. - f) * log3 + f * log1))  # exp(log1*log3/...), without exp() of a traced float


def slow_grad_avg(p, mom, slow_mom, step, t_alpha_beta3=None, slow_avg=None, **kwargs):
    "AdEMAMix's slow average of the grads, at the rate `slow_mom` (beta3), warmed up over `t_alpha_beta3` steps."
    if slow_avg is None: slow_avg = torch.zeros_like(p.data)
    slow_avg.lerp_(p.grad.data, 1. - _warmup_beta3(mom, slow_mom, t_alpha_beta3, step))
    return {'slow_avg': slow_avg}
slow_grad_avg.defaults = dict(slow_mom=0.9999, t_alpha_beta3=None)
slow_grad_avg.state = dict(slow_avg=zeros)
slow_grad_avg.state_kinds = dict(slow_avg='signed')


def ademamix_step(p, lr, mom, sqr_mom, eps, step, slow_alpha, grad_avg, sqr_avg, slow_avg, t_alpha_beta3=None, **kwargs):
    "AdEMAMix's step: Adam's, with `slow_alpha` times the slow average added to the debiased fast one."
    denom = sqr_avg.sqrt().div_(math.sqrt(1. - sqr_mom ** step)).add_(eps)
    update = grad_avg.div(1. - mom ** step).add_(slow_avg, alpha=_warmup_alpha(slow_alpha, t_alpha_beta3, step))
    p.data.addcdiv_(update, denom, value=-lr)
ademamix_step.defaults = dict(eps=1e-8, slow_alpha=5.)
ademamix_step.state = {}
ademamix_step.additive = True


# -- StableAdamW (torch-optimi's StableAdamW: Wortsman et al. 2023) --------------------------------------------------
def _debiased_beta(beta: float, step: int) -> float:
    "torch-optimi's debiased beta: averaging with it gives the debiased average directly (0 at the first step)."
    return (beta ** step - beta) / (beta ** step - 1)


def debiased_avgs(p, mom, sqr_mom, step, grad_avg=None, sqr_avg=None, **kwargs):
    "torch-optimi's moments: the grads' and squared grads' averages with debiased betas, so they need no debiasing."
    if grad_avg is None: grad_avg, sqr_avg = torch.zeros_like(p.data), torch.zeros_like(p.data)
    b1, b2 = _debiased_beta(mom, step), _debiased_beta(sqr_mom, step)
    grad_avg.lerp_(p.grad.data, 1 - b1)
    sqr_avg.mul_(b2).addcmul_(p.grad.data, p.grad.data, value=1 - b2)
    return {'grad_avg': grad_avg, 'sqr_avg': sqr_avg}
debiased_avgs.defaults = dict(mom=0.9, sqr_mom=0.99)
debiased_avgs.state = dict(grad_avg=zeros, sqr_avg=zeros)
debiased_avgs.state_kinds = dict(grad_avg='signed', sqr_avg='nonnegative')


def stable_lr(p, lr, eps, sqr_avg, **kwargs):
    """StableAdamW's lr for this param and step: `lr` divided by the RMS of `grad / sqrt(sqr_avg)` where that is above
    1 (AdaFactor's update clipping), a 0-d tensor (no `.item()`: no sync, and it stays one value per param of a bucket)."""
    rms = p.grad.data.pow(2).div_(sqr_avg.clamp(min=eps * eps)).mean().sqrt()
    return {'stable_lr': lr / rms.clamp(min=1.)}
stable_lr.defaults = dict(eps=1e-6)
stable_lr.state = {}
stable_lr.transient = ('stable_lr',)
stable_lr.scope = 'tensor'  # a mean over the whole param


def stable_decay(p, stable_lr, wd, do_wd=True, **kwargs):
    "StableAdamW's decoupled weight decay, with the clipped lr: `p *= 1 - stable_lr * wd`."
    weight_decay(p, stable_lr, wd, do_wd)
stable_decay.defaults = dict(wd=1e-2)
stable_decay.state = {}


def stable_adamw_step(p, stable_lr, eps, grad_avg, sqr_avg, **kwargs):
    "StableAdamW's step: the (already debiased) moments' Adam step with the clipped lr."
    p.data.addcdiv_(grad_avg * -stable_lr, sqr_avg.sqrt().add_(eps))
stable_adamw_step.defaults = dict(eps=1e-6)
stable_adamw_step.state = {}
stable_adamw_step.additive = True


# -- schedule-free SGD and AdamW (schedulefree's SGDScheduleFree and AdamWScheduleFree: Defazio et al. 2024) --------
def _float64(value: float):
    "Initializer: a 0-d float64 tensor on the param's device, a running number torch.compile neither guards nor specializes on."
    def init(p) -> torch.Tensor: return p.data.new_full((), value, dtype=torch.float64)  # (one per param of a bucket)
    return init


def schedule_free_weight(p, lr, step, warmup_steps, r, weight_lr_power, weight_sum=None, lr_max=None, **kwargs):
    """Schedule-free's lr for this step (linear warmup over `warmup_steps`) and the weight `ckp1` of the new point in
    the average: `step**r * lr_max**weight_lr_power` over their running sum (schedulefree keeps these per group, cbopt
    per param, as the step count; they agree when every param steps every time). `weight_sum` and `lr_max` are 0-d
    float64 tensors (schedulefree's Python floats, in the same precision), so the compiled chain never recompiles."""
    if weight_sum is None: weight_sum, lr_max = _float64(0.)(p), _float64(-1.)(p)
    lr = lr * torch.sym_min(step / torch.sym_max(warmup_steps, 1), 1.)  # warmup, with no branch to recompile on
    lr_max = lr_max.clamp(min=lr)  # max(lr_max, lr); new tensors, not in place (seen lost by aot_eager's graphs)
    weight = lr_max.pow(weight_lr_power).mul_(step ** r)
    weight_sum = weight_sum + weight
    ckp1 = torch.where(weight_sum > 0, weight.div_(weight_sum), 0.)  # (a zero sum has zero weights: lr 0 so far)
    return {'weight_sum': weight_sum, 'lr_max': lr_max, 'sf_lr': lr, 'ckp1': ckp1}
schedule_free_weight.defaults = dict(warmup_steps=0, r=0., weight_lr_power=2.)
schedule_free_weight.state = dict(weight_sum=_float64(0.), lr_max=_float64(-1.))
schedule_free_weight.state_kinds = dict(weight_sum='exact', lr_max='exact')
schedule_free_weight.transient = ('sf_lr', 'ckp1')


def adam_normalize_grad(p, sqr_mom, eps, step, sqr_avg, **kwargs):
    "The rest of the chain sees the grad over the debiased root of `sqr_avg` (schedule-free AdamW's); `p.grad` is kept."
    p.grad = p.grad.data.div(sqr_avg.div(1 - sqr_mom ** step).sqrt_().add_(eps))
adam_normalize_grad.defaults = dict(eps=1e-8)
adam_normalize_grad.state = {}


def schedule_free_step(p, sf_lr, ckp1, mom, z=None, **kwargs):
    """Schedule-free's step: `p` is `y`, the point where grads are taken, between the SGD iterate `z` and the average
    `x`; move `y` as schedulefree does (without computing `x`), then step `z`. `mom` is its momentum (AdamW's beta1).
    `opt.eval()` swaps the average `x` into the params, `opt.train()` swaps `y` back (`on_eval`, `on_train`)."""
    if z is None: z = p.data.clone()
    p.data.lerp_(z, ckp1)
    p.data.addcmul_(p.grad.data, sf_lr * (mom * (1 - ckp1) - 1))  # add_(alpha=) bit for bit, with a 0-d tensor
    z.sub_(p.grad.data, alpha=sf_lr)
    return {'z': z}
schedule_free_step.defaults = dict(mom=0.9, train_mode=False)
schedule_free_step.state = dict(z=copy_of_param)
schedule_free_step.state_kinds = dict(z='exact')


def _to_average(p, mom, z, **kwargs):
    "`opt.eval()`: from `y` to the average `x` (schedulefree's `p.lerp_(z, 1 - 1/beta1)`)."
    p.data.lerp_(z, 1 - 1 / mom)


def _to_train_point(p, mom, z, **kwargs):
    "`opt.train()`: from the average `x` back to `y` (schedulefree's `p.lerp_(z, 1 - beta1)`)."
    p.data.lerp_(z, 1 - mom)


schedule_free_step.on_eval, schedule_free_step.on_train = _to_average, _to_train_point
