"""Step callbacks for torch.optim's algorithms that cbopt's own callbacks do not cover: Adagrad, Adadelta, Adamax,
NAdam, ASGD, Rprop, Adafactor, Muon and torch's RMSprop (listed into optimizers in `cbopt.torch_optimizers`
and `cbopt.optim`).

Each follows torch's `_single_tensor_<algo>` float op for float op where it can, so the results stay within rounding
of torch's classes; what cbopt already has is reused (`l2_reg`/`weight_decay`, `average_grad`, `average_sqr_grad`,
`step_stat`, `debias`, `rms_prop_step`). Everything is tensor math (`torch.where`, `clamp`), so every callback runs
per param, per bucket and compiled; the only Python branches are on hypers and the step count.
"""
from __future__ import annotations

import math

import torch

from .fastai import debias, rms_prop_step
from ..core.chain import declared_for, per_tensor, zeros
from ..core.dtensor import on_whole

__all__ = ['sqr_grad_sum', 'adagrad_step', 'sparse_adam_step', 'adadelta_step', 'inf_norm_grad', 'adamax_step', 'nadam_step', 'asgd_step',
           'rprop_step', 'relative_step_size', 'factored_sqr_grad', 'adafactor_step', 'muon_momentum', 'newton_schulz',
           'muon_step', 'centered_grad_avg', 'torch_rmsprop_step', 'torch_rmsprop_momentum_step']


def _sparse_grad(p) -> torch.Tensor | None:
    """`p`'s grad, coalesced (its repeated indices summed), if it is sparse; else None. A bucket's grads (a TensorList)
    are never sparse (the engine steps sparse grads in the loop runner), and a bucket has no one `is_sparse`."""
    g = p.grad
    return g.coalesce() if isinstance(g, torch.Tensor) and g.is_sparse else None


