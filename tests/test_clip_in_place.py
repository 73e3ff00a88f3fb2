"""Clipping in place (`in_place=True` on `clip_grad_norm`, `clip_grad_value` and `GradientClippingOptimizer`), opted
into: after each step `p.grad` holds the clipped grads exactly as torch's clip functions leave them, and the params
are those of torch's `clip_grad_norm_(foreach=True)` / `clip_grad_value_(foreach=True)` then its fused AdamW, over
many steps in every backend. Under torch's fused kernel the coefficient is the kernel's own `grad_scale` divisor on
the user's grads (no copy, no multiply pass: within an ulp of torch's multiply); elsewhere one in-place
`_foreach_mul_`, torch's own op (bit for bit). Also: GradScaler's scale composes with it, and what a skipped step
leaves in `p.grad`. The default (`in_place=False`, the grad contract) is pinned by tests/test_wrappers.py and
tests/test_callbacks_whole_model.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import cbopt
from cbopt import GradientClipping
from conftest import batch_loss, make_model

pytestmark = pytest.mark.usefixtures('one_thread')

BACKENDS = ['loop', 'foreach', 'fused', 'auto']
STEPS, MAX_NORM, CLIP_VALUE = 25, 0.05, 0.02
ADAMW = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-5, weight_decay=0.01)  # cbopt.Adam's defaults, in torch's words


def set_grads(m, i: int) -> None:
    m.zero_grad(set_to_none=True)
    batch_loss(m, i).backward()


def torch_clipped(grads: list, clip) -> list:
    "Clones of `grads` clipped by torch's function `clip` (given stand-in params holding them)."
    ps = [torch.empty_like(g).requires_grad_() for g in grads]
    for p, g in zip(ps, grads): p.grad = g.clone()
    clip(ps)
    return [p.grad for p in ps]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    "max |a - b| relative to b's own largest magnitude."
    return ((a - b).abs().max() / b.abs().max()).item()


def clipped(m, backend: str, clipping=GradientClipping.NORM, bound=MAX_NORM, norm_type=2.0, in_place=True):
    opt = cbopt.GradientClippingOptimizer(cbopt.Adam(m.parameters(), lr=ADAMW['lr'], backend=backend), clipping, bound,
                                          norm_type, in_place=in_place)
    opt.init_state()  # (else the fused backend's first step, which creates the state, runs the chain, not the kernel)
    return opt


def torch_clip(clipping, bound, norm_type):
    if clipping is GradientClipping.NORM:
        return lambda ps: torch.nn.utils.clip_grad_norm_(ps, bound, norm_type, foreach=True)
    return lambda ps: torch.nn.utils.clip_grad_value_(ps, bound, foreach=True)


CASES = {'norm-2': (GradientClipping.NORM, MAX_NORM, 2.0), 'norm-inf': (GradientClipping.NORM, MAX_NORM, math.inf),
         'value': (GradientClipping.VALUE, CLIP_VALUE, 2.0)}


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('case', CASES)
def test_in_place_steps_and_leaves_grads_as_torchs_clip_then_fused_adamw(case, backend):
    """Many steps against torch's clip (foreach) then torch's fused AdamW: the params, and the grads each step leaves
    (which are the user's own tensors, written in place), within 1e-6 of each tensor's own scale; and each step's
    grads are exactly torch's clip of the grads it was given (bit for bit where the same op runs: every clip by
    value, and clipping by norm outside torch's kernel; within an ulp under it, which divides by 1 / coefficient)."""
    clipping, bound, norm_type = CASES[case]
    m, ref_m = make_model(), make_model()
    opt, ref = clipped(m, backend, clipping, bound, norm_type), torch.optim.AdamW(ref_m.parameters(), **ADAMW, fused=True)
    clip = torch_clip(clipping, bound, norm_type)
    kernel = backend in ('fused', 'auto') and clipping is GradientClipping.NORM
    start, clips = copy.deepcopy(m), 0
    for i in range(STEPS):
        set_grads(m, i), set_grads(ref_m, i)
        given = [p.grad for p in m.parameters()]
        expected = torch_clipped(given, clip)  # torch's clip of exactly these grads
        clip(list(ref_m.parameters()))
        opt.step(), ref.step()
        if clipping is GradientClipping.NORM: clips += bool(opt.step_stats['grad_norm'] > bound)
        for (n, p), q, g, e in zip(m.named_parameters(), ref_m.parameters(), given, expected):
            assert p.grad is g, n  # the user's own grad tensor, written in place (no rebinding, no copy)
            if kernel: assert rel_err(p.grad, e) <= 1e-6, (i, n)
            else: assert torch.equal(p.grad, e), (i, n)
            # against the reference run's own clipped grads: computed at its params, which the chain (outside torch's
            # kernel) reaches by other roundings, drifting apart by ~1e-6 over the steps through the loss
            assert rel_err(p.grad, q.grad) <= (1e-6 if backend in ('fused', 'auto') else 1e-5), (i, n)
            assert rel_err(p, q) <= 1e-6, (i, n)
    if clipping is GradientClipping.NORM: assert clips >= STEPS - 2  # (the norm falls as the model fits)
    else: assert all((p.grad.abs() == bound).any() for p in m.parameters())  # it clamped, in the last step too
    for p, p0 in zip(m.parameters(), start.parameters()): assert (p - p0).abs().max() > 1e-3  # it trained


def test_fused_in_place_hands_the_coefficient_to_torchs_kernel(monkeypatch):
    """Under torch's kernel the clipping costs no pass of its own: the kernel gets the user's grads themselves with
    `grad_scale = 1 / coefficient` (a 0-d float32 tensor), and no multiply or copy of the grads runs."""
    kernel, calls, muls = torch._fused_adamw_, [], []
    def spy(params, grads, *a, **k):
        calls.append((list(grads), k['grad_scale']))
        return kernel(params, grads, *a, **k)
    monkeypatch.setattr(torch, '_fused_adamw_', spy)
    for name in ('_foreach_mul_', '_foreach_mul', '_foreach_div_', '_foreach_div'):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _n=name, **k: (muls.append(_n), _real(*a, **k))[1])
    m = make_model()
    opt = clipped(m, 'fused')
    for i in range(3):
        set_grads(m, i)
        calls.clear()
        opt.step()
        (grads, scale), = calls
        assert all(g is p.grad for g, p in zip(grads, m.parameters()))
        coef = torch.clamp(MAX_NORM / (opt.step_stats['grad_norm'] + 1e-6), max=1.0)
        assert scale.dtype == torch.float32 and scale.ndim == 0 and coef < 1
        assert torch.equal(scale, coef.double().reciprocal().float())
    assert muls == []


