"""One test per step callback, as fastai's 12_optimizer notebook tests its callbacks: a tiny float64 param with a
hand-chosen grad and state, and the expected numbers worked out by hand in the test (the arithmetic is written
out, never computed by the callback's own helpers such as `debias`). Then every callback runs once on a bucket of
two params (a TensorList, as the foreach backend runs it) and must give exactly what it gives param by param.
"""
from __future__ import annotations

import math

import pytest
import torch

from cbopt.callbacks import (adam_step, average_grad, average_sqr_grad, dampened_grad_avg, debias, l2_reg, lamb_step,
                             larc_layer_lr, larc_step, lookahead_keep, lookahead_step, momentum_step, nesterov_step,
                             qhadam_step, radam_step, rms_prop_step, sgd_step, step_stat, weight_decay)
from cbopt.core.tensorlist import TensorList


def T(*xs: float) -> torch.Tensor:
    "A float64 tensor of the numbers given."
    return torch.tensor(xs, dtype=torch.float64)


def P(data: tuple, grad: tuple | None = None) -> torch.Tensor:
    "A float64 param holding `data`, with `grad` as its gradient."
    p = T(*data)
    if grad is not None: p.grad = T(*grad)
    return p


def close(t: torch.Tensor, *expected: float) -> None:
    "`t` holds the hand-computed `expected` numbers, to float64 rounding (torch may order the float ops otherwise)."
    torch.testing.assert_close(t, T(*expected).reshape(t.shape), rtol=1e-12, atol=1e-15)


# -- weight decay ----------------------------------------------------------------------------------------------------
def test_weight_decay() -> None:
    "Decoupled: p *= 1 - lr*wd; the grad is untouched; nothing is returned (no state)."
    p = P((2.0, -4.0), (3.0, 3.0))
    assert weight_decay(p, lr=0.1, wd=0.5) is None
    close(p, 2.0 * 0.95, -4.0 * 0.95)  # 1 - 0.1*0.5 = 0.95
    close(p.grad, 3.0, 3.0)


def test_l2_reg() -> None:
    "L2: grad += wd*p; the param is untouched."
    p = P((2.0, -4.0), (3.0, 3.0))
    assert l2_reg(p, lr=0.1, wd=0.5) is None
    close(p.grad, 3.0 + 0.5 * 2.0, 3.0 + 0.5 * -4.0)  # 4.0, 1.0
    close(p, 2.0, -4.0)


@pytest.mark.parametrize('cb', [weight_decay, l2_reg])
def test_do_wd_false_and_zero_wd_disable_decay(cb) -> None:
    "A param flagged `do_wd=False` (a bias, a norm weight) and `wd=0` get no decay at all."
    for kw in (dict(wd=0.5, do_wd=False), dict(wd=0.)):
        p = P((2.0,), (3.0,))
        assert cb(p, lr=0.1, **kw) is None
        close(p, 2.0)
        close(p.grad, 3.0)


@pytest.mark.parametrize('cb', [weight_decay, l2_reg])
def test_wd_of_one_decays(cb) -> None:
    "Only a zero `wd` turns decay off: `wd=1` (no special value) decays by lr*1."
    p = P((2.0,), (3.0,))
    cb(p, lr=0.1, wd=1.0)
    if cb is weight_decay: close(p, 2.0 * 0.9)  # 1 - 0.1*1
    else: close(p.grad, 3.0 + 1.0 * 2.0)        # 5.0


# -- gradient averages -------------------------------------------------------------------------------------------------
def test_average_grad() -> None:
    "grad_avg = mom*grad_avg + grad, starting from zeros, updated in place and returned as state."
    p = P((1.0,), (2.0,))
    st = average_grad(p, mom=0.9)
    assert set(st) == {'grad_avg'}
    close(st['grad_avg'], 2.0)  # 0.9*0 + 2
    avg = T(1.0)
    st = average_grad(p, mom=0.9, grad_avg=avg)
    assert st['grad_avg'] is avg
    close(avg, 0.9 * 1.0 + 2.0)  # 2.9
    close(p.grad, 2.0)