def _sparse(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    "A sparse tensor with the indices of the coalesced sparse `like` and these values."
    return torch.sparse_coo_tensor(like.indices(), values, like.shape)


def sqr_grad_sum(p, step, initial_accumulator_value, sqr_sum=None, **kwargs):
    """Adagrad's running sum of squared grads, `sqr_sum`, set to `initial_accumulator_value` at the first step. A sparse
    grad (coalesced: its repeated indices summed first) adds its squared values at its indices, as torch's does."""
    if sqr_sum is None: sqr_sum = torch.zeros_like(p.data)
    if step == 1: sqr_sum.fill_(initial_accumulator_value)  # torch fills it at construction: a fresh torch state loads as is
    if (grad := _sparse_grad(p)) is not None: sqr_sum.add_(_sparse(grad.values().pow(2), grad))
    else: sqr_sum.addcmul_(p.grad.data, p.grad.data, value=1)
    return {'sqr_sum': sqr_sum}
sqr_grad_sum.defaults = dict(initial_accumulator_value=0.)
sqr_grad_sum.state = dict(sqr_sum=zeros)
sqr_grad_sum.state_kinds = dict(sqr_sum='accumulator')
sqr_grad_sum.torch_state = dict(sum='sqr_sum')
sqr_grad_sum.sparse_grads = True


def adagrad_step(p, lr, lr_decay, step, sqr_sum, eps, **kwargs):
    """Adagrad step: RMSProp's step on the sum of squared grads, with the lr decayed as `lr / (1 + (step-1)*lr_decay)`.
    A sparse grad steps only the entries at its indices, as torch's Adagrad does."""
    clr = lr / (1 + (step - 1) * lr_decay)
    if (grad := _sparse_grad(p)) is not None:
        std = sqr_sum.sparse_mask(grad).values().sqrt_().add_(eps)
        p.data.add_(_sparse(grad.values() / std, grad), alpha=-clr)
    else: rms_prop_step(p, clr, sqr_sum, eps)
adagrad_step.defaults = dict(lr_decay=0., eps=1e-10)
adagrad_step.state = {}
adagrad_step.sparse_grads = True


def sparse_adam_step(p, lr, mom, sqr_mom, eps, step=0, grad_avg=None, sqr_avg=None, **kwargs):
    """torch's SparseAdam (`torch.optim._functional.sparse_adam`), op for op: Adam masked to the indices of the sparse
    grad (coalesced), its moments `grad_avg`, `sqr_avg` updated there only; an empty grad counts a step and changes
    nothing else. It takes sparse grads only (`sparse_grads = 'only'`: a dense one is refused, as torch's is), and counts
    its own steps, so that the refusal comes before anything changes."""
    grad = _sparse_grad(p)
    if grad is None:
        raise RuntimeError("SparseAdam does not support dense gradients, please consider Adam instead")
    if grad_avg is None: grad_avg = torch.zeros_like(p.data)
    if sqr_avg is None: sqr_avg = torch.zeros_like(p.data)
    step += 1
    values = grad.values()
    if values.numel():
        old_avg, old_sqr = grad_avg.sparse_mask(grad).values(), sqr_avg.sparse_mask(grad).values()
        avg_update = values.sub(old_avg).mul_(1 - mom)  # old += (1 - b) * (new - old), at the grad's indices
        sqr_update = values.pow(2).sub_(old_sqr).mul_(1 - sqr_mom)
        grad_avg.add_(_sparse(avg_update, grad))
        sqr_avg.add_(_sparse(sqr_update, grad))
        denom = sqr_update.add_(old_sqr).sqrt_().add_(eps)
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        step_size = lr * math.sqrt(1 - sqr_mom ** step) / (1 - mom ** step)
        p.data.add_(_sparse(-step_size * avg_update.add_(old_avg).div_(denom), grad))
    return {'step': step, 'grad_avg': grad_avg, 'sqr_avg': sqr_avg}
sparse_adam_step.defaults = dict(mom=0.9, sqr_mom=0.999, eps=1e-8)
sparse_adam_step.state = dict(step=0, grad_avg=zeros, sqr_avg=zeros)
sparse_adam_step.state_kinds = dict(step='exact', grad_avg='signed', sqr_avg='nonnegative')
sparse_adam_step.torch_state = dict(step='step', exp_avg='grad_avg', exp_avg_sq='sqr_avg')
sparse_adam_step.sparse_grads = 'only'
sparse_adam_step.supports_complex = False


def adadelta_step(p, lr, sqr_mom, eps, sqr_avg, delta_sqr_avg=None, **kwargs):
    "Adadelta: step by `grad * rms(past updates) / rms(grads)`, and average the squared update with `sqr_mom` (torch's rho)."
    if delta_sqr_avg is None: delta_sqr_avg = torch.zeros_like(p.data)
    delta = delta_sqr_avg.add(eps).sqrt_().div_(sqr_avg.add(eps).sqrt_()).mul_(p.grad.data)
    delta_sqr_avg.mul_(sqr_mom).addcmul_(delta, delta, value=1 - sqr_mom)
    p.data.add_(delta, alpha=-lr)
    return {'delta_sqr_avg': delta_sqr_avg}
adadelta_step.defaults = dict(sqr_mom=0.9, eps=1e-6)
adadelta_step.state = dict(delta_sqr_avg=zeros)
adadelta_step.state_kinds = dict(delta_sqr_avg='nonnegative')
adadelta_step.torch_state = dict(square_avg='sqr_avg', acc_delta='delta_sqr_avg')


def inf_norm_grad(p, sqr_mom, eps, inf_norm=None, **kwargs):
    "Adamax's exponentially weighted infinity norm of the grads: `max(sqr_mom * inf_norm, |grad| + eps)`."
    if inf_norm is None: inf_norm = torch.zeros_like(p.data)
    inf_norm.mul_(sqr_mom).clamp_(min=p.grad.data.abs().add_(eps))  # clamp(min=t) is torch.maximum, NaNs included
    return {'inf_norm': inf_norm}
inf_norm_grad.defaults = dict(sqr_mom=0.999, eps=1e-8)
inf_norm_grad.state = dict(inf_norm=zeros)
inf_norm_grad.state_kinds = dict(inf_norm='nonnegative')
inf_norm_grad.torch_state = dict(exp_inf='inf_norm')


def adamax_step(p, lr, mom, step, grad_avg, inf_norm, **kwargs):
    "Adamax step: the debiased grad average over the infinity norm."
    p.data.addcdiv_(grad_avg, inf_norm, value=-lr / debias(mom, 1 - mom, step))
adamax_step.state = {}
adamax_step.torch_state = dict(exp_avg='grad_avg')


def _scalar_one(p) -> torch.Tensor:
    "Initializer: a 0-d one (one per param of a bucket), in float32 (float64 for float64 params), as torch's `mu_product`."
    return p.data.new_ones((), dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)


def nadam_step(p, lr, mom, sqr_mom, eps, step, momentum_decay, grad_avg, sqr_avg, mu_product=None, **kwargs):
    """NAdam step: Nesterov momentum in Adam, with the momentum warmed up by `momentum_decay`. Keeps the product of the
    momentums so far, `mu_product`, as a 0-d tensor (as torch does; a Python float would recompile the fused chain at
    every step) and scales the grads by it first, as torch's capturable NAdam does."""
    if mu_product is None: mu_product = _scalar_one(p)
    mu = mom * (1. - 0.5 * 0.96 ** (step * momentum_decay))
    mu_next = mom * (1. - 0.5 * 0.96 ** ((step + 1) * momentum_decay))
    mu_product.mul_(mu)
    denom = (sqr_avg / debias(sqr_mom, 1 - sqr_mom, step)).sqrt_().add_(eps)
    p.data.addcdiv_(p.grad.data * (-lr * (1. - mu) / (1. - mu_product)), denom)
    p.data.addcdiv_(grad_avg * (-lr * mu_next / (1. - mu_product * mu_next)), denom)
    return {'mu_product': mu_product}
nadam_step.defaults = dict(eps=1e-8, momentum_decay=4e-3)
nadam_step.state = dict(mu_product=_scalar_one)
nadam_step.state_kinds = dict(mu_product='exact')
nadam_step.torch_state = dict(exp_avg='grad_avg', exp_avg_sq='sqr_avg', mu_product='mu_product')


def asgd_rates(lr, lambd: float, alpha: float, t0: float, step: int) -> tuple:
    "torch's ASGD `eta` (the decayed lr) and `mu` (the averaging weight) used at step `step`: computed from `step - 1`."
    eta = lr / (1 + lambd * lr * (step - 1)) ** alpha
    return eta, 1. if step == 1 else 1. / max(1., step - 1 - t0)


def asgd_step(p, lr, lambd, alpha, t0, step, param_avg=None, **kwargs):
    """ASGD: an SGD step with the decaying lr `eta` and decay `lambd*eta`, then the running average of the params
    (`param_avg`, torch's `ax`) from step `t0` on. `eta` and the averaging weight `mu` are torch's, from the step count."""
    if param_avg is None: param_avg = torch.zeros_like(p.data)
    eta, mu = asgd_rates(lr, lambd, alpha, t0, step)
    p.data.mul_(1 - lambd * eta)
    p.data.add_(p.grad.data, alpha=-eta)
    if mu == 1: param_avg.copy_(p.data)
    else: param_avg.add_(p.data.sub(param_avg).mul_(mu))
    return {'param_avg': param_avg}
asgd_step.defaults = dict(lambd=1e-4, alpha=0.75, t0=1e6)
asgd_step.state = dict(param_avg=zeros)
asgd_step.state_kinds = dict(param_avg='exact')
asgd_step.torch_state = dict(ax='param_avg')
# torch keeps the next step's eta and mu in its state: a torch state_dict gets them (`cbopt.state.torch_class_state_dict`)
asgd_step.torch_extra_state = lambda lr, lambd, alpha, t0, step, **kw: dict(
    zip(('eta', 'mu'), (float(v.detach() if isinstance(v, torch.Tensor) else v)  # (a tensor lr may require grad)
                        for v in asgd_rates(lr, lambd, alpha, t0, step + 1))))
asgd_step.torch_names = dict(alpha='alpha')  # torch's ASGD's alpha is this power, not RMSprop's alpha (sqr_mom)


def rprop_step(p, lr, etaminus, etaplus, step_size_min, step_size_max, step, prev_grad=None, step_size=None, **kwargs):
    """Rprop: grow each element's step size by `etaplus` where the grad kept its sign, shrink it by `etaminus` (and
    skip the element this step) where it flipped; step by the sign of the grad. Step sizes start at the first step's lr."""
    if prev_grad is None: prev_grad, step_size = torch.zeros_like(p.data), torch.zeros_like(p.data)
    if step == 1: step_size.fill_(lr)  # torch creates them at the first step, from the group's lr then
    sign = p.grad.data.mul(prev_grad).sign_()
    up, flipped = sign > 0, sign < 0
    factor = torch.where(up, etaplus, torch.where(flipped, etaminus, sign.add_(1)))  # sign is 0 there: 1 (NaN stays)
    step_size.mul_(factor).clamp_(step_size_min, step_size_max)
    prev_grad.copy_(p.grad.data).masked_fill_(flipped, 0)
    p.data.addcmul_(prev_grad.sign(), step_size, value=-1)
    return {'prev_grad': prev_grad, 'step_size': step_size}
rprop_step.defaults = dict(etaminus=0.5, etaplus=1.2, step_size_min=1e-6, step_size_max=50.)
rprop_step.state = dict(prev_grad=zeros, step_size=zeros)
rprop_step.state_kinds = dict(prev_grad='exact', step_size='exact')
rprop_step.torch_state = dict(prev='prev_grad', step_size='step_size')
rprop_step.torch_names = dict(etas=('etaminus', 'etaplus'), step_sizes=('step_size_min', 'step_size_max'))


def _rms(x):
    "The root mean square of a whole tensor (one per param of a bucket)."
    return x.square().mean().sqrt()


def relative_step_size(p, lr, step, eps2, **kwargs):
    """Adafactor's step size for this step, `step_size`: `max(eps2, rms(p)) * min(lr, 1/sqrt(step))`, from the param
    before weight decay (as torch computes it)."""
    return {'step_size': _rms(p.data).clamp_(min=eps2).mul_(min(lr, 1 / step ** 0.5))}
relative_step_size.defaults = dict(eps2=1e-3)
relative_step_size.state = {}
relative_step_size.transient = ('step_size',)
relative_step_size.scope = 'tensor'
relative_step_size.torch_names = dict(eps=('eps1', 'eps2'))


def _row_var(p):
    "Initializer: Adafactor's row factor (the last dim reduced), for params of 2 or more dims."
    return p.data.new_zeros((*p.shape[:-1], 1)) if p.ndim > 1 else None


def _col_var(p):
    "Initializer: Adafactor's column factor (the last but one dim reduced), for params of 2 or more dims."
    return p.data.new_zeros((*p.shape[:-2], 1, p.shape[-1])) if p.ndim > 1 else None


def _variance(p):
    "Initializer: Adafactor's unfactored second moment, for params of fewer than 2 dims."
    return torch.zeros_like(p.data) if p.ndim <= 1 else None


def factored_sqr_grad(p, step, beta2_decay, row_var=None, col_var=None, variance=None, **kwargs):
    """Adafactor's second moment, averaged with the weight `step**beta2_decay`: for a param of 2 or more dims as the
    mean squared grad of each row (`row_var`) and of each column (`col_var`), else in full (`variance`); torch's names."""
    if row_var is None and variance is None:  # the first step: the entries of this param's rank
        new = declared_for(factored_sqr_grad, p)
        row_var, col_var, variance = new.get('row_var'), new.get('col_var'), new.get('variance')
    g, w = p.grad.data, step ** beta2_decay
    if variance is not None:
        variance.lerp_(g * g, w)
        return {'variance': variance}
    row_var.lerp_(g.square().mean(dim=-1, keepdim=True), w)
    col_var.lerp_(g.square().mean(dim=-2, keepdim=True), w)
    return {'row_var': row_var, 'col_var': col_var}
factored_sqr_grad.defaults = dict(beta2_decay=-0.8)
factored_sqr_grad.state = dict(row_var=_row_var, col_var=_col_var, variance=_variance)
factored_sqr_grad.state_kinds = dict(row_var='nonnegative', col_var='nonnegative', variance='nonnegative')
factored_sqr_grad.torch_state = dict(row_var='row_var', col_var='col_var', variance='variance')
factored_sqr_grad.scope = 'tensor'


def adafactor_step(p, step_size, d, eps1, row_var=None, col_var=None, variance=None, **kwargs):
    """Adafactor step: the grad over the root of the second moment (the outer product of the factors over the rows'
    mean, for a factored one), its rms clipped to `d`, times `step_size`. `eps1=None` is the dtype's epsilon."""
    eps1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
    if variance is not None: v = variance.clone()
    else: v = torch.matmul(row_var, col_var).div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
    update = v.clamp_(min=eps1 * eps1).rsqrt_().mul_(p.grad.data)
    p.data.sub_(update.mul_(step_size / (_rms(update) / d).clamp_(min=1.)))
adafactor_step.defaults = dict(d=1., eps1=None)
adafactor_step.state = {}
adafactor_step.scope = 'tensor'
adafactor_step.supports_complex = False  # factored second moments of a complex param: torch refuses them too
adafactor_step.torch_names = dict(d='d', beta2_decay='beta2_decay', eps=('eps1', 'eps2'))


def muon_momentum(p, mom, nesterov, grad_avg=None, **kwargs):
    """Muon's momentum, `grad_avg` (torch's `momentum_buffer`), a lerp towards the grad with `1-mom`, and the update it
    orthogonalizes, `muon_update`: the grad lerped back towards it with `mom` (Nesterov's, the default) or itself."""
    if grad_avg is None: grad_avg = torch.zeros_like(p.data)
    g = p.grad.data
    grad_avg.lerp_(g, 1 - mom)
    return {'grad_avg': grad_avg, 'muon_update': g.lerp(grad_avg, mom) if nesterov else grad_avg}
muon_momentum.defaults = dict(mom=0.95, nesterov=True)
muon_momentum.state = dict(grad_avg=zeros)
muon_momentum.state_kinds = dict(grad_avg='signed')
muon_momentum.torch_state = dict(momentum_buffer='grad_avg')
muon_momentum.torch_names = dict(nesterov='nesterov')  # a hyper in torch's Muon (SGD's nesterov is a flag)
muon_momentum.transient = ('muon_update',)


def newton_schulz(x: torch.Tensor, a: float, b: float, c: float, steps: int, eps: float) -> torch.Tensor:
    """`steps` quintic Newton-Schulz iterations towards the orthogonal factor of the matrix `x`, in bfloat16, on the
    wide side (a tall matrix is transposed): torch's `_zeropower_via_newtonschulz`, op for op."""
    if x.ndim != 2: raise ValueError(f"Muon orthogonalizes 2-D matrices, got a param of shape {tuple(x.shape)}")
    tall = x.size(0) > x.size(1)
    o = x.bfloat16()
    if tall: o = o.T
    o = o.div_(o.norm().clamp(min=eps))
    for _ in range(steps):
        gram = o @ o.T
        o = torch.addmm(o, torch.addmm(gram, gram, gram, beta=b, alpha=c), o, beta=a)
    return o.T if tall else o


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape) -> float:
    "Muon's lr for a matrix of `shape`, so updates of any aspect have a like rms: torch's `adjust_lr_fn` rules."
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == 'original': return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == 'match_rms_adamw': return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def muon_step(p, lr, muon_update, ns_a, ns_b, ns_c, ns_steps, eps, adjust_lr_fn, **kwargs):
    """Muon step: the orthogonalized update (`newton_schulz` with torch's `ns_coefficients` as `ns_a`, `ns_b`, `ns_c`),
    at the lr adjusted to the matrix's shape. Both depend on each param's shape: run per param, also in a bucket. A
    matrix sharded across ranks (FSDP2) is orthogonalized whole, gathered on every rank, each keeping its shard."""
    def step(w, u):  # in w's dtype before the lr scales it (as torch's add_ does, also when compiled)
        o = on_whole(lambda x: newton_schulz(x, ns_a, ns_b, ns_c, ns_steps, eps).to(w.dtype), u)
        return w.add_(o, alpha=-_adjusted_lr(lr, adjust_lr_fn, w.shape))
    per_tensor(step, p.data, muon_update)
