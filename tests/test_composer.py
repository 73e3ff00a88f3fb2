"""Composer's `DecoupledSGDW` and `DecoupledAdamW` (`cbopt.recipes.composer`, the callback `fully_decoupled_wd`)
against Composer's update written out from its published code (composer/optim/decoupled_weight_decay.py: Composer pins
an old torch and cannot be installed here), against torch's AdamW at `weight_decay = w / initial_lr`, in every
backend, and with groups added later (each gets its own `initial_lr`, where Composer raises KeyError)."""
import copy
import math

import pytest
import torch

import cbopt
from cbopt.testing import check_callback
from conftest import assert_moved, assert_rel_close, make_model, set_grads

pytestmark = pytest.mark.usefixtures('one_thread')

STEPS = 25
BACKENDS = ['loop', 'foreach', cbopt.Backend('fused', compiler='aot_eager'), 'auto']


def schedule(step: int) -> float:
    "A warmup then a decay: the factor on each group's first lr at `step` (so lr / initial_lr moves both ways)."
    return min(1., (step + 1) / 5) * 0.9 ** max(0, step - 5)


# -- Composer's update, written out from its code (the order of operations as there) -----------------------------------
def reference_steps(model, groups, steps):
    """`(name, param, lr, initial_lr)` for each param of each group (lists of param names with their `initial_lr`) at
    each of `steps` steps, the grads set and the lr scheduled as `run_cbopt` does, under no_grad: the loop both of
    Composer's steps below share."""
    ps = dict(model.named_parameters())
    for i in range(steps):
        set_grads(model, i)
        with torch.no_grad():
            for names, initial_lr in groups:
                lr = initial_lr * schedule(i)
                for n in names: yield n, ps[n], lr, initial_lr


def composer_decay(p, lr, initial_lr, weight_decay):
    "Composer's decoupled decay: `p *= 1 - (lr / initial_lr) * wd`, the whole `wd` where `initial_lr` is 0."
    if weight_decay != 0:
        decay_factor = (lr / initial_lr) if initial_lr else 1.0
        p.mul_(1 - decay_factor * weight_decay)


def composer_adamw(model, groups, steps, betas=(0.9, 0.95), eps=1e-8, weight_decay=1e-5, amsgrad=False):
    """Composer's DecoupledAdamW.step on `model`: per group (lists of param names with their `lr`), the decay
    `p *= 1 - (lr / initial_lr) * wd` first, then the moments and the bias-corrected step, as torch's AdamW."""
    beta1, beta2 = betas
    state = {n: dict(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p), max_exp_avg_sq=torch.zeros_like(p))
             for n, p in model.named_parameters()}
    for n, p, lr, initial_lr in reference_steps(model, groups, steps):
        s, grad = state[n], p.grad
        s['step'] += 1
        composer_decay(p, lr, initial_lr, weight_decay)
        bias_correction1 = 1 - beta1 ** s['step']
        bias_correction2 = 1 - beta2 ** s['step']
        s['exp_avg'].mul_(beta1).add_(grad, alpha=1 - beta1)
        s['exp_avg_sq'].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if amsgrad:
            torch.maximum(s['max_exp_avg_sq'], s['exp_avg_sq'], out=s['max_exp_avg_sq'])
            denom = (s['max_exp_avg_sq'].sqrt() / math.sqrt(bias_correction2)).add_(eps)
        else: denom = (s['exp_avg_sq'].sqrt() / math.sqrt(bias_correction2)).add_(eps)
        p.addcdiv_(s['exp_avg'], denom, value=-lr / bias_correction1)


def composer_sgdw(model, groups, steps, momentum=0., dampening=0., weight_decay=0., nesterov=False):
    """Composer's DecoupledSGDW.step: torch's SGD momentum buffer (the first grad whole), then the decay
    `p *= 1 - (lr / initial_lr) * wd`, then `p -= lr * d_p`."""
    bufs = {}
    for n, p, lr, initial_lr in reference_steps(model, groups, steps):
        d_p = p.grad
        if momentum != 0:
            if n not in bufs: bufs[n] = torch.clone(d_p).detach()
            else: bufs[n].mul_(momentum).add_(d_p, alpha=1 - dampening)
            d_p = d_p.add(bufs[n], alpha=momentum) if nesterov else bufs[n]
        composer_decay(p, lr, initial_lr, weight_decay)
        p.add_(d_p, alpha=-lr)


def run_cbopt(opt, model, steps):
    "`steps` steps of `opt`, its groups' lr set from their initial_lr by `schedule` before each (as a scheduler does)."
    for i in range(steps):
        for g in opt.param_groups: g['lr'] = g['initial_lr'] * schedule(i)
        set_grads(model, i)
        opt.step()