def test_average_grad_with_dampening() -> None:
    "`dampening=True` weighs the new grad by 1-mom (Adam's first moment)."
    p = P((1.0,), (2.0,))
    close(average_grad(p, mom=0.9, dampening=True)['grad_avg'], 0.1 * 2.0)  # 0.9*0 + 0.1*2 = 0.2
    avg = T(1.0)
    assert average_grad(p, mom=0.9, dampening=True, grad_avg=avg)['grad_avg'] is avg
    close(avg, 0.9 * 1.0 + 0.1 * 2.0)  # 1.1


def test_dampened_grad_avg() -> None:
    "torch.optim.SGD's buffer: the first step keeps (a copy of) the grad, later ones mom*avg + (1-dampening)*grad."
    p = P((1.0,), (2.0,))
    st = dampened_grad_avg(p, mom=0.9, dampening=0.25)
    assert set(st) == {'grad_avg'}
    close(st['grad_avg'], 2.0)  # the grad itself, no dampening on the first step
    st['grad_avg'].add_(1)
    close(p.grad, 2.0)  # a copy, not the grad
    avg = T(1.0)
    assert dampened_grad_avg(p, mom=0.9, dampening=0.25, grad_avg=avg)['grad_avg'] is avg
    close(avg, 0.9 * 1.0 + 0.75 * 2.0)  # 2.4


def test_dampened_grad_avg_default_is_no_dampening() -> None:
    "torch.optim.SGD's `dampening` defaults to 0: later steps add the whole grad."
    p, avg = P((1.0,), (2.0,)), T(1.0)
    dampened_grad_avg(p, mom=0.9, grad_avg=avg)
    close(avg, 0.9 * 1.0 + 2.0)  # 2.9


def test_average_sqr_grad() -> None:
    "sqr_avg = sqr_mom*sqr_avg + (1-sqr_mom)*grad**2 (without dampening: + grad**2)."
    p = P((1.0,), (2.0,))
    st = average_sqr_grad(p, sqr_mom=0.99)
    assert set(st) == {'sqr_avg'}
    close(st['sqr_avg'], 0.01 * 4.0)  # 0.04
    avg = T(1.0)
    assert average_sqr_grad(p, sqr_mom=0.99, sqr_avg=avg)['sqr_avg'] is avg
    close(avg, 0.99 * 1.0 + 0.01 * 4.0)  # 1.03
    avg = T(1.0)
    average_sqr_grad(p, sqr_mom=0.99, dampening=False, sqr_avg=avg)
    close(avg, 0.99 * 1.0 + 4.0)  # 4.99
    close(p.grad, 2.0)


# -- steps -----------------------------------------------------------------------------------------------------------
def test_sgd_step() -> None:
    p = P((1.0, -1.0), (2.0, 0.5))
    assert sgd_step(p, lr=0.1) is None
    close(p, 1.0 - 0.1 * 2.0, -1.0 - 0.1 * 0.5)  # 0.8, -1.05


def test_momentum_step() -> None:
    "p -= lr*grad_avg (the raw grad is not used)."
    p, avg = P((1.0,), (2.0,)), T(3.0)
    assert momentum_step(p, lr=0.1, grad_avg=avg) is None
    close(p, 1.0 - 0.1 * 3.0)  # 0.7
    close(avg, 3.0)


def test_nesterov_step() -> None:
    "torch.optim.SGD's Nesterov: p -= lr*(grad + mom*grad_avg); neither grad nor average changes."
    p, avg = P((1.0,), (2.0,)), T(3.0)
    assert nesterov_step(p, lr=0.1, mom=0.9, grad_avg=avg) is None
    close(p, 1.0 - 0.1 * (2.0 + 0.9 * 3.0))  # 1 - 0.47 = 0.53
    close(p.grad, 2.0)
    close(avg, 3.0)


