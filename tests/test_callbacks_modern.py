"""One test per callback of `cbopt.modern_callbacks` (issue #14 item 3): a one-element float64 param with a
hand-chosen grad and state, and the expected numbers worked out in the test from the papers' and the reference
packages' update rules. `test_modern.py` checks the same callbacks against lion-pytorch, pytorch-optimizer and
torch-optimi over many steps; these pin each formula on its own."""
from __future__ import annotations

import math

import torch

from cbopt.callbacks.modern import (adan_avgs, adan_step, ademamix_step, debiased_avgs, lion_avg, lion_step,
                                    proximal_decay, slow_grad_avg, stable_adamw_step, stable_decay, stable_lr)


def T(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def P(data: float, grad: float = 0.) -> torch.Tensor:
    p = T(data)
    p.grad = T(grad)
    return p


def close(t: torch.Tensor, expected: float) -> None:
    torch.testing.assert_close(t, T(expected).reshape(t.shape), rtol=1e-12, atol=1e-15)


# -- Lion ----------------------------------------------------------------------------------------------------------
def test_lion_steps_by_the_sign_of_the_interpolation() -> None:
    "p -= lr * sign(beta1 * m + (1 - beta1) * g); the average is updated afterwards by `lion_avg`, at beta2."
    p = P(1., 2.)
    out = lion_step(p, lr=0.1, mom=0.9, grad_avg=T(-3.))   # 0.9 * -3 + 0.1 * 2 = -2.5: sign -1
    close(p, 1.1)
    close(out['grad_avg'], -3.)                            # not changed by the step
    lion_avg(p, sqr_mom=0.99, grad_avg=out['grad_avg'])
    close(out['grad_avg'], 0.99 * -3. + 0.01 * 2.)
    p = P(1., 2.)
    close(lion_step(p, lr=0.1, mom=0.9)['grad_avg'], 0.)  # first step: from a zero average, the sign of g
    close(p, 0.9)
    assert (lion_step.defaults, lion_avg.defaults) == (dict(mom=0.9), dict(sqr_mom=0.99))  # lion-pytorch's betas


# -- Adan ----------------------------------------------------------------------------------------------------------
def test_adan_averages() -> None:
    """m = lerp(m, g, 1 - b1); d = lerp(d, g - g_prev, 1 - b2); v = b3 v + (1 - b3) (g + b2 (g - g_prev))^2; the first
    step has no difference (g_prev starts at the first grad)."""
    p = P(1., 2.)
    out = adan_avgs(p, mom=0.5, diff_mom=0.25, sqr_mom=0.75, step=1)
    for k, v in dict(grad_avg=1., diff_avg=0., sqr_avg=0.25 * 4., prev_grad=2.).items(): close(out[k], v)
    p = P(1., 3.)
    out = adan_avgs(p, mom=0.5, diff_mom=0.25, sqr_mom=0.75, step=2, grad_avg=T(1.), diff_avg=T(0.4), sqr_avg=T(1.),
                    prev_grad=T(2.))
    for k, v in dict(grad_avg=1. + 0.5 * (3. - 1.), diff_avg=0.4 + 0.75 * (1. - 0.4),
                     sqr_avg=0.75 * 1. + 0.25 * (3. + 0.25 * 1.) ** 2, prev_grad=3.).items(): close(out[k], v)
    close(p.grad, 3.)


def test_adan_step() -> None:
    "p -= lr * (m / (1 - b1^t) + b2 * d / (1 - b2^t)) / (sqrt(v / (1 - b3^t)) + eps)"
    p = P(1., 3.)
    adan_step(p, lr=0.1, mom=0.5, diff_mom=0.25, sqr_mom=0.75, eps=0.01, step=2, grad_avg=T(2.), diff_avg=T(0.85),
              sqr_avg=T(3.390625))
    denom = math.sqrt(3.390625 / (1. - 0.75 ** 2)) + 0.01
    close(p, 1. - 0.1 * (2. / (1. - 0.5 ** 2) + 0.25 * 0.85 / (1. - 0.25 ** 2)) / denom)


def test_proximal_decay() -> None:
    "p /= 1 + lr * wd, unless the param has no weight decay."
    p = P(2.)
    proximal_decay(p, lr=0.1, wd=0.5)
    close(p, 2. / 1.05)
    for kw in (dict(wd=0.5, do_wd=False), dict(wd=0.)):
        p = P(2.)
        proximal_decay(p, lr=0.1, **kw)
        close(p, 2.)


# -- AdEMAMix ------------------------------------------------------------------------------------------------------
def test_slow_grad_avg_and_its_warmup() -> None:
    """m3 = lerp(m3, g, 1 - b3); with `t_alpha_beta3`, b3 rises from b1 to b3 as
    exp(log b1 log b3 / ((1 - t/T) log b3 + t/T log b1)) until step T."""
    close(slow_grad_avg(P(1., 3.), mom=0.9, slow_mom=0.9, step=3, slow_avg=T(1.))['slow_avg'], 1. + 0.1 * (3. - 1.))
    b3 = math.exp(math.log(0.9) * math.log(0.99) / (0.5 * math.log(0.99) + 0.5 * math.log(0.9)))
    got = slow_grad_avg(P(1., 3.), mom=0.9, slow_mom=0.99, step=5, t_alpha_beta3=10, slow_avg=T(1.))['slow_avg']
    close(got, 1. + (1. - b3) * 2.)
    for step in (10, 11):  # from step T on: b3 itself
        got = slow_grad_avg(P(1., 3.), mom=0.9, slow_mom=0.99, step=step, t_alpha_beta3=10, slow_avg=T(1.))['slow_avg']
        close(got, 1. + 0.01 * 2.)
    close(slow_grad_avg(P(1., 3.), mom=0.9, slow_mom=0.99, step=1)['slow_avg'], 0.01 * 3.)


def test_ademamix_step() -> None:
    "p -= lr * (m1 / (1 - b1^t) + alpha * m3) / (sqrt(v / (1 - b2^t)) + eps); alpha warms up linearly over T steps."
    denom = math.sqrt(0.02 / (1. - 0.99 ** 2)) + 0.01
    for t_alpha, alpha in ((None, 5.), (10, 2 * 5. / 10), (2, 5.)):
        p = P(1., 3.)
        ademamix_step(p, lr=0.1, mom=0.9, sqr_mom=0.99, eps=0.01, step=2, slow_alpha=5., grad_avg=T(0.2),
                      sqr_avg=T(0.02), slow_avg=T(0.1), t_alpha_beta3=t_alpha)
        close(p, 1. - 0.1 * (0.2 / (1. - 0.9 ** 2) + alpha * 0.1) / denom)


# -- StableAdamW ---------------------------------------------------------------------------------------------------
def test_debiased_avgs() -> None:
    "Averaging with beta_t = (beta^t - beta) / (beta^t - 1) gives the debiased average: the grad itself at step 1."
    out = debiased_avgs(P(1., 2.), mom=0.9, sqr_mom=0.99, step=1)
    close(out['grad_avg'], 2.), close(out['sqr_avg'], 4.)
    b1, b2 = (0.81 - 0.9) / (0.81 - 1.), (0.99 ** 2 - 0.99) / (0.99 ** 2 - 1.)
    out = debiased_avgs(P(1., 3.), mom=0.9, sqr_mom=0.99, step=2, grad_avg=T(2.), sqr_avg=T(4.))
    close(out['grad_avg'], b1 * 2. + (1. - b1) * 3.), close(out['sqr_avg'], b2 * 4. + (1. - b2) * 9.)


def test_stable_lr_clips_by_the_updates_rms() -> None:
    "lr / max(1, rms(g / sqrt(max(v, eps^2))))"
    close(stable_lr(P(1., 2.), lr=0.1, eps=1e-6, sqr_avg=T(1.))['stable_lr'], 0.1 / 2.)
    close(stable_lr(P(1., 2.), lr=0.1, eps=1e-6, sqr_avg=T(16.))['stable_lr'], 0.1)     # rms 0.5: not clipped
    close(stable_lr(P(1., 2.), lr=0.1, eps=0.5, sqr_avg=T(0.))['stable_lr'], 0.1 / 4.)  # v floored at eps^2


def test_stable_decay_and_step() -> None:
    p = P(2.)
    stable_decay(p, stable_lr=0.05, wd=0.1)
    close(p, 2. * (1. - 0.05 * 0.1))
    p = P(2.)
    stable_decay(p, stable_lr=0.05, wd=0.1, do_wd=False)
    close(p, 2.)
    p = P(1., 5.)
    stable_adamw_step(p, stable_lr=0.05, eps=0.01, grad_avg=T(0.3), sqr_avg=T(0.04))
    close(p, 1. - 0.05 * 0.3 / (0.2 + 0.01))
    close(p.grad, 5.)


# -- schedule-free -------------------------------------------------------------------------------------------------
from cbopt.callbacks.modern import adam_normalize_grad, schedule_free_step, schedule_free_weight


def test_schedule_free_weight_warms_up_and_weights_by_lr_max() -> None:
    """lr' = lr * min(step / warmup_steps, 1); lr_max = max(lr_max, lr'); the new point's weight in the average is
    ckp1 = step**r * lr_max**weight_lr_power / (the running sum of those weights): schedulefree's formulas."""
    p = P(1., 2.)
    out = schedule_free_weight(p, lr=0.1, step=2, warmup_steps=4, r=0.5, weight_lr_power=2., weight_sum=T(0.01),
                               lr_max=T(0.08))
    weight = 0.08 ** 2 * 2 ** 0.5           # lr' = 0.05 < lr_max: lr_max stays
    assert math.isclose(float(out['sf_lr']), 0.05, rel_tol=1e-12)
    close(out['lr_max'], 0.08)
    close(out['weight_sum'], 0.01 + weight)
    close(out['ckp1'], weight / (0.01 + weight))
    out = schedule_free_weight(p, lr=0.1, step=5, warmup_steps=4, r=0., weight_lr_power=2., weight_sum=T(0.01),
                               lr_max=T(0.08))
    assert math.isclose(float(out['sf_lr']), 0.1, rel_tol=1e-12)  # past the warmup: the lr itself, now the max
    close(out['lr_max'], 0.1)
    close(out['ckp1'], 0.01 / 0.02)
    close(p, 1.)


def test_schedule_free_weight_first_step_and_zero_lr() -> None:
    "The first point is the whole average (ckp1 = 1); while the lr is 0 the weights are 0, and so is ckp1 (no 0/0)."
    out = schedule_free_weight(P(1., 2.), lr=0.1, step=1, warmup_steps=0, r=0., weight_lr_power=2.)
    close(out['weight_sum'], 0.01), close(out['lr_max'], 0.1), close(out['ckp1'], 1.)
    out = schedule_free_weight(P(1., 2.), lr=0., step=1, warmup_steps=0, r=0., weight_lr_power=2.)
    close(out['weight_sum'], 0.), close(out['ckp1'], 0.)
    assert schedule_free_weight.defaults == dict(warmup_steps=0, r=0., weight_lr_power=2.)  # schedulefree's


def test_adam_normalize_grad_rebinds_the_grad() -> None:
    "The rest of the chain sees g / (sqrt(v / (1 - beta2**step)) + eps); the user's grad tensor is not written."
    p = P(1., 2.)
    g = p.grad
    adam_normalize_grad(p, sqr_mom=0.5, eps=0.25, step=2, sqr_avg=T(3.))   # v / (1 - 0.25) = 4
    close(p.grad, 2. / (2. + 0.25))
    assert p.grad is not g and torch.equal(g, T(2.))
    close(p, 1.)


def test_schedule_free_step_moves_y_and_z() -> None:
    """y = lerp(y, z, ckp1) + g * lr * (beta1 * (1 - ckp1) - 1); z -= lr * g. `opt.eval()` moves y to the average
    x = lerp(y, z, 1 - 1/beta1) and `opt.train()` back with lerp(x, z, 1 - beta1)."""
    p = P(1., 2.)
    out = schedule_free_step(p, sf_lr=0.1, ckp1=torch.tensor(0.25, dtype=torch.float64), mom=0.9, z=T(3.))  # (0-d, as
    # schedule_free_weight gives it)
    close(p, 1.5 + 2. * 0.1 * (0.9 * 0.75 - 1.))
    close(out['z'], 3. - 0.1 * 2.)
    p = P(1., 2.)
    out = schedule_free_step(p, sf_lr=0.1, ckp1=torch.tensor(1., dtype=torch.float64), mom=0.9)  # first step: z starts at the param
    close(p, 1. + 2. * 0.1 * (0. - 1.)), close(out['z'], 1. - 0.2)
    assert torch.equal(p.grad, T(2.))
    y, z = P(1.5), T(3.)
    schedule_free_step.on_eval(y, mom=0.9, z=z)
    close(y, 1.5 + (1. - 1. / 0.9) * (3. - 1.5))
    schedule_free_step.on_train(y, mom=0.9, z=z)
    close(y, 1.5)


# -- Kahan summation -----------------------------------------------------------------------------------------------
def test_kahan_keeps_what_bfloat16_rounds_away() -> None:
    """comp += update; old = p; p += comp; comp += old - p (torch-optimi's kahan_sum). 1e-3 steps on a bfloat16 1.0
    (whose spacing below 1 is 2**-8): plain SGD never moves it; with Kahan, p + comp follows the exact sum, and p
    is within half a spacing of it."""
    import pytest
    from cbopt.callbacks import sgd_step
    from cbopt.callbacks.compensated import kahan, kahan_chain
    step = kahan(sgd_step)
    p = torch.ones(1, dtype=torch.bfloat16)
    p.grad = torch.ones(1, dtype=torch.bfloat16)
    plain = p.clone()
    plain.grad = p.grad
    comp = None
    for n in range(1, 41):
        comp = step(p, lr=1e-3, kahan_comp=comp)['kahan_comp']
        sgd_step(plain, lr=1e-3)
        exact = 1. - n * 1e-3
        assert abs(p.double().item() + comp.double().item() - exact) < n * 1e-5   # comp's own bf16 rounding
        assert abs(p.double().item() - exact) <= 2 ** -9 + 1e-6
        assert comp.dtype == torch.bfloat16
    assert plain.item() == 1. and p.item() < 0.97
    assert step.state['kahan_comp'] is not None and step.__name__ == 'kahan_sgd_step'
    with pytest.raises(ValueError, match='lion_avg'):
        kahan(lion_avg)                       # not `additive`: its update reads the param's state, not p += update
    assert kahan_chain([lion_avg, sgd_step], kahan_sum=False) == [lion_avg, sgd_step]
    assert kahan_chain([lion_avg, sgd_step]) == [lion_avg, step]
    with pytest.raises(ValueError, match='additive'):
        kahan_chain([lion_avg])
