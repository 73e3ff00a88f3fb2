"""cbopt's functional form against optax (jax on CPU, float64): the same params and grads, 20 updates, the same
numbers to 1e-10 relative where the formulas agree; where cbopt follows torch and optax does not (the table in
docs/guides/functional.md), the difference is tested as one: gone when the documented cause is removed.

jax is imported once, by the module-scoped `ox` fixture (JAX_PLATFORMS=cpu, x64 on); nothing else here needs it.
"""
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import cbopt

pytestmark = pytest.mark.usefixtures('one_thread')
F64 = torch.float64
STEPS = 20
RTOL = 1e-10


@pytest.fixture(scope='module')
def ox():
    "jax, jax.numpy and optax, on CPU with float64 on (imported here only: jax's import is slow)."
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    jax = pytest.importorskip('jax')
    jax.config.update('jax_enable_x64', True)
    return SimpleNamespace(jax=jax, jnp=jax.numpy, optax=pytest.importorskip('optax'))


def start() -> dict:
    g = torch.Generator().manual_seed(0)
    return {'w': torch.randn(4, 3, generator=g, dtype=F64), 'b': torch.randn(3, generator=g, dtype=F64)}


def grads(steps: int = STEPS, scales=(1.,), bad=()) -> list[dict]:
    """`steps` grads of `start()`'s shapes, step i scaled by `scales[i % len]` (to clip some and not others), with a
    NaN (even steps in `bad`) or an inf (odd) at the steps in `bad`."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        s = scales[i % len(scales)]
        d = {'w': s * torch.randn(4, 3, generator=g, dtype=F64), 'b': s * torch.randn(3, generator=g, dtype=F64)}
        if i in bad: d['w'][1, 2] = float('nan') if i % 2 == 0 else float('inf')
        out.append(d)
    return out


def run_optax(ox, tx, gs: list[dict], lrs=None):
    "The params after optax's updates with the grads `gs`, and its state."
    to_j = lambda d: {k: ox.jnp.asarray(v.numpy()) for k, v in d.items()}
    params = to_j(start())
    state = tx.init(params)
    for g in gs:
        updates, state = tx.update(to_j(g), state, params)
        params = ox.optax.apply_updates(params, updates)
    return {k: torch.from_numpy(np.array(v)) for k, v in params.items()}, state


def run_cbopt(fopt, gs: list[dict], lrs=None):
    "The params after the functional updates with the grads `gs` (and the lr `lrs[i]` at step i), and the state."
    params = start()
    state = fopt.init(params)
    for i, g in enumerate(gs):
        params, state = fopt.update(params, g, state, **({} if lrs is None else {'lr': lrs[i]}))
    return params, state


def rel_err(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max(((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item() for k in theirs)


def assert_agree(ours: dict, theirs: dict) -> None:
    err = rel_err(ours, theirs)
    assert err <= RTOL, f"relative error {err:.3g} > {RTOL:g}"


ADAMW = dict(lr=1e-2, mom=0.9, sqr_mom=0.999, eps=1e-8, wd=0.01)


def optax_adamw(ox, **kw):
    return ox.optax.adamw(kw.pop('learning_rate', 1e-2), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, **kw)


# -- the optimizers ---------------------------------------------------------------------------------------------------
def test_adamw(ox):
    "cbopt.Adam with decoupled wd is optax.adamw (the bias corrections and eps outside the root alike)."
    assert_agree(run_cbopt(cbopt.functional(cbopt.Adam, **ADAMW), grads())[0],
                 run_optax(ox, optax_adamw(ox), grads())[0])


@pytest.mark.parametrize('nesterov', [False, True])
def test_sgd_momentum(ox, nesterov):
    "cbopt.SGD with momentum (and Nesterov's) is optax.sgd: the trace starts at zero, so its first step is the grad."
    ours = run_cbopt(cbopt.functional(cbopt.SGD, lr=0.05, mom=0.9, nesterov=nesterov), grads())[0]
    assert_agree(ours, run_optax(ox, ox.optax.sgd(0.05, momentum=0.9, nesterov=nesterov), grads())[0])


def test_lion(ox):
    assert_agree(run_cbopt(cbopt.functional(cbopt.Lion, lr=1e-3, mom=0.9, sqr_mom=0.99, wd=0.1), grads())[0],
                 run_optax(ox, ox.optax.lion(1e-3, b1=0.9, b2=0.99, weight_decay=0.1), grads())[0])


def test_adagrad_agrees_without_eps(ox):
    """cbopt.Adagrad (torch's) and optax.adagrad agree with eps 0 and the same initial accumulator; with each one's
    defaults they differ (the table: eps inside the root and 0.1 to start in optax, outside and 0 in torch)."""
    ours = run_cbopt(cbopt.functional(cbopt.Adagrad, lr=0.1, eps=0., initial_accumulator_value=0.1), grads())[0]
    assert_agree(ours, run_optax(ox, ox.optax.adagrad(0.1, initial_accumulator_value=0.1, eps=0.), grads())[0])
    defaults = run_cbopt(cbopt.functional(cbopt.Adagrad, lr=0.1), grads())[0]
    assert rel_err(defaults, run_optax(ox, ox.optax.adagrad(0.1), grads())[0]) > 1e-3


def test_rmsprop_agrees_with_eps_outside(ox):
    """cbopt.RMSProp is optax.rmsprop with `eps_in_sqrt=False` (torch's placement); optax's default puts eps inside
    the root: a difference. With momentum (and centered), torch's RMSprop (`cbopt.optim.RMSprop`, a class given to
    `functional`) is optax's: both average the divided updates, where fastai's (`cbopt.RMSProp`) averages the grads
    before dividing them by the current root: another difference."""
    ours = run_cbopt(cbopt.functional(cbopt.RMSProp, lr=1e-2, sqr_mom=0.9, eps=1e-3), grads())[0]
    assert_agree(ours, run_optax(ox, ox.optax.rmsprop(1e-2, decay=0.9, eps=1e-3, eps_in_sqrt=False), grads())[0])
    assert rel_err(ours, run_optax(ox, ox.optax.rmsprop(1e-2, decay=0.9, eps=1e-3), grads())[0]) > 1e-6
    for centered in (False, True):
        theirs = run_optax(ox, ox.optax.rmsprop(1e-2, decay=0.9, eps=1e-3, eps_in_sqrt=False, momentum=0.9,
                                                centered=centered), grads())[0]
        torchs = cbopt.functional(cbopt.optim.RMSprop, lr=1e-2, alpha=0.9, eps=1e-3, momentum=0.9, centered=centered)
        assert_agree(run_cbopt(torchs, grads())[0], theirs)
    fastais = run_cbopt(cbopt.functional(cbopt.RMSProp, lr=1e-2, sqr_mom=0.9, eps=1e-3, mom=0.9), grads())[0]
    assert rel_err(fastais, run_optax(ox, ox.optax.rmsprop(1e-2, decay=0.9, eps=1e-3, eps_in_sqrt=False, momentum=0.9),
                                      grads())[0]) > 1e-3


# -- the transforms -----------------------------------------------------------------------------------------------------
def test_chain_clip_by_global_norm_adamw(ox):
    """`[clip_by_global_norm, *adam_chain()]` is `optax.chain(clip_by_global_norm, adamw)`, on grads clipped at some
    steps and not at others. torch's `clip_grad_norm` adds 1e-6 to the norm: a difference of about 1e-6 relative."""
    gs = grads(scales=(0.1, 3.))
    theirs = run_optax(ox, ox.optax.chain(ox.optax.clip_by_global_norm(1.), optax_adamw(ox)), gs)[0]
    ours = run_cbopt(cbopt.functional([cbopt.clip_by_global_norm, *cbopt.adam_chain()], max_norm=1., **ADAMW), gs)[0]
    assert_agree(ours, theirs)
    torchs = run_cbopt(cbopt.functional([cbopt.clip_grad_norm, *cbopt.adam_chain()], max_norm=1., **ADAMW), gs)[0]
    assert 1e-9 < rel_err(torchs, theirs) < 1e-4


def test_apply_if_finite(ox):
    """`[skip_nonfinite, *adam_chain()]` is `optax.apply_if_finite(adamw)`: the steps with a NaN or an inf change
    nothing but the counts, which are optax's (`skipped_consecutive` its `notfinite_count`, `skipped_total` its
    `total_notfinite`)."""
    gs = grads(bad=(3, 4, 11, 19))
    ours, state = run_cbopt(cbopt.functional([cbopt.skip_nonfinite, *cbopt.adam_chain()], **ADAMW), gs)
    theirs, tstate = run_optax(ox, ox.optax.apply_if_finite(optax_adamw(ox), max_consecutive_errors=100), gs)
    assert_agree(ours, theirs)
    assert state['skip_nonfinite']['skipped_total'].item() == int(tstate.total_notfinite) == 4
    assert state['skip_nonfinite']['skipped_consecutive'].item() == int(tstate.notfinite_count) == 1


def test_multi_steps(ox):
    """`[accumulate_grads, *adam_chain()]` (every=3) is `optax.MultiSteps(adamw, 3)`: the mean of 3 grads, one inner
    step every 3 calls. (optax accumulates in float32 unless told otherwise: cbopt in the params' dtype.)"""
    gs = grads(steps=21)
    ours, state = run_cbopt(cbopt.functional([cbopt.accumulate_grads, *cbopt.adam_chain()], every=3, **ADAMW), gs)
    ms = ox.optax.MultiSteps(optax_adamw(ox), every_k_schedule=3, accumulator_dtype=ox.jnp.float64)
    theirs, tstate = run_optax(ox, ms.gradient_transformation(), gs)
    assert_agree(ours, theirs)
    assert state['w']['step'].item() == int(tstate.gradient_step) == 7
    f32 = ox.optax.MultiSteps(optax_adamw(ox), every_k_schedule=3).gradient_transformation()
    assert rel_err(ours, run_optax(ox, f32, gs)[0]) > RTOL


def test_partition(ox):
    "`cbopt.functional.partition` is `optax.partition`: AdamW on the matrix, SGD with momentum on the bias."
    labels = {'w': 'adamw', 'b': 'sgd'}
    ours = cbopt.functional.partition({'adamw': cbopt.functional(cbopt.Adam, **ADAMW),
                                       'sgd': cbopt.functional(cbopt.SGD, lr=0.05, mom=0.9)}, labels)
    theirs = ox.optax.partition({'adamw': optax_adamw(ox), 'sgd': ox.optax.sgd(0.05, momentum=0.9)}, labels)
    assert_agree(run_cbopt(ours, grads())[0], run_optax(ox, theirs, grads())[0])
    by_shape = cbopt.functional.partition(ours.transforms, lambda fqn, p: 'adamw' if p.ndim == 2 else 'sgd')
    assert_agree(run_cbopt(by_shape, grads())[0], run_optax(ox, theirs, grads())[0])


def test_schedule_through_inject_hyperparams(ox):
    """A schedule: optax's `inject_hyperparams(adamw)(learning_rate=schedule)` evaluates it at the count of updates
    before each (an int32 count: the schedule's value is a float32); cbopt's update takes that lr, and both states hold
    the lr of the last update."""
    schedule = ox.optax.exponential_decay(1e-2, transition_steps=1, decay_rate=0.9)
    tx = ox.optax.inject_hyperparams(ox.optax.adamw)(learning_rate=schedule, b1=0.9, b2=0.999, eps=1e-8,
                                                      weight_decay=0.01)
    theirs, tstate = run_optax(ox, tx, grads())
    lrs = [float(schedule(ox.jnp.asarray(i, dtype=ox.jnp.int32))) for i in range(STEPS)]
    ours, state = run_cbopt(cbopt.functional(cbopt.Adam, **ADAMW), grads(), lrs=lrs)
    assert_agree(ours, theirs)
    assert state['hypers']['lr'].item() == pytest.approx(float(tstate.hyperparams['learning_rate']), rel=1e-15)