def test_rms_prop_step() -> None:
    "p -= lr*grad / (sqrt(sqr_avg) + eps); with a grad_avg, that average in place of the grad."
    p, sq = P((1.0,), (2.0,)), T(4.0)
    assert rms_prop_step(p, lr=0.1, sqr_avg=sq, eps=1e-8) is None
    close(p, 1.0 - 0.1 * 2.0 / (2.0 + 1e-8))  # sqrt(4) = 2
    close(sq, 4.0)
    p, avg = P((1.0,), (2.0,)), T(3.0)
    rms_prop_step(p, lr=0.1, sqr_avg=sq, eps=1e-8, grad_avg=avg)
    close(p, 1.0 - 0.1 * 3.0 / (2.0 + 1e-8))
    close(avg, 3.0)
    close(sq, 4.0)


def test_step_stat() -> None:
    "The step count: 1 after the first step, a plain Python int."
    p = P((1.0,), (2.0,))
    assert step_stat(p) == {'step': 1}
    st = step_stat(p, step=4)
    assert st == {'step': 5} and type(st['step']) is int


def test_debias() -> None:
    "debias(mom, 1-mom, step) = 1 - mom**step: the weight a zero-started average of `step` values has."
    assert debias(0.9, 0.1, 1) == pytest.approx(0.1)
    assert debias(0.9, 0.1, 2) == pytest.approx(0.19)         # 0.1 + 0.1*0.9
    assert debias(0.99, 0.01, 3) == pytest.approx(0.029701)   # 0.01*(1 + 0.99 + 0.9801)
    assert debias(0.9, 1.0, 2) == pytest.approx(1.9)          # undampened average: 1 + 0.9


ADAM = dict(lr=0.1, mom=0.9, sqr_mom=0.99)


def test_adam_step() -> None:
    "p -= lr/debias1 * grad_avg / (sqrt(sqr_avg/debias2) + eps); the moments do not change."
    p, avg, sq = P((1.0,), (0.3,)), T(0.5), T(0.04)
    assert adam_step(p, **ADAM, step=2, grad_avg=avg, sqr_avg=sq, eps=1e-5) is None
    # step 2: debias1 = 1 - 0.9**2 = 0.19, debias2 = 1 - 0.99**2 = 0.0199
    close(p, 1.0 - 0.1 / 0.19 * 0.5 / (math.sqrt(0.04 / 0.0199) + 1e-5))
    close(avg, 0.5)
    close(sq, 0.04)


def test_radam_step_before_rectification() -> None:
    """While the variance of the adaptive lr is undefined (r <= 5), RAdam is momentum SGD on the debiased average.
    sqr_mom=0.99: r_inf = 2/0.01 - 1 = 199; at step 1, r = 199 - 2*1*0.99/0.01 = 1."""
    p, avg, sq = P((1.0,), (0.3,)), T(0.5), T(0.04)
    assert radam_step(p, **ADAM, step=1, grad_avg=avg, sqr_avg=sq, eps=1e-5, beta=0.) is None
    close(p, 1.0 - 0.1 / 0.1 * 0.5)  # debias1 = 1 - 0.9 = 0.1: p = 0.5 (sqr_avg unused)


def test_radam_step_switches_between_steps_5_and_6() -> None:
    """The switch is at r > 5 (fastai's and the paper's threshold for the SGD warmup), not nearby: sqr_mom=0.99 has
    r = 199 - 2*5*0.99**5/(1 - 0.99**5) ~ 4.96 at step 5 (momentum SGD) and ~ 5.94 at step 6 (rectified)."""
    p, avg, sq = P((1.0,), (0.3,)), T(0.5), T(0.04)
    radam_step(p, **ADAM, step=5, grad_avg=avg, sqr_avg=sq, eps=1e-5, beta=0.)
    close(p, 1.0 - 0.1 / (1 - 0.9 ** 5) * 0.5)                   # no sqr_avg in the step
    r, v = rectifier(6)
    assert 5.9 < r < 6
    p = P((1.0,), (0.3,))
    radam_step(p, **ADAM, step=6, grad_avg=avg, sqr_avg=sq, eps=1e-5, beta=0.)
    close(p, 1.0 - 0.1 * v / (1 - 0.9 ** 6) * 0.5 / (math.sqrt(0.04 / (1 - 0.99 ** 6)) + 1e-5))


