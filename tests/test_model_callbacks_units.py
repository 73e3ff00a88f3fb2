"""One test per whole-model callback of `cbopt.model_callbacks` (issue #14 item 3): one-element float64 params with
hand-chosen grads, stepped by a real optimizer (the callback, then plain SGD: `p -= lr * g`), and the params and
`step_stats` worked out in the test from torch's documented rules. `test_model_callbacks.py` checks the same
callbacks against torch's clip functions and a real big batch over many steps; these pin each rule on its own.
(`warmup` is pinned stage by stage against torchrec's formulas in `test_warmup.py`.)"""
from __future__ import annotations

import math

import pytest
import torch

import cbopt
from cbopt import accumulate_grads, clip_grad_norm, clip_grad_value, grad_norm, skip_nonfinite

LR = 0.1


def params(*values: float) -> list[torch.Tensor]:
    "One-element float64 params."
    return [torch.tensor([v], dtype=torch.float64, requires_grad=True) for v in values]


def step(opt, ps, *grads: float) -> None:
    for p, g in zip(ps, grads): p.grad = torch.tensor([g], dtype=torch.float64)
    opt.step()


def close(ps, *expected: float) -> None:
    torch.testing.assert_close(torch.cat([p.detach() for p in ps]), torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_clip_grad_norm_scales_by_max_norm_over_the_total_norm(backend) -> None:
    "g *= min(1, max_norm / (total_norm + 1e-6)); the pre-clip norm is reported."
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [clip_grad_norm, cbopt.sgd_step], lr=LR, max_norm=1., backend=backend)
    step(opt, ps, 3., 4.)                                   # total 2-norm 5
    coef = 1. / (5. + 1e-6)
    close(ps, 1. - LR * 3. * coef, 2. - LR * 4. * coef)
    assert opt.step_stats['grad_norm'].item() == pytest.approx(5., rel=1e-12)
    opt.set_hyper('max_norm', 6.)                           # under the bound: the grads are kept
    step(opt, ps, 3., 4.)
    close(ps, 1. - LR * 3. * coef - LR * 3., 2. - LR * 4. * coef - LR * 4.)


@pytest.mark.parametrize('norm_type, total', [(1., 7.), (2., 5.), (math.inf, 4.)])
def test_clip_grad_norm_norm_type(norm_type, total) -> None:
    "The total norm of (3, -4) is 7, 5 and 4 in the 1-, 2- and inf-norms."
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [clip_grad_norm, cbopt.sgd_step], lr=LR, max_norm=2., norm_type=norm_type)
    step(opt, ps, 3., -4.)
    coef = 2. / (total + 1e-6)
    close(ps, 1. - LR * 3. * coef, 2. + LR * 4. * coef)
    assert opt.step_stats['grad_norm'].item() == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize('norm_type, total', [(1., 7.), (2., 5.), (math.inf, 4.)])
def test_grad_norm_reports_and_changes_nothing(norm_type, total) -> None:
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [grad_norm, cbopt.sgd_step], lr=LR, norm_type=norm_type)
    step(opt, ps, 3., -4.)
    close(ps, 1. - LR * 3., 2. + LR * 4.)
    assert opt.step_stats['grad_norm'].item() == pytest.approx(total, rel=1e-12)
    assert cbopt.Optimizer(params(1.), [grad_norm, cbopt.sgd_step]).hypers[0]['norm_type'] == 2.


def test_clip_grad_norm_defaults_are_fastais() -> None:
    opt = cbopt.Optimizer(params(1.), [clip_grad_norm, cbopt.sgd_step], lr=LR)
    assert opt.hypers[0]['max_norm'] == 1. and opt.hypers[0]['norm_type'] == 2.


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_clip_grad_value_clamps_each_element(backend) -> None:
    ps = params(1., 2., 3.)
    opt = cbopt.Optimizer(ps, [clip_grad_value, cbopt.sgd_step], lr=LR, clip_value=0.5, backend=backend)
    step(opt, ps, 3., -0.25, -2.)
    close(ps, 1. - LR * 0.5, 2. + LR * 0.25, 3. + LR * 0.5)
    assert cbopt.Optimizer(params(1.), [clip_grad_value, cbopt.sgd_step], lr=LR).hypers[0]['clip_value'] == 1.


@pytest.mark.parametrize('bad', [math.inf, -math.inf, math.nan])
def test_skip_nonfinite_counts_and_skips(bad) -> None:
    "A step with a non-finite grad anywhere moves nothing; the counts say how many were skipped, in a row and in all."
    ps = params(1., 2.)
    opt = cbopt.Optimizer(ps, [skip_nonfinite, cbopt.sgd_step], lr=LR)
    g0 = opt.param_groups[0]
    step(opt, ps, 1., bad)
    close(ps, 1., 2.)
    assert opt.step_stats['skipped'] and opt.step_stats['skipped_by'] == 'skip_nonfinite'
    step(opt, ps, bad, 1.)
    close(ps, 1., 2.)
    assert (g0['skip_nonfinite.skipped_total'], g0['skip_nonfinite.skipped_consecutive']) == (2, 2)
    step(opt, ps, 1., -1.)                                  # finite: steps, and the run of skips ends
    close(ps, 1. - LR, 2. + LR)
    assert not opt.step_stats['skipped']
    assert (g0['skip_nonfinite.skipped_total'], g0['skip_nonfinite.skipped_consecutive']) == (2, 0)


def test_skip_nonfinite_raises_after_max_consecutive() -> None:
    "max_consecutive skips in a row are allowed; one more raises (training has diverged), changing nothing."
    ps = params(1.)
    opt = cbopt.Optimizer(ps, [skip_nonfinite, cbopt.sgd_step], lr=LR, max_consecutive=2)
    step(opt, ps, math.inf)
    step(opt, ps, math.inf)
    with pytest.raises(FloatingPointError, match='at 3 steps in a row, more than max_consecutive=2'):
        step(opt, ps, math.inf)
    g0 = opt.param_groups[0]
    assert (g0['skip_nonfinite.skipped_total'], g0['skip_nonfinite.skipped_consecutive']) == (2, 2)
    close(ps, 1.)
    assert cbopt.Optimizer(params(1.), [skip_nonfinite, cbopt.sgd_step]).hypers[0]['max_consecutive'] is None


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_accumulate_grads_steps_every_n_calls_with_the_mean(backend) -> None:
    "every=3: two calls only add up; the third steps once with (g1 + g2 + g3) / 3, and the sum starts over."
    ps = params(1.)
    opt = cbopt.Optimizer(ps, [accumulate_grads, cbopt.sgd_step], lr=LR, every=3, backend=backend)
    step(opt, ps, 1.)
    step(opt, ps, 2.)
    close(ps, 1.)
    assert opt.step_stats['skipped'] and opt.param_groups[0]['accumulate_grads.micro_step'] == 2
    step(opt, ps, 6.)
    close(ps, 1. - LR * (1. + 2. + 6.) / 3.)
    assert opt.param_groups[0]['accumulate_grads.micro_step'] == 0
    for g in (3., 3., 3.): step(opt, ps, g)
    close(ps, 1. - LR * 3. - LR * 3.)                        # the first cycle's grads are gone


def test_accumulate_grads_of_one_is_plain_sgd() -> None:
    ps = params(1.)
    opt = cbopt.Optimizer(ps, [accumulate_grads, cbopt.sgd_step], lr=LR)
    assert opt.hypers[0]['every'] == 1
    step(opt, ps, 2.)
    close(ps, 1. - LR * 2.)