muon_step.defaults = dict(ns_a=3.4445, ns_b=-4.775, ns_c=2.0315, ns_steps=5, eps=1e-7, adjust_lr_fn=None)
muon_step.state = {}
muon_step.scope = 'tensor'
muon_step.supports_complex = False  # orthogonalisation of a real matrix (torch refuses complex too)
muon_step.torch_names = dict(ns_coefficients=('ns_a', 'ns_b', 'ns_c'), ns_steps='ns_steps', adjust_lr_fn='adjust_lr_fn')


def centered_grad_avg(p, sqr_mom, grad_avg=None, **kwargs):
    "torch.optim.RMSprop's `centered` mean of the grads (torch's `grad_avg`), moved `1 - alpha` towards the grad."
    if grad_avg is None: grad_avg = torch.zeros_like(p.data)
    grad_avg.lerp_(p.grad.data, 1 - sqr_mom)
    return {'grad_avg': grad_avg}
centered_grad_avg.state = dict(grad_avg=zeros)
centered_grad_avg.state_kinds = dict(grad_avg='signed')
centered_grad_avg.torch_state = dict(grad_avg='grad_avg')
centered_grad_avg.torch_flag = 'centered'


def _rmsprop_denom(sqr_avg, grad_avg, eps):
    "torch's RMSprop denominator: `sqrt(sqr_avg - grad_avg**2) + eps` when centered (a `grad_avg`), else `sqrt(sqr_avg) + eps`."
    v = sqr_avg if grad_avg is None else sqr_avg.addcmul(grad_avg, grad_avg, value=-1)
    return v.sqrt().add_(eps)