def rectifier(step: int) -> tuple:
    "RAdam's r_t and rectification term for sqr_mom=0.99 (Liu et al. 2019, eq. and Algorithm 2), written out."
    r_inf = 2 / (1 - 0.99) - 1                                    # 199
    r = r_inf - 2 * step * 0.99 ** step / (1 - 0.99 ** step)
    return r, math.sqrt((r - 4) * (r - 2) * r_inf / ((r_inf - 4) * (r_inf - 2) * r))


@pytest.mark.parametrize('beta', [0., 10.])
def test_radam_step_rectified(beta: float) -> None:
    """At step 10, r ~ 9.84 > 5: the Adam step scaled by the rectification term v; `beta > 0` (SAdam) passes the
    denominator through softplus(beta*x)/beta."""
    r, v = rectifier(10)
    assert 9.8 < r < 9.9
    p, avg, sq = P((1.0,), (0.3,)), T(0.5), T(0.04)
    radam_step(p, **ADAM, step=10, grad_avg=avg, sqr_avg=sq, eps=1e-5, beta=beta)
    debias1, debias2 = 1 - 0.9 ** 10, 1 - 0.99 ** 10             # 0.6513..., 0.0956...
    denom = math.sqrt(0.04 / debias2) + 1e-5
    if beta: denom = math.log1p(math.exp(beta * denom)) / beta
    close(p, 1.0 - 0.1 * v / debias1 * 0.5 / denom)
    close(avg, 0.5)
    close(sq, 0.04)


def test_qhadam_step() -> None:
    "p -= lr * ((1-nu_1)*g + nu_1*grad_avg/debias1) / (sqrt((1-nu_2)*g**2 + nu_2*sqr_avg/debias2) + eps)."
    p, avg, sq = P((1.0,), (3.0,)), T(0.5), T(0.04)  # g = 3: g**2 = 9 (a g of 2 would not tell g**2 from 2*g)
    assert qhadam_step(p, **ADAM, step=2, grad_avg=avg, sqr_avg=sq, nu_1=0.7, nu_2=0.8, eps=1e-8) is None
    num = 0.3 * 3.0 + 0.7 * 0.5 / 0.19                          # debias1 = 1 - 0.9**2 = 0.19
    den = math.sqrt(0.2 * 9.0 + 0.8 * 0.04 / 0.0199) + 1e-8     # debias2 = 1 - 0.99**2 = 0.0199
    close(p, 1.0 - 0.1 * num / den)
    close(p.grad, 3.0)


# -- layer-wise: LARC/LARS, LAMB ---------------------------------------------------------------------------------------
@pytest.mark.parametrize('clip', [True, False])
def test_larc_layer_lr(clip: bool) -> None:
    """local_lr = lr * trust_coeff * |p| / (|g| + wd*|p| + eps), a 0-d tensor of state; LARC clips it at lr.
    p = (3, 4): |p| = 5; g = (0.6, 0.8): |g| = 1."""
    p = P((3.0, 4.0), (0.6, 0.8))
    st = larc_layer_lr(p, lr=0.1, trust_coeff=0.02, wd=0.1, eps=1e-8, clip=clip)
    assert set(st) == {'local_lr'} and st['local_lr'].dim() == 0
    close(st['local_lr'], 0.1 * 0.02 * 5 / (1 + 0.1 * 5 + 1e-8))  # 0.0067 < lr: no clip either way
    st = larc_layer_lr(p, lr=0.1, trust_coeff=1., wd=0.1, eps=1e-8, clip=clip)
    close(st['local_lr'], 0.1 if clip else 0.1 * 5 / (1 + 0.1 * 5 + 1e-8))  # 0.333 > lr: LARC clips, LARS does not
    close(p, 3.0, 4.0)
    close(p.grad, 0.6, 0.8)


def test_larc_layer_lr_clips_by_default() -> None:
    "LARC (clipped) is the default, LARS (`clip=False`) the option: with trust_coeff=1 the ratio 0.333 > lr is clipped."
    p = P((3.0, 4.0), (0.6, 0.8))
    close(larc_layer_lr(p, lr=0.1, trust_coeff=1., wd=0.1, eps=1e-8)['local_lr'], 0.1)