def two_lr_groups(model, lrs=(3e-2, 1e-2)):
    "The body and the head of `make_model`, named, with their own lr."
    ps = list(model.named_parameters())
    return [{'params': ps[:2], 'lr': lrs[0]}, {'params': ps[2:], 'lr': lrs[1]}]


@pytest.mark.parametrize('backend', BACKENDS, ids=str)
@pytest.mark.parametrize('amsgrad', [False, True])
def test_decoupled_adamw_follows_composer(backend, amsgrad):
    """25 steps with two groups of different lr under a warmup-then-decay schedule and a large decay (so the decay's
    share of the update is visible): every backend follows Composer's update within float rounding."""
    model, start = make_model(), make_model()
    ref = copy.deepcopy(model)
    kw = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05, amsgrad=amsgrad)
    opt = cbopt.DecoupledAdamW(two_lr_groups(model), backend=backend, **kw)
    run_cbopt(opt, model, STEPS)
    names = [n for n, _ in model.named_parameters()]
    composer_adamw(ref, [(names[:2], 3e-2), (names[2:], 1e-2)], STEPS, **kw)
    assert_rel_close(model, ref, rtol=1e-5)
    assert_moved(model, start)


@pytest.mark.parametrize('backend', BACKENDS, ids=str)
@pytest.mark.parametrize('momentum,dampening,nesterov', [(0., 0., False), (0.9, 0., False), (0.9, 0.3, False), (0.9, 0., True)])
def test_decoupled_sgdw_follows_composer(backend, momentum, dampening, nesterov):
    "25 steps of DecoupledSGDW, each momentum form, two groups, a schedule: Composer's update within float rounding."
    model = make_model()
    ref = copy.deepcopy(model)
    kw = dict(momentum=momentum, dampening=dampening, weight_decay=0.02, nesterov=nesterov)
    opt = cbopt.DecoupledSGDW(two_lr_groups(model), lr=0.1, backend=backend, **kw)
    run_cbopt(opt, model, STEPS)
    names = [n for n, _ in model.named_parameters()]
    composer_sgdw(ref, [(names[:2], 3e-2), (names[2:], 1e-2)], STEPS, **kw)
    assert_rel_close(model, ref, rtol=1e-5)


@pytest.mark.parametrize('scheduled', [False, True])
def test_decoupled_adamw_is_torch_adamw_at_wd_over_initial_lr(scheduled):
    """`DecoupledAdamW(weight_decay=w)` is torch's `AdamW(weight_decay=w / initial_lr)`: at a constant lr, and under an
    LR scheduler (torch's LambdaLR on both, which keeps the `initial_lr` the optimizer set), where torch's decay
    `lr_t * w / initial_lr` is Composer's `(lr_t / initial_lr) * w`."""
    lr, w = 2e-2, 0.05
    model = make_model()
    ref = copy.deepcopy(model)
    opt = cbopt.DecoupledAdamW(model.named_parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=w)
    theirs = torch.optim.AdamW(ref.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=w / lr)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in (opt, theirs)] if scheduled else []
    for i in range(STEPS):
        for m, o in ((model, opt), (ref, theirs)):
            set_grads(m, i)
            o.step()
        for s in scheds: s.step()
    assert opt.param_groups[0]['initial_lr'] == lr
    if scheduled: assert opt.param_groups[0]['lr'] == pytest.approx(lr * schedule(STEPS))
    assert_rel_close(model, ref, rtol=1e-5)


def test_decay_follows_lr_over_initial_lr_not_lr():
    """The decay alone (zero grads: Adam's update is 0): a param shrinks by exactly `wd * lr / initial_lr`, whatever
    the size of the lr; cbopt's AdamW (`weight_decay`) by `lr * wd`."""
    for lr0, lr in ((1e-3, 5e-4), (10., 5.)):
        p = torch.nn.Parameter(torch.full((4,), 2.))
        opt = cbopt.DecoupledAdamW([p], lr=lr0, weight_decay=0.1)
        opt.param_groups[0]['lr'] = lr
        p.grad = torch.zeros_like(p)
        opt.step()
        assert torch.equal(p.detach(), torch.full((4,), 2.) * (1 - (lr / lr0) * 0.1))
    q = torch.nn.Parameter(torch.full((4,), 2.))
    adamw = cbopt.Adam([q], lr=5e-4, wd=0.1)
    q.grad = torch.zeros_like(q)
    adamw.step()
    assert torch.equal(q.detach(), torch.full((4,), 2.) * (1 - 5e-4 * 0.1))