def test_the_default_still_leaves_the_users_grads(monkeypatch):
    "The same optimizer without `in_place` steps on scaled copies: the user's grads are left as they were."
    m = make_model()
    opt = clipped(m, 'fused', in_place=False)
    for i in range(3):
        set_grads(m, i)
        given = [(p.grad, p.grad.clone()) for p in m.parameters()]
        opt.step()
        assert opt.step_stats['grad_norm'] > MAX_NORM
        for p, (g, before) in zip(m.parameters(), given): assert p.grad is g and torch.equal(g, before)


def test_in_place_is_a_checked_flag_saved_with_the_groups():
    m = make_model()
    with pytest.raises(TypeError, match="'in_place' is a flag"):
        cbopt.Optimizer(m.parameters(), [cbopt.clip_grad_norm, cbopt.sgd_step], lr=0.1, in_place=1)
    with pytest.raises(TypeError, match='in_place must be True or False'):
        cbopt.GradientClippingOptimizer(cbopt.Adam(m.parameters()), GradientClipping.NORM, in_place='yes')
    opt = clipped(m, 'foreach')
    assert [g['in_place'] for g in opt.state_dict()['param_groups']] == [True]
    assert cbopt.Optimizer(m.parameters(), [cbopt.clip_grad_value, cbopt.sgd_step], lr=0.1).hypers[0]['in_place'] is False


# -- with GradScaler ------------------------------------------------------------------------------------------------
INF_STEPS = {3, 7}