def test_larc_step() -> None:
    "p -= local_lr * grad (or * grad_avg)."
    p = P((3.0, 4.0), (0.6, 0.8))
    assert larc_step(p, local_lr=T(0.1)[0]) is None
    close(p, 3.0 - 0.06, 4.0 - 0.08)
    p = P((3.0, 4.0), (0.6, 0.8))
    larc_step(p, local_lr=T(0.1)[0], grad_avg=T(1.0, 2.0))
    close(p, 3.0 - 0.1, 4.0 - 0.2)


LAMB = dict(lr=0.01, mom=0.9, sqr_mom=0.99, eps=1e-6)


def lamb_update() -> tuple:
    """The Adam direction u for grad_avg (0.1, -0.2), sqr_avg (0.04, 0.16) at step 1 (debias1 = 0.1, debias2 = 0.01),
    and its root mean square."""
    u = (0.1 / 0.1 / (math.sqrt(0.04 / 0.01) + 1e-6), -0.2 / 0.1 / (math.sqrt(0.16 / 0.01) + 1e-6))  # ~(0.5, -0.5)
    return u, math.sqrt((u[0] ** 2 + u[1] ** 2) / 2)


@pytest.mark.parametrize('case, data', [('ratio', (3.0, 4.0)), ('capped', (30.0, 40.0)), ('zero param', (0.0, 0.0))])
def test_lamb_step(case: str, data: tuple) -> None:
    "p -= lr * q * u, with the trust ratio q = rms(p)/rms(u), capped at 10, and 1 for a zero param."
    u, u_rms = lamb_update()
    p_rms = math.sqrt((data[0] ** 2 + data[1] ** 2) / 2)  # sqrt(12.5) ~ 3.54, sqrt(1250) ~ 35.4, 0
    q = {'ratio': p_rms / u_rms, 'capped': 10.0, 'zero param': 1.0}[case]
    assert case != 'ratio' or 1 < q < 10
    assert case != 'capped' or p_rms / u_rms > 10  # the cap bites
    p, avg, sq = P(data, (1.0, 1.0)), T(0.1, -0.2), T(0.04, 0.16)
    assert lamb_step(p, **LAMB, step=1, grad_avg=avg, sqr_avg=sq) is None
    close(p, data[0] - 0.01 * q * u[0], data[1] - 0.01 * q * u[1])
    close(avg, 0.1, -0.2)
    close(sq, 0.04, 0.16)


def test_lamb_step_with_an_update_of_rms_one() -> None:
    """Only a zero rms takes ratio 1: an update of rms exactly 1 gets q = rms(p)/1. mom=0.5, sqr_mom=0.75, step 1
    (debias1 = 0.5, debias2 = 0.25, exact in binary), eps=0: u = (0.5/0.5, -0.5/0.5) / sqrt(0.25/0.25) = (1, -1)."""
    p = P((3.0, 4.0), (1.0, 1.0))
    lamb_step(p, lr=0.01, mom=0.5, sqr_mom=0.75, eps=0., step=1, grad_avg=T(0.5, -0.5), sqr_avg=T(0.25, 0.25))
    q = math.sqrt((3.0 ** 2 + 4.0 ** 2) / 2)  # rms(p) / rms(u) = sqrt(12.5) / 1 ~ 3.54
    close(p, 3.0 - 0.01 * q * 1.0, 4.0 - 0.01 * q * -1.0)


def test_lamb_step_with_a_zero_update() -> None:
    "A zero update (rms 0) takes ratio 1, not |p|/0: the param does not move and no NaN appears."
    p = P((3.0, 4.0), (1.0, 1.0))
    lamb_step(p, **LAMB, step=1, grad_avg=T(0.0, 0.0), sqr_avg=T(0.04, 0.16))
    close(p, 3.0, 4.0)


# -- lookahead -------------------------------------------------------------------------------------------------------
def test_lookahead_keep() -> None:
    "The first call keeps a copy of the weights as `slow_p`; later calls keep what they have."
    p = P((1.0, 2.0), (0.5, 0.5))
    st = lookahead_keep(p)
    assert set(st) == {'slow_p'}
    close(st['slow_p'], 1.0, 2.0)
    p.data.add_(1)
    close(st['slow_p'], 1.0, 2.0)  # a copy
    assert lookahead_keep(p, slow_p=st['slow_p']) is None


