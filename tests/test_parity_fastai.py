"""cbopt's prebuilt optimizers follow their fastai.optimizer counterparts step for step (fp32, 1e-6 relative):
same init, same real gradients, params compared after every one of 100 steps. The same runs in fp64 hold to 1e-12,
which shows that the fp32 differences (cbopt's default backend uses foreach and fused kernels) are only rounding."""
import fastai.optimizer as fo
import pytest
import torch

import cbopt
from conftest import PREBUILT, assert_rel_close, make_model, train, two_groups

pytestmark = pytest.mark.usefixtures('one_thread')
STEPS = 100
# (dtype, lr, rtol): a slice lr is spread log-evenly over the two groups
RUNS = {'fp32-lr-slice': (torch.float32, slice(3e-3, 3e-2), 1e-6), 'fp64-lr': (torch.float64, 3e-2, 1e-12)}


def run_both(build, each=None, dtype=torch.float32, rtol=1e-6) -> tuple:
    "Train a fastai and a cbopt optimizer from `build(module, params)` side by side, checking params after each step."
    ours, theirs = make_model(dtype=dtype), make_model(dtype=dtype)
    opt, ref = build(cbopt, two_groups(ours)), build(fo, two_groups(theirs))
    for i in range(STEPS):
        train(ref, theirs, 1, start=i)
        train(opt, ours, 1, start=i)
        assert_rel_close(ours, theirs, rtol=rtol, msg=f"step {i}:")
        if each is not None: each(i, opt, ref)  # e.g. set hypers for the next step, as a scheduler would
    return ours, opt, ref


def assert_moved(model, rtol: float = 1e-2) -> None:
    "The optimizer really moved every param (a parity test on params that barely move would prove nothing)."
    for (n, p), p0 in zip(model.named_parameters(), make_model(dtype=model[0].weight.dtype).parameters()):
        assert (p - p0).abs().max() > rtol * p0.abs().max(), f"param {n} barely moved"


@pytest.mark.parametrize('run', RUNS)
@pytest.mark.parametrize('name', PREBUILT)
def test_follows_fastai(name, run):
    dtype, lr, rtol = RUNS[run]
    model, opt, ref = run_both(lambda m, ps: PREBUILT[name](m, ps, lr), dtype=dtype, rtol=rtol)
    assert [h['lr'] for h in opt.hypers] == pytest.approx([h['lr'] for h in ref.hypers])
    assert_moved(model)


@pytest.mark.parametrize('backend', ['loop', 'foreach'])
@pytest.mark.parametrize('name', PREBUILT)
def test_follows_fastai_per_tensor(name, backend):
    """The per-param reference and the foreach backend do fastai's float ops (bar LARC's and LAMB's tensor-math
    rewrites of Python branches), so they hold 1e-6 relative to each tensor's own scale, not just the model's."""
    ours, theirs = make_model(), make_model()
    opt, ref = PREBUILT[name](cbopt, two_groups(ours), 3e-2), PREBUILT[name](fo, two_groups(theirs), 3e-2)
    opt.backend = backend
    for i in range(STEPS):
        train(ref, theirs, 1, start=i)
        train(opt, ours, 1, start=i)
        assert_rel_close(ours, theirs, rtol=1e-6, msg=f"step {i}:", per_tensor=True)
    assert_moved(ours)


@pytest.mark.parametrize('name', ['sgd-mom', 'adam', 'ranger', 'larc'])
def test_per_group_hypers(name):
    "`slice(stop)` and lists give one value per group, as fastai's `set_hyper` does."
    per_group = dict(wd=[0., 0.3], mom=[0.5, 0.9])
    def build(m, ps):
        opt = PREBUILT[name](m, ps, slice(3e-2))  # [3e-3, 3e-2]
        opt.set_hypers(**per_group)
        return opt
    _, opt, _ = run_both(build)
    assert [h['wd'] for h in opt.hypers] == per_group['wd']


@pytest.mark.parametrize('name', ['sgd-mom', 'adam', 'qhadam', 'lamb', 'ranger'])
def test_scheduled_hypers(name):
    "lr and mom changed before every step (lr as a numpy array per group, as fastai's ParamScheduler sets it) are followed alike."
    import numpy as np
    def schedule(i, opt, ref):
        for o in (opt, ref):
            o.set_hyper('lr', np.array([3e-3, 3e-2]) * (1 + np.cos(np.pi * i / STEPS)) / 2 + 1e-4)
            o.set_hyper('mom', 0.85 + 0.1 * i / STEPS)
    model, _, _ = run_both(lambda m, ps: PREBUILT[name](m, ps, 3e-2), each=schedule)
    assert_moved(model)


@pytest.mark.parametrize('mom', [0., 0.8])
def test_rmsprop_forwards_eps(mom):
    "fastai's RMSProp ignores its `eps`; cbopt's uses it, as fastai's own callbacks do when given `eps`."
    def build(m, ps):
        if m is cbopt: return cbopt.RMSProp(ps, 3e-2, mom=mom, sqr_mom=0.9, eps=1e-2, wd=0.1)
        cbs = [fo.weight_decay, *([fo.average_grad] if mom else []), fo.average_sqr_grad, fo.rms_prop_step]
        return fo.Optimizer(ps, cbs, lr=3e-2, mom=mom, sqr_mom=0.9, eps=1e-2, wd=0.1)
    model, _, _ = run_both(build)
    assert_moved(model)