@pytest.mark.parametrize('backend', ['fused', 'foreach'])
def test_in_place_under_grad_scaler_is_torchs_recipe(backend):
    """`scaler.step(GradientClippingOptimizer(..., in_place=True))` against torch's recipe `scaler.unscale_(opt);
    clip_grad_norm_(..., foreach=True); scaler.step(opt)` on its fused AdamW: the grads are unscaled first (in place,
    as the scaler does), then clipped (the fused kernel's divisor is the clip's alone: the scale is paid), so after a
    step `p.grad` is the unscaled clipped grad, as torch's recipe leaves it. A step with an inf changes nothing, and
    leaves `p.grad` as the scaler gave it (scaled), as torch's fused AdamW under the scaler does."""
    m, ref_m = make_model(), make_model()
    opt, ref = clipped(m, backend), torch.optim.AdamW(ref_m.parameters(), **ADAMW, fused=True)
    sc, ref_sc = (torch.amp.GradScaler('cpu', init_scale=2. ** 14, growth_interval=3) for _ in range(2))
    for i in range(STEPS):
        for model, s in ((m, sc), (ref_m, ref_sc)):
            model.zero_grad(set_to_none=True)
            s.scale(batch_loss(model, i)).backward()
            if i in INF_STEPS: model[2].bias.grad[0] = float('inf')
        scaled = [p.grad.clone() for p in m.parameters()]
        before = [p.detach().clone() for p in m.parameters()]
        ref_sc.unscale_(ref)
        torch.nn.utils.clip_grad_norm_(ref_m.parameters(), MAX_NORM, foreach=True)
        sc.step(opt), ref_sc.step(ref)
        sc.update(), ref_sc.update()
        assert sc.get_scale() == ref_sc.get_scale()
        for (n, p), q, s, b in zip(m.named_parameters(), ref_m.parameters(), scaled, before):
            if i in INF_STEPS:
                assert torch.equal(p, b), (i, n)
                if backend == 'fused': assert torch.equal(p.grad, s), (i, n)  # (others: the scaler unscaled them)
                continue
            assert opt.step_stats['grad_norm'] > MAX_NORM  # it clipped
            # (the grads at params the chain reaches by other roundings than torch's kernel: see the first test)
            assert rel_err(p.grad, q.grad) <= (1e-6 if backend == 'fused' else 1e-5) and rel_err(p, q) <= 1e-6, (i, n)
    assert int(opt.state[m[0].weight]['step']) == STEPS - len(INF_STEPS)


# -- skipped steps --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('backend', ['foreach', 'fused'])
def test_a_step_skipped_before_the_clip_leaves_the_grads(backend):
    """`SkipNonFinite` outside the clip (the recommended order: it sees the grads first): a step with an inf grad is
    skipped before the clip runs, so nothing changes, `p.grad` included (torch's clip_grad_norm_, run first, would
    have scaled it: by 0, leaving NaN where the inf was)."""
    m = make_model()
    opt = cbopt.SkipNonFinite(clipped(m, backend))
    for i in range(4):
        set_grads(m, i)
        if i == 2: m[2].bias.grad[0] = float('inf')
        given = [(p.grad, p.grad.clone()) for p in m.parameters()]
        before = copy.deepcopy((list(m.parameters()), [dict(opt.state[p]) for p in m.parameters()]))
        opt.step()
        if i != 2: continue
        assert opt.step_stats['skipped_by'] == 'skip_nonfinite'
        for p, (g, b), q, st in zip(m.parameters(), given, *before):
            assert p.grad is g and torch.equal(g, b) and torch.equal(p, q)
            assert all(torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v for k, v in st.items())
    assert opt.step_stats['skipped_total'] == 1 and opt.step_stats['skipped'] is False


@pytest.mark.parametrize('backend', ['foreach', 'fused'])
def test_a_step_skipped_after_the_clip_leaves_torchs_clipped_grads(backend):
    """`SkipNonFinite` inside the clip: the clip runs first and writes the grads (its coefficient is applied before
    the next whole-model callback reads them), so `p.grad` is what torch's clip_grad_norm_ leaves, bit for bit, NaN
    included (an inf norm: coefficient 0), then the step is skipped: params and state unchanged."""
    m = make_model()
    opt = cbopt.GradientClippingOptimizer(cbopt.SkipNonFinite(cbopt.Adam(m.parameters(), lr=0.01, backend=backend)),
                                          GradientClipping.NORM, MAX_NORM, in_place=True)
    opt.init_state()
    for i in range(3):
        set_grads(m, i)
        if i == 1: m[2].bias.grad[0] = float('inf')
        expected = torch_clipped([p.grad for p in m.parameters()], torch_clip(GradientClipping.NORM, MAX_NORM, 2.0))
        before = [p.detach().clone() for p in m.parameters()]
        opt.step()
        for p, e, b in zip(m.parameters(), expected, before):
            torch.testing.assert_close(p.grad, e, rtol=0, atol=0, equal_nan=True)
            if i == 1: assert torch.equal(p, b)
        if i == 1: assert opt.step_stats['skipped_by'] == 'skip_nonfinite' and m[2].bias.grad[0].isnan()