def test_lookahead_step() -> None:
    "Every k-th step: slow += alpha*(p - slow), and p restarts from slow; other steps only count."
    p, slow = P((3.0,), (0.5,)), T(1.0)
    assert lookahead_step(p, k=3, alpha=0.25, la_step=0, slow_p=slow) == {'la_step': 1}  # 1 % 3: not a boundary
    close(p, 3.0)
    close(slow, 1.0)
    assert lookahead_step(p, k=3, alpha=0.25, la_step=2, slow_p=slow) == {'la_step': 3}  # 3 % 3 == 0
    close(slow, 1.0 + 0.25 * (3.0 - 1.0))  # 1.5
    close(p, 1.5)
    assert lookahead_step(p, k=3, alpha=0.25, slow_p=slow) == {'la_step': 1}  # la_step starts at 0


# -- the foreach contract: a bucket of params gives what each param gives ----------------------------------------------
# (callback, state, hypers); state values: 'g' a normal tensor like the param, 'v' a positive one (a second moment),
# 'lr' a positive 0-d tensor (a layer-wise lr); numbers as they are (Python state, one value for the bucket).
BUCKET_CASES = {
    'weight_decay': (weight_decay, {}, dict(lr=0.1, wd=0.5)),
    'weight_decay do_wd=False': (weight_decay, {}, dict(lr=0.1, wd=0.5, do_wd=False)),
    'l2_reg': (l2_reg, {}, dict(lr=0.1, wd=0.5)),
    'average_grad first': (average_grad, {}, dict(mom=0.9)),
    'average_grad': (average_grad, {'grad_avg': 'g'}, dict(mom=0.9)),
    'average_grad dampening': (average_grad, {'grad_avg': 'g'}, dict(mom=0.9, dampening=True)),
    'dampened_grad_avg first': (dampened_grad_avg, {}, dict(mom=0.9, dampening=0.25)),
    'dampened_grad_avg': (dampened_grad_avg, {'grad_avg': 'g'}, dict(mom=0.9, dampening=0.25)),
    'average_sqr_grad first': (average_sqr_grad, {}, dict(sqr_mom=0.99)),
    'average_sqr_grad': (average_sqr_grad, {'sqr_avg': 'v'}, dict(sqr_mom=0.99)),
    'sgd_step': (sgd_step, {}, dict(lr=0.1)),
    'momentum_step': (momentum_step, {'grad_avg': 'g'}, dict(lr=0.1)),
    'nesterov_step': (nesterov_step, {'grad_avg': 'g'}, dict(lr=0.1, mom=0.9)),
    'rms_prop_step': (rms_prop_step, {'sqr_avg': 'v'}, dict(lr=0.1, eps=1e-8)),
    'rms_prop_step grad_avg': (rms_prop_step, {'sqr_avg': 'v', 'grad_avg': 'g'}, dict(lr=0.1, eps=1e-8)),
    'step_stat': (step_stat, {'step': 3}, {}),
    'adam_step': (adam_step, {'grad_avg': 'g', 'sqr_avg': 'v', 'step': 2}, dict(**ADAM, eps=1e-5)),
    'radam_step r<=5': (radam_step, {'grad_avg': 'g', 'sqr_avg': 'v', 'step': 1}, dict(**ADAM, eps=1e-5, beta=0.)),
    'radam_step': (radam_step, {'grad_avg': 'g', 'sqr_avg': 'v', 'step': 10}, dict(**ADAM, eps=1e-5, beta=0.)),
    'radam_step beta': (radam_step, {'grad_avg': 'g', 'sqr_avg': 'v', 'step': 10}, dict(**ADAM, eps=1e-5, beta=10.)),
    'qhadam_step': (qhadam_step, {'grad_avg': 'g', 'sqr_avg': 'v', 'step': 2},
                    dict(**ADAM, nu_1=0.7, nu_2=0.8, eps=1e-8)),
    'larc_layer_lr': (larc_layer_lr, {}, dict(lr=0.1, trust_coeff=1., wd=0.1, eps=1e-8)),
    'larc_layer_lr lars': (larc_layer_lr, {}, dict(lr=0.1, trust_coeff=1., wd=0.1, eps=1e-8, clip=False)),
    'larc_step': (larc_step, {'local_lr': 'lr'}, {}),
    'larc_step grad_avg': (larc_step, {'local_lr': 'lr', 'grad_avg': 'g'}, {}),
    'lamb_step': (lamb_step, {'grad_avg': 'g', 'sqr_avg': 'v', 'step': 2}, LAMB),
    'lookahead_keep first': (lookahead_keep, {}, {}),
    'lookahead_keep': (lookahead_keep, {'slow_p': 'g'}, {}),
    'lookahead_step': (lookahead_step, {'slow_p': 'g', 'la_step': 1}, dict(k=3, alpha=0.25)),
    'lookahead_step k': (lookahead_step, {'slow_p': 'g', 'la_step': 2}, dict(k=3, alpha=0.25)),
}


