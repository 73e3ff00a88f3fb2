"""One test per callback of `cbopt.torch_callbacks`, and of torch's `maximize`/`amsgrad` callbacks (issue #14 item
3), as `test_callbacks.py` does for fastai's: a one-element float64 param (Rprop's: three elements, one per branch;
Adafactor's factored moment: a 2x2 matrix) with a hand-chosen grad and state, and the expected numbers worked out in
the test from torch's documented update rules (never with the callbacks' own helpers such as `debias`).
`test_torch_catalogue.py` checks the same callbacks against torch.optim over many steps; these pin each formula on
its own, where a wrong constant cannot hide behind another callback of the chain."""
from __future__ import annotations

import math

import torch

from cbopt.callbacks import adam_step, amsgrad_max, negate_grad
from cbopt.callbacks.torch_optim import (adadelta_step, adafactor_step, adagrad_step, adamax_step, asgd_step, factored_sqr_grad,
                                   inf_norm_grad, nadam_step, relative_step_size, rprop_step, sqr_grad_sum)


def T(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def P(data: tuple, grad: tuple) -> torch.Tensor:
    "A float64 param holding `data`, with `grad` as its gradient."
    p = T(*data)
    p.grad = T(*grad)
    return p


def close(t: torch.Tensor, *expected: float) -> None:
    "`t` holds the hand-computed numbers, to float64 rounding."
    torch.testing.assert_close(t, T(*expected).reshape(t.shape), rtol=1e-12, atol=1e-15)


def grad_untouched(p: torch.Tensor, *grad: float) -> None:
    "The grad contract: a callback never writes into `p.grad`."
    assert torch.equal(p.grad, T(*grad))


# -- Adagrad -------------------------------------------------------------------------------------------------------
def test_sqr_grad_sum_starts_at_the_initial_accumulator_value() -> None:
    "Step 1 sets the sum to `initial_accumulator_value` (whatever it held: torch fills it at construction), then adds g^2."
    p = P((1.,), (3.,))
    out = sqr_grad_sum(p, step=1, initial_accumulator_value=0.5, sqr_sum=T(7.))
    close(out['sqr_sum'], 0.5 + 3. * 3.)
    out = sqr_grad_sum(p, step=2, initial_accumulator_value=0.5, sqr_sum=out['sqr_sum'])
    close(out['sqr_sum'], 9.5 + 9.)          # later steps only add
    close(sqr_grad_sum(p, step=1, initial_accumulator_value=0.)['sqr_sum'], 9.)  # a first call creates it
    close(p, 1.), grad_untouched(p, 3.)


def test_adagrad_step_decays_the_lr_with_the_step() -> None:
    "p -= lr / (1 + (step - 1) * lr_decay) * g / (sqrt(sum) + eps)"
    p = P((1.,), (3.,))
    adagrad_step(p, lr=0.1, lr_decay=0.5, step=3, sqr_sum=T(16.), eps=0.25)
    close(p, 1. - 0.1 / (1. + 2 * 0.5) * 3. / (4. + 0.25))
    p = P((1.,), (3.,))
    adagrad_step(p, lr=0.1, lr_decay=0.5, step=1, sqr_sum=T(16.), eps=0.25)  # no decay at the first step
    close(p, 1. - 0.1 * 3. / 4.25)
    grad_untouched(p, 3.)
    assert adagrad_step.defaults == dict(lr_decay=0., eps=1e-10)  # torch.optim.Adagrad's


# -- Adadelta ------------------------------------------------------------------------------------------------------
def test_adadelta_step() -> None:
    "delta = sqrt(acc_delta + eps) / sqrt(sqr_avg + eps) * g; acc_delta = rho*acc_delta + (1-rho)*delta^2; p -= lr*delta"
    p = P((1.,), (2.,))
    out = adadelta_step(p, lr=0.5, sqr_mom=0.9, eps=0.01, sqr_avg=T(4.), delta_sqr_avg=T(0.25))
    delta = math.sqrt(0.25 + 0.01) / math.sqrt(4. + 0.01) * 2.
    close(p, 1. - 0.5 * delta)
    close(out['delta_sqr_avg'], 0.9 * 0.25 + 0.1 * delta * delta)
    grad_untouched(p, 2.)


def test_adadelta_first_step_starts_from_zero_updates() -> None:
    p = P((1.,), (2.,))
    out = adadelta_step(p, lr=1., sqr_mom=0.9, eps=0.01, sqr_avg=T(0.4))
    delta = math.sqrt(0.01) / math.sqrt(0.41) * 2.
    close(p, 1. - delta)
    close(out['delta_sqr_avg'], 0.1 * delta * delta)
    assert adadelta_step.defaults == dict(sqr_mom=0.9, eps=1e-6)  # torch's rho and eps


# -- Adamax --------------------------------------------------------------------------------------------------------
def test_inf_norm_grad_is_the_larger_of_the_decayed_norm_and_the_grad() -> None:
    "inf_norm = max(beta2 * inf_norm, |g| + eps)"
    p = P((1.,), (-3.,))
    close(inf_norm_grad(p, sqr_mom=0.5, eps=0.1, inf_norm=T(10.))['inf_norm'], 5.)   # the decayed norm wins
    close(inf_norm_grad(p, sqr_mom=0.5, eps=0.1, inf_norm=T(4.))['inf_norm'], 3.1)   # the grad wins
    close(inf_norm_grad(p, sqr_mom=0.5, eps=0.1)['inf_norm'], 3.1)                   # first step: from zero
    close(p, 1.), grad_untouched(p, -3.)


def test_adamax_step_debiases_the_average_only() -> None:
    "p -= lr / (1 - beta1^step) * exp_avg / inf_norm"
    p = P((1.,), (2.,))
    adamax_step(p, lr=0.1, mom=0.9, step=2, grad_avg=T(0.5), inf_norm=T(2.))
    close(p, 1. - 0.1 / (1. - 0.81) * 0.5 / 2.)
    grad_untouched(p, 2.)


# -- NAdam ---------------------------------------------------------------------------------------------------------
def test_nadam_step() -> None:
    """mu_t = beta1 * (1 - 0.5 * 0.96^(t * psi)), mu_product *= mu_t, denom = sqrt(v / (1 - beta2^t)) + eps;
    p -= lr * (1 - mu_t) / (1 - mu_product) * g / denom + lr * mu_{t+1} / (1 - mu_product * mu_{t+1}) * m / denom"""
    p = P((1.,), (2.,))
    out = nadam_step(p, lr=0.1, mom=0.9, sqr_mom=0.99, eps=0.01, step=2, momentum_decay=0.5, grad_avg=T(0.5),
                     sqr_avg=T(0.2), mu_product=torch.tensor(0.5, dtype=torch.float64))
    mu, mu_next = 0.9 * (1. - 0.5 * 0.96 ** (2 * 0.5)), 0.9 * (1. - 0.5 * 0.96 ** (3 * 0.5))
    prod = 0.5 * mu
    denom = math.sqrt(0.2 / (1. - 0.99 ** 2)) + 0.01
    close(p, 1. - 0.1 * (1. - mu) / (1. - prod) * 2. / denom - 0.1 * mu_next / (1. - prod * mu_next) * 0.5 / denom)
    close(out['mu_product'], prod)
    grad_untouched(p, 2.)


def test_nadam_mu_product_starts_at_one_in_the_params_precision() -> None:
    "A first step's product is mu_1 itself; it is a 0-d float64 tensor for a float64 param, float32 otherwise (torch's)."
    p = P((1.,), (2.,))
    out = nadam_step(p, lr=0.1, mom=0.9, sqr_mom=0.99, eps=0.01, step=1, momentum_decay=0.5, grad_avg=T(0.5),
                     sqr_avg=T(0.2))
    close(out['mu_product'], 0.9 * (1. - 0.5 * 0.96 ** 0.5))
    assert out['mu_product'].dtype == torch.float64 and out['mu_product'].ndim == 0
    q = torch.ones(1, dtype=torch.bfloat16)
    assert nadam_step.state['mu_product'](q).dtype == torch.float32
    assert nadam_step.defaults == dict(eps=1e-8, momentum_decay=4e-3)  # torch.optim.NAdam's


# -- ASGD ----------------------------------------------------------------------------------------------------------
def test_asgd_step_averages_from_t0() -> None:
    """eta = lr / (1 + lambd * lr * (step - 1))^alpha; p = p * (1 - lambd * eta) - eta * g; the average moves by
    mu = 1 / max(1, step - 1 - t0) towards p."""
    p = P((2.,), (1.,))
    out = asgd_step(p, lr=0.1, lambd=0.5, alpha=0.75, t0=1, step=4, param_avg=T(1.))
    eta = 0.1 / (1. + 0.5 * 0.1 * 3) ** 0.75
    new = 2. * (1. - 0.5 * eta) - eta * 1.
    close(p, new)
    close(out['param_avg'], 1. + (new - 1.) * (1. / (4 - 1 - 1)))
    grad_untouched(p, 1.)


def test_asgd_average_is_the_param_before_t0_and_at_the_first_step() -> None:
    for step, t0 in ((1, 0), (3, 10)):  # mu = 1: the first step, and any step before t0
        p = P((2.,), (1.,))
        out = asgd_step(p, lr=0.1, lambd=0.5, alpha=0.75, t0=t0, step=step, param_avg=T(-7.))
        eta = 0.1 / (1. + 0.5 * 0.1 * (step - 1)) ** 0.75
        close(p, 2. * (1. - 0.5 * eta) - eta)
        close(out['param_avg'], p.item())
    assert asgd_step.defaults == dict(lambd=1e-4, alpha=0.75, t0=1e6)  # torch.optim.ASGD's


# -- Rprop ---------------------------------------------------------------------------------------------------------
def test_rprop_step_per_element_branches() -> None:
    """Elements whose grad kept its sign grow their step by etaplus, flipped ones shrink it by etaminus and do not
    move (their grad is remembered as 0), a zero product keeps it; the step is clamped; p -= sign(g) * step_size."""
    p = P((1., 1., 1.), (2., -3., 4.))
    out = rprop_step(p, lr=0.1, etaminus=0.5, etaplus=1.2, step_size_min=0.01, step_size_max=0.11, step=2,
                     prev_grad=T(1., 1., 0.), step_size=T(0.1, 0.1, 0.1))
    close(out['step_size'], 0.11, 0.05, 0.1)  # 0.12 clamped to the max
    close(out['prev_grad'], 2., 0., 4.)
    close(p, 1. - 0.11, 1., 1. - 0.1)
    grad_untouched(p, 2., -3., 4.)
    out = rprop_step(p, lr=0.1, etaminus=0.5, etaplus=1.2, step_size_min=0.04, step_size_max=1., step=3,
                     prev_grad=T(1., 1., 1.), step_size=T(0.05, 0.05, 0.05))
    close(out['step_size'], 0.06, 0.04, 0.06)  # 0.025 clamped to the min


def test_rprop_first_step_sizes_are_the_lr() -> None:
    "At step 1 every step size is the group's lr (whatever it held), and each element moves by lr along -sign(g)."
    p = P((1., 1.), (2., -3.))
    out = rprop_step(p, lr=0.1, etaminus=0.5, etaplus=1.2, step_size_min=1e-6, step_size_max=50., step=1,
                     prev_grad=T(0., 0.), step_size=T(9., 9.))
    close(out['step_size'], 0.1, 0.1)
    close(p, 0.9, 1.1)
    out = rprop_step(P((1.,), (2.,)), lr=0.1, etaminus=0.5, etaplus=1.2, step_size_min=1e-6, step_size_max=50., step=1)
    close(out['step_size'], 0.1), close(out['prev_grad'], 2.)
    assert rprop_step.defaults == dict(etaminus=0.5, etaplus=1.2, step_size_min=1e-6, step_size_max=50.)


# -- Adafactor -----------------------------------------------------------------------------------------------------
def test_relative_step_size() -> None:
    "step_size = max(eps2, rms(p)) * min(lr, 1 / sqrt(step))"
    p = P((3.,), (1.,))
    close(relative_step_size(p, lr=0.1, step=4, eps2=1e-3)['step_size'], 3. * 0.1)   # lr is the smaller
    close(relative_step_size(p, lr=1., step=4, eps2=1e-3)['step_size'], 3. * 0.5)    # 1/sqrt(4) is the smaller
    close(relative_step_size(P((3., 4.), (1., 1.)), lr=1., step=1, eps2=1e-3)['step_size'], math.sqrt(12.5))
    close(relative_step_size(P((1e-4,), (1.,)), lr=0.1, step=1, eps2=1e-3)['step_size'], 1e-3 * 0.1)  # the floor
    close(p, 3.)


def test_factored_sqr_grad_of_a_vector_is_in_full() -> None:
    "Fewer than 2 dims: variance = lerp(variance, g^2, step^beta2_decay); at step 1 the weight is 1."
    p = P((1.,), (2.,))
    out = factored_sqr_grad(p, step=1, beta2_decay=-0.8)
    assert set(out) == {'variance'}
    close(out['variance'], 4.)
    out = factored_sqr_grad(p, step=4, beta2_decay=-0.5, variance=T(1.))
    close(out['variance'], 1. + 0.5 * (4. - 1.))
    grad_untouched(p, 2.)


def test_factored_sqr_grad_of_a_matrix_keeps_row_and_column_means() -> None:
    "2 dims: the mean of g^2 over each row (shape (2, 1)) and over each column (shape (1, 2)), averaged the same way."
    p = torch.zeros(2, 2, dtype=torch.float64)
    p.grad = torch.tensor([[1., 2.], [3., 4.]], dtype=torch.float64)
    out = factored_sqr_grad(p, step=1, beta2_decay=-0.8)
    assert set(out) == {'row_var', 'col_var'}
    torch.testing.assert_close(out['row_var'], torch.tensor([[2.5], [12.5]], dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(out['col_var'], torch.tensor([[5., 10.]], dtype=torch.float64), rtol=1e-12, atol=0)
    out = factored_sqr_grad(p, step=4, beta2_decay=-0.5, row_var=out['row_var'], col_var=torch.zeros(1, 2, dtype=torch.float64))
    torch.testing.assert_close(out['row_var'], torch.tensor([[2.5], [12.5]], dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(out['col_var'], torch.tensor([[2.5, 5.]], dtype=torch.float64), rtol=1e-12, atol=0)


def test_adafactor_step_clips_the_updates_rms_to_d() -> None:
    "update = g / sqrt(variance); p -= step_size * update / max(1, rms(update) / d)"
    p = P((1.,), (2.,))
    adafactor_step(p, step_size=0.1, d=1., eps1=1e-30, variance=T(4.))   # update 1, rms 1: not clipped
    close(p, 1. - 0.1)
    p = P((1.,), (2.,))
    adafactor_step(p, step_size=0.1, d=0.5, eps1=1e-30, variance=T(4.))  # rms 1 > d: halved
    close(p, 1. - 0.05)
    p = P((1.,), (2.,))
    adafactor_step(p, step_size=0.1, d=1., eps1=0.5, variance=T(0.))     # the variance is floored at eps1^2
    close(p, 1. - 0.1 * 2. / 0.5 / 4.)                                      # update 4, rms 4 > d: divided by 4
    grad_untouched(p, 2.)
    assert adafactor_step.defaults == dict(d=1., eps1=None)


def test_adafactor_step_of_a_matrix_from_its_factors() -> None:
    "v = row_var @ col_var / mean(row_var): the outer product of the factors over the rows' mean."
    g = [[1., 2.], [3., 4.]]
    p = torch.zeros(2, 2, dtype=torch.float64)
    p.grad = torch.tensor(g, dtype=torch.float64)
    rows, cols = [2.5, 12.5], [5., 10.]
    v = [[rows[i] * cols[j] / 7.5 for j in range(2)] for i in range(2)]
    update = [[g[i][j] / math.sqrt(v[i][j]) for j in range(2)] for i in range(2)]
    assert math.sqrt(sum(u * u for r in update for u in r) / 4) < 1    # under d: not clipped
    adafactor_step(p, step_size=0.1, d=1., eps1=1e-30, row_var=torch.tensor([[2.5], [12.5]], dtype=torch.float64),
                   col_var=torch.tensor([[5., 10.]], dtype=torch.float64))
    torch.testing.assert_close(p, -0.1 * torch.tensor(update, dtype=torch.float64), rtol=1e-12, atol=0)


# -- torch's maximize and amsgrad flags --------------------------------------------------------------------------------
def test_negate_grad_rebinds_the_grad() -> None:
    "The rest of the chain sees -g; the user's grad tensor is not written."
    p = P((1.,), (2.,))
    user_grad = p.grad
    assert negate_grad(p) is None
    close(p.grad, -2.)
    assert p.grad is not user_grad and torch.equal(user_grad, T(2.))


def test_amsgrad_max_and_adam_step_with_it() -> None:
    "max_sqr_avg = max(max_sqr_avg, sqr_avg); Adam then divides by sqrt(max_sqr_avg / (1 - beta2^step)) + eps."
    p = P((1.,), (2.,))
    close(amsgrad_max(p, sqr_avg=T(0.3), max_sqr_avg=T(0.5))['max_sqr_avg'], 0.5)
    close(amsgrad_max(p, sqr_avg=T(0.7), max_sqr_avg=T(0.5))['max_sqr_avg'], 0.7)
    close(amsgrad_max(p, sqr_avg=T(0.2))['max_sqr_avg'], 0.2)
    adam_step(p, lr=0.1, mom=0.9, step=1, sqr_mom=0.99, grad_avg=T(0.2), sqr_avg=T(0.01), eps=0.01, max_sqr_avg=T(0.04))
    close(p, 1. - 0.1 / 0.1 * 0.2 / (math.sqrt(0.04 / 0.01) + 0.01))
    grad_untouched(p, 2.)


# -- Muon ------------------------------------------------------------------------------------------------------------
from cbopt.callbacks.torch_optim import (centered_grad_avg, muon_momentum, muon_step, newton_schulz, torch_rmsprop_momentum_step,
                                   torch_rmsprop_step)

NS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's default ns_coefficients


def ns_singular_value(steps: int, a: float = NS[0], b: float = NS[1], c: float = NS[2]) -> float:
    """Where Newton-Schulz takes a singular value of 1 (a normalized rank-1 matrix has just that one) in `steps`
    quintic iterations: s <- a*s + b*s**3 + c*s**5 (torch's `_zeropower_via_newtonschulz`, in exact arithmetic)."""
    s = 1.
    for _ in range(steps): s = a * s + b * s ** 3 + c * s ** 5
    return s


def test_muon_momentum_lerps_and_looks_ahead() -> None:
    "buf = buf.lerp(g, 1 - mom); the update is g.lerp(buf, mom) with nesterov (torch's default), else buf itself."
    p = P((1.,), (2.,))
    out = muon_momentum(p, mom=0.9, nesterov=True, grad_avg=T(4.))
    buf = 4. + 0.1 * (2. - 4.)
    close(out['grad_avg'], buf)
    close(out['muon_update'], 2. + 0.9 * (buf - 2.))
    out = muon_momentum(P((1.,), (2.,)), mom=0.9, nesterov=False, grad_avg=T(4.))
    close(out['muon_update'], buf)
    assert out['muon_update'] is out['grad_avg']
    out = muon_momentum(p, mom=0.9, nesterov=False)  # first step: from a zero buffer
    close(out['grad_avg'], 0.1 * 2.)
    close(p, 1.), grad_untouched(p, 2.)
    assert muon_momentum.defaults == dict(mom=0.95, nesterov=True)  # torch.optim.Muon's momentum and nesterov


def test_newton_schulz_of_a_rank_one_matrix() -> None:
    """A rank-1 matrix u v^T has one singular value: the iterations map it from 1 (after normalizing) to
    `ns_singular_value(steps)` and keep the singular vectors, so the result is that value times u v^T / |u v^T|.
    Tall and wide alike (a tall one is transposed first); computed in bfloat16, so to bfloat16's precision."""
    u, v = torch.tensor([3., 4.]), torch.tensor([1., 2., 2.])
    for x in (torch.outer(u, v), torch.outer(v, u), u[None], u[:, None]):
        for steps in (1, 2, 5):
            out = newton_schulz(x.double(), *NS, steps=steps, eps=1e-7)
            assert out.dtype == torch.bfloat16 and out.shape == x.shape
            expected = ns_singular_value(steps) * x / x.norm()
            torch.testing.assert_close(out.double(), expected.double(), rtol=0.02, atol=0.02)
    assert abs(ns_singular_value(1) - (NS[0] + NS[1] + NS[2])) < 1e-12  # one step from s = 1: a + b + c
    torch.testing.assert_close(newton_schulz(torch.zeros(2, 3), *NS, steps=5, eps=1e-7).float(), torch.zeros(2, 3))


def test_newton_schulz_refuses_other_than_matrices() -> None:
    import pytest
    for shape in ((3,), (2, 2, 2)):
        with pytest.raises(ValueError, match='2-D'):
            newton_schulz(torch.ones(shape), *NS, steps=5, eps=1e-7)


def test_muon_step_adjusts_the_lr_to_the_shape() -> None:
    """p -= lr' * NS(update), lr' = lr * sqrt(max(1, rows/cols)) ('original', torch's default), or
    lr * 0.2 * sqrt(max(rows, cols)) ('match_rms_adamw'). A rank-1 update keeps its direction (see above)."""
    tall = torch.tensor([[3.], [4.]], dtype=torch.float64)
    cases = [(tall, None, 0.1 * math.sqrt(2.)), (tall, 'original', 0.1 * math.sqrt(2.)),
             (tall, 'match_rms_adamw', 0.1 * 0.2 * math.sqrt(2.)),
             (tall.T, None, 0.1), (tall.T, 'match_rms_adamw', 0.1 * 0.2 * math.sqrt(2.))]  # wide: rows/cols = 1/2
    for upd, fn, lr in cases:
        w = torch.ones_like(upd)
        p = w.clone()
        p.grad = torch.zeros_like(p)
        muon_step(p, lr=0.1, muon_update=upd, ns_a=NS[0], ns_b=NS[1], ns_c=NS[2], ns_steps=5, eps=1e-7, adjust_lr_fn=fn)
        torch.testing.assert_close(w - p, lr * ns_singular_value(5) * upd / 5., rtol=0.02, atol=1e-5)  # the update
        assert p.dtype == torch.float64
    d = muon_step.defaults
    assert (d['ns_a'], d['ns_b'], d['ns_c'], d['ns_steps'], d['adjust_lr_fn']) == (*NS, 5, None)


# -- torch's RMSprop ---------------------------------------------------------------------------------------------------
def test_centered_grad_avg_is_a_mean_of_the_grads() -> None:
    "grad_avg = alpha * grad_avg + (1 - alpha) * g (torch's `centered` mean; alpha is `sqr_mom`)"
    p = P((1.,), (2.,))
    close(centered_grad_avg(p, sqr_mom=0.9, grad_avg=T(4.))['grad_avg'], 0.9 * 4. + 0.1 * 2.)
    close(centered_grad_avg(p, sqr_mom=0.9)['grad_avg'], 0.1 * 2.)
    close(p, 1.), grad_untouched(p, 2.)


def test_torch_rmsprop_step_plain_and_centered() -> None:
    "p -= lr * g / (sqrt(v) + eps); centered: sqrt(v - m^2), m the mean of the grads"
    p = P((1.,), (2.,))
    torch_rmsprop_step(p, lr=0.1, eps=0.5, sqr_avg=T(9.))
    close(p, 1. - 0.1 * 2. / (3. + 0.5))
    p = P((1.,), (2.,))
    torch_rmsprop_step(p, lr=0.1, eps=0.5, sqr_avg=T(9.), grad_avg=T(math.sqrt(5.)))  # v - m^2 = 4
    close(p, 1. - 0.1 * 2. / (2. + 0.5))
    grad_untouched(p, 2.)
    assert torch_rmsprop_step.defaults == dict(eps=1e-8)  # torch.optim.RMSprop's


def test_torch_rmsprop_momentum_divides_before_averaging() -> None:
    "buf = mom * buf + g / (sqrt(v) + eps); p -= lr * buf (torch's order; fastai's averages first)"
    p = P((1.,), (2.,))
    out = torch_rmsprop_momentum_step(p, lr=0.1, mom=0.9, eps=0.5, sqr_avg=T(9.), mom_buf=T(1.))
    buf = 0.9 * 1. + 2. / 3.5
    close(out['mom_buf'], buf)
    close(p, 1. - 0.1 * buf)
    p = P((1.,), (2.,))
    out = torch_rmsprop_momentum_step(p, lr=0.1, mom=0.9, eps=0.5, sqr_avg=T(9.), grad_avg=T(math.sqrt(5.)))
    close(out['mom_buf'], 2. / 2.5)  # first step from a zero buffer, centered
    close(p, 1. - 0.1 * 2. / 2.5)
    grad_untouched(p, 2.)
