"""Every registry case with a fastai reference (`cases.WITH_FASTAI`) follows its fastai.optimizer counterpart step for
step: same init, same real gradients, params compared after every one of 100 steps, relative to each tensor's own
scale (`Case.fastai_parity`: 1e-6 in fp32, unless the case says why it needs an absolute floor). The same runs in
fp64 hold to 1e-12, which shows that the fp32 differences (cbopt's default backend uses torch's fused kernels) are
only rounding."""
import fastai.optimizer as fo
import pytest
import torch

import cbopt
from cases import WITH_FASTAI, Case, case
from conftest import assert_moved, assert_rel_close, make_model, train, two_groups

pytestmark = pytest.mark.usefixtures('one_thread')
STEPS = 100
# (dtype, lr): a slice lr is spread log-evenly over the two groups
RUNS = {'fp32-lr-slice': (torch.float32, slice(3e-3, 3e-2)), 'fp64-lr': (torch.float64, 3e-2)}


def run_both(make_ours, make_ref, each=None, dtype=torch.float32, rtol=1e-6, atol=0.) -> tuple:
    "Train a cbopt and a fastai optimizer, each `make(params)`, side by side, checking params after each step."
    ours, theirs = make_model(dtype=dtype), make_model(dtype=dtype)
    opt, ref = make_ours(two_groups(ours)), make_ref(two_groups(theirs))
    for i in range(STEPS):
        train(ref, theirs, 1, start=i)
        train(opt, ours, 1, start=i)
        assert_rel_close(ours, theirs, rtol=rtol, atol=atol, msg=f"step {i}:")
        if each is not None: each(i, opt, ref)  # e.g. set hypers for the next step, as a scheduler would
    assert_moved(ours, make_model(dtype=dtype))
    return ours, opt, ref


@pytest.mark.parametrize('run', RUNS)
@pytest.mark.parametrize('c', WITH_FASTAI, ids=str)
def test_follows_fastai(c: Case, run):
    "The default backend (auto: torch's kernel where one matches, else foreach or loop)."
    dtype, lr = RUNS[run]
    _, opt, ref = run_both(lambda ps: c.build(ps, lr), lambda ps: c.fastai(ps, lr), dtype=dtype,
                           **c.fastai_parity.of(dtype))
    assert [h['lr'] for h in opt.hypers] == pytest.approx([h['lr'] for h in ref.hypers])


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
@pytest.mark.parametrize('c', WITH_FASTAI, ids=str)
def test_follows_fastai_per_param_runners(c: Case, backend):
    """The per-param reference and the foreach backend do fastai's float ops (bar LARC's and LAMB's tensor-math
    rewrites of Python branches), so they hold 1e-6 of each tensor's own scale with no floor, whatever the case."""
    run_both(lambda ps: c.build(ps, 3e-2, backend), lambda ps: c.fastai(ps, 3e-2))


@pytest.mark.parametrize('c', [case(n) for n in ('sgd-mom', 'adam', 'ranger', 'larc')], ids=str)
def test_per_group_hypers(c: Case):
    "`slice(stop)` and lists give one value per group, as fastai's `set_hyper` does."
    per_group = dict(wd=[0., 0.3], mom=[0.5, 0.9])
    def build(make):
        def f(ps):
            opt = make(ps, slice(3e-2))  # [3e-3, 3e-2]
            opt.set_hypers(**per_group)
            return opt
        return f
    _, opt, _ = run_both(build(c.build), build(c.fastai), **c.fastai_parity.of(torch.float32))
    assert [h['wd'] for h in opt.hypers] == per_group['wd']


@pytest.mark.parametrize('c', [case(n) for n in ('sgd-mom', 'adam', 'qhadam', 'lamb', 'ranger')], ids=str)
def test_scheduled_hypers(c: Case):
    "lr and mom changed before every step (lr as a numpy array per group, as fastai's ParamScheduler sets it) are followed alike."
    import numpy as np
    def schedule(i, opt, ref):
        for o in (opt, ref):
            o.set_hyper('lr', np.array([3e-3, 3e-2]) * (1 + np.cos(np.pi * i / STEPS)) / 2 + 1e-4)
            o.set_hyper('mom', 0.85 + 0.1 * i / STEPS)
    run_both(lambda ps: c.build(ps, 3e-2), lambda ps: c.fastai(ps, 3e-2), each=schedule,
             **c.fastai_parity.of(torch.float32))


@pytest.mark.parametrize('mom', [0., 0.8])
def test_rmsprop_forwards_eps(mom):
    "fastai's RMSProp ignores its `eps`; cbopt's uses it, as fastai's own callbacks do when given `eps`."
    def theirs(ps):
        cbs = [fo.weight_decay, *([fo.average_grad] if mom else []), fo.average_sqr_grad, fo.rms_prop_step]
        return fo.Optimizer(ps, cbs, lr=3e-2, mom=mom, sqr_mom=0.9, eps=1e-2, wd=0.1)
    run_both(lambda ps: cbopt.RMSProp(ps, 3e-2, mom=mom, sqr_mom=0.9, eps=1e-2, wd=0.1), theirs)