def bucket_params(name: str) -> tuple:
    "Two float32 params of different shapes with grads and state; for LAMB one param is zero (its ratio is 1)."
    cb, spec, hyper = BUCKET_CASES[name]
    g = torch.Generator().manual_seed(0)
    params, states = [], []
    for shape in [(3,), (2, 2)]:
        p = torch.randn(shape, generator=g)
        if name == 'lamb_step' and shape == (3,): p.zero_()
        p.grad = torch.randn(shape, generator=g)
        make = {'g': lambda: torch.randn(shape, generator=g), 'v': lambda: torch.rand(shape, generator=g) + 0.1,
                'lr': lambda: torch.rand((), generator=g) + 0.1}
        states.append({k: make[v]() if isinstance(v, str) else v for k, v in spec.items()})
        params.append(p)
    return cb, params, states, hyper


def copy(p: torch.Tensor, st: dict) -> tuple:
    q = p.clone()
    q.grad = p.grad.clone()
    return q, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}


@pytest.mark.parametrize('name, tensor_lr', [(n, False) for n in BUCKET_CASES]
                         + [(n, True) for n, (_, _, hyper) in BUCKET_CASES.items() if 'lr' in hyper])
def test_a_bucket_gives_what_each_param_gives(name: str, tensor_lr: bool) -> None:
    """The callback on a TensorList of two params (the foreach backend's stand-in: `p.grad` and tensor state as
    TensorLists) changes the params, grads and state, and returns the state, exactly as it does param by param;
    also with the lr a 0-d tensor (a tensor hyper), which reaches torch as `alpha=`/`value=` tensors."""
    cb, params, states, hyper = bucket_params(name)
    if tensor_lr: hyper = {**hyper, 'lr': torch.tensor(hyper['lr'])}
    ref = []
    for p, st in zip(params, states):
        q, s = copy(p, st)
        ref.append((q, s, cb(q, **{**s, **hyper})))
    copies = [copy(p, st) for p, st in zip(params, states)]
    tl = TensorList([q for q, _ in copies])
    tl.grad = TensorList([q.grad for q, _ in copies])
    state = {k: TensorList([s[k] for _, s in copies]) if isinstance(v, torch.Tensor) else v
             for k, v in states[0].items()}
    out = cb(tl, **{**state, **hyper})
    exact = dict(rtol=0, atol=0)
    for i, (q, s, r) in enumerate(ref):
        torch.testing.assert_close(tl[i], q, **exact)
        torch.testing.assert_close(tl.grad[i], q.grad, **exact)
        for k, v in s.items():
            if isinstance(v, torch.Tensor): torch.testing.assert_close(state[k][i], v, **exact)
        assert (out is None) == (r is None)
        if r is None: continue
        assert set(out) == set(r)
        for k, v in r.items():
            if isinstance(v, torch.Tensor):
                assert isinstance(out[k], TensorList)
                torch.testing.assert_close(out[k][i], v, **exact)
            else: assert out[k] == v