def test_initial_lr_per_group_and_added_groups():
    """Each group's `initial_lr` is its own lr when it joins: at construction (fastai's lr slices included) and in a
    later `add_param_group` (Composer's AdamW raises KeyError there); one given in the group is kept; a tensor lr is
    copied, so a scheduler writing the lr in place does not move it."""
    model = make_model()
    opt = cbopt.DecoupledAdamW(two_lr_groups(model), weight_decay=0.1)
    assert [g['initial_lr'] for g in opt.param_groups] == [3e-2, 1e-2]
    extra = torch.nn.Parameter(torch.full((3,), 2.))
    opt.add_param_group({'params': [extra], 'lr': 0.5})
    opt.add_param_group({'params': [torch.nn.Parameter(torch.ones(2))], 'lr': 0.5, 'initial_lr': 1.})
    assert [g['initial_lr'] for g in opt.param_groups] == [3e-2, 1e-2, 0.5, 1.]
    opt.param_groups[2]['lr'] = 0.25
    for p in opt.params: p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(extra.detach(), torch.full((3,), 2.) * (1 - 0.5 * 0.1))  # (0.25 / 0.5) of the decay
    lr = torch.tensor(0.1)
    t = cbopt.DecoupledSGDW([torch.nn.Parameter(torch.ones(2))], lr=lr, weight_decay=0.1)
    lr.mul_(0.5)
    assert t.param_groups[0]['initial_lr'] is not lr and t.param_groups[0]['initial_lr'].item() == pytest.approx(0.1)


def test_initial_lr_zero_decays_whole_wd():
    "A group built at lr=0 decays by the whole `wd` (Composer's rule), in the loop and in the fused kernel's backend."
    for backend in ('loop', 'fused'):
        p = torch.nn.Parameter(torch.full((4,), 2.))
        opt = cbopt.DecoupledAdamW([p], lr=0., weight_decay=0.1, backend=backend)
        p.grad = torch.zeros_like(p)
        opt.step()
        assert torch.equal(p.detach(), torch.full((4,), 2.) * 0.9)


@pytest.mark.parametrize('opt_func,kw', [(cbopt.DecoupledAdamW, dict(lr=1e-2, weight_decay=0.05)),
                                         (cbopt.DecoupledSGDW, dict(lr=1e-2, momentum=0.9, weight_decay=0.05))],
                         ids=['adamw', 'sgdw'])
def test_backends_and_resume(opt_func, kw):
    "check_callback: foreach bit for bit with the loop, fused within rounding, a weights_only checkpoint resumes bit for bit."
    check_callback(opt_func=opt_func, **kw)


def test_nesterov_needs_momentum():
    with pytest.raises(ValueError, match='Nesterov'): cbopt.DecoupledSGDW([torch.nn.Parameter(torch.ones(2))], lr=0.1, nesterov=True)


# -- timm's grouping (timm is not installable here, offline: its rule written out from its published code) -------------
def timm_rule(model, weight_decay, no_weight_decay_list):
    "timm's param_groups_weight_decay, as FQNs: no decay for ndim <= 1, '.bias' names and listed names; frozen skipped."
    skip, decay, no_decay = set(no_weight_decay_list), [], []
    for name, p in model.named_parameters():
        if not p.requires_grad: continue
        if p.ndim <= 1 or name.endswith('.bias') or name in skip: no_decay.append(name)
        else: decay.append(name)
    return [(no_decay, 0.), (decay, weight_decay)]


def test_param_groups_weight_decay_is_timms_rule_with_names():
    """A model with a conv, a norm, a bias-free linear named `.bias`-like, a listed embedding and a frozen layer: the
    groups are timm's, in its order, as (FQN, param) pairs; an optimizer built from them keys state by FQN and decays
    only the decay group."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_embed = torch.nn.Parameter(torch.zeros(1, 3, 4))
            self.conv = torch.nn.Conv2d(1, 2, 3)
            self.norm = torch.nn.LayerNorm(4)
            self.head = torch.nn.Linear(4, 2, bias=False)
            self.frozen = torch.nn.Linear(2, 2)
            self.frozen.requires_grad_(False)
    model = Net()
    groups = cbopt.param_groups_weight_decay(model, weight_decay=0.05, no_weight_decay_list=['pos_embed'])
    assert [([n for n, _ in g['params']], g['weight_decay']) for g in groups] == timm_rule(model, 0.05, ['pos_embed'])
    assert [n for n, _ in groups[1]['params']] == ['conv.weight', 'head.weight']
    named = dict(model.named_parameters())
    assert all(p is named[n] for g in groups for n, p in g['params'])
    assert cbopt.param_groups_weight_decay(model)[1]['weight_decay'] == 1e-5  # timm's default
    opt = cbopt.DecoupledAdamW(groups, lr=0.1)
    assert [g['wd'] for g in opt.param_groups] == [0., 0.05]
    assert opt.param_names == [n for g in timm_rule(model, 0.05, ['pos_embed']) for n in g[0]]