def torch_rmsprop_step(p, lr, eps, sqr_avg, grad_avg=None, **kwargs):
    "torch.optim.RMSprop's step without momentum: `p -= lr * grad / rms` (`rms` centered when the chain keeps `grad_avg`)."
    p.data.addcdiv_(p.grad.data, _rmsprop_denom(sqr_avg, grad_avg, eps), value=-lr)
torch_rmsprop_step.defaults = dict(eps=1e-8)
torch_rmsprop_step.state = {}
torch_rmsprop_step.torch_state = dict(square_avg='sqr_avg')


def torch_rmsprop_momentum_step(p, lr, mom, eps, sqr_avg, grad_avg=None, mom_buf=None, **kwargs):
    """torch.optim.RMSprop's step with momentum (unlike fastai's, which averages the grads before dividing):
    `mom_buf = mom * mom_buf + grad / rms` (torch's `momentum_buffer`), then `p -= lr * mom_buf`."""
    if mom_buf is None: mom_buf = torch.zeros_like(p.data)
    mom_buf.mul_(mom).addcdiv_(p.grad.data, _rmsprop_denom(sqr_avg, grad_avg, eps))
    p.data.add_(mom_buf, alpha=-lr)
    return {'mom_buf': mom_buf}
torch_rmsprop_momentum_step.defaults = dict(eps=1e-8)
torch_rmsprop_momentum_step.state = dict(mom_buf=zeros)
torch_rmsprop_momentum_step.state_kinds = dict(mom_buf='signed')
torch_rmsprop_momentum_step.torch_state = dict(square_avg='sqr_avg', momentum_buffer='mom_buf')  # not SGD's momentum_buffer (grad_avg)
