"""One test per callback of `cbopt.modern_callbacks` (issue #14 item 3): a one-element float64 param with a
hand-chosen grad and state, and the expected numbers worked out in the test from the papers' and the reference
packages' update rules. `test_modern.py` checks the same callbacks against lion-pytorch, pytorch-optimizer and
torch-optimi over many steps; these pin each formula on its own."""
from __future__ import annotations

import math

import torch

from cbopt.modern_callbacks import (adan_avgs, adan_step, ademamix_step, debiased_avgs, lion_avg, lion_step,
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
