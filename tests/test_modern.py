"""The modern optimizers (cbopt.modern_optimizers) against the packages their users install: lion-pytorch,
pytorch-optimizer, torch-optimi, schedulefree.

For every config: 40+ steps on a tiny MLP with real grads follow the reference class within a tolerance relative to
each tensor's own scale, in the `loop` and `foreach` backends, foreach bit for bit with loop and with no warning (no
param-by-param fallback). Each also trains a fastai Learner as its `opt_func` as the reference does through fastai's
`OptimWrapper`. (Backends, resume, weights_only checkpoints and check_callback: the registry cases in cases.py.)"""
import warnings
from functools import partial

import pytest
import torch

import cbopt
from conftest import assert_moved, assert_rel_close, assert_same_params, make_model, train

pytestmark = pytest.mark.usefixtures('one_thread')

STEPS = 50


def _lion(ps, **kw):
    from lion_pytorch import Lion
    return Lion(ps, **kw)


def _pytorch_optimizer(name, ps, **kw):
    import pytorch_optimizer
    return getattr(pytorch_optimizer, name)(ps, **kw)


def _optimi(name, ps, lr=1e-3, **kw):
    import optimi
    return getattr(optimi, name)(ps, lr=lr, **kw)


# id: (cbopt builder, reference builder, rtol), the same algorithm and hypers; non-default hypers far from the defaults
CASES = {
    'lion':    (cbopt.Lion, _lion, 1e-6),
    'lion-wd': (partial(cbopt.Lion, lr=3e-3, mom=0.8, sqr_mom=0.95, wd=0.5),
                partial(_lion, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.5), 1e-6),
    'adan':    (cbopt.Adan, partial(_pytorch_optimizer, 'Adan'), 1e-6),
    'adan-wd': (partial(cbopt.Adan, lr=1e-2, mom=0.9, diff_mom=0.8, sqr_mom=0.95, eps=1e-6, wd=0.3),
                partial(_pytorch_optimizer, 'Adan', lr=1e-2, betas=(0.9, 0.8, 0.95), eps=1e-6, weight_decay=0.3,
                        foreach=False), 1e-6),
    'adan-decoupled': (partial(cbopt.Adan, lr=1e-2, wd=0.3, decouple_wd=True),
                       partial(_pytorch_optimizer, 'Adan', lr=1e-2, weight_decay=0.3, weight_decouple=True), 1e-6),
    'ademamix': (cbopt.AdEMAMix, partial(_pytorch_optimizer, 'AdEMAMix'), 1e-6),
    'ademamix-warmup-l2': (partial(cbopt.AdEMAMix, lr=1e-2, mom=0.8, sqr_mom=0.95, slow_mom=0.99, slow_alpha=3.,
                                   t_alpha_beta3=30, wd=0.1),  # 30 < 50 steps: the warmup ends within the run
                           partial(_pytorch_optimizer, 'AdEMAMix', lr=1e-2, betas=(0.8, 0.95, 0.99), alpha=3.,
                                   t_alpha_beta3=30, weight_decay=0.1, foreach=False), 1e-6),
    'ademamix-decoupled': (partial(cbopt.AdEMAMix, lr=1e-2, wd=0.3, decouple_wd=True),
                           partial(_pytorch_optimizer, 'AdEMAMix', lr=1e-2, weight_decay=0.3, weight_decouple=True), 1e-6),
    'stableadamw': (cbopt.StableAdamW, partial(_optimi, 'StableAdamW'), 1e-6),
    'stableadamw-hypers': (partial(cbopt.StableAdamW, lr=3e-2, mom=0.8, sqr_mom=0.95, eps=1e-3, wd=0.3),  # clips 28 of 200
                           partial(_optimi, 'StableAdamW', lr=3e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3,
                                   foreach=False), 1e-6),
}


def cbopt_run(name: str, backend, steps: int = STEPS, dtype=torch.float32):
    "The cbopt twin of case `name` trained `steps` steps on a fresh `make_model`, warnings as errors."
    model = make_model(dtype=dtype)
    opt = CASES[name][0](model.named_parameters(), backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a foreach fallback or a compile failure warns
        train(opt, model, steps)
    return model, opt


def reference_run(name: str, steps: int = STEPS, dtype=torch.float32):
    "The reference class of case `name`, trained `steps` steps on a fresh `make_model`."
    model = make_model(dtype=dtype)
    train(CASES[name][1](model.parameters()), model, steps)
    return model


@pytest.mark.parametrize('name', CASES)
def test_loop_and_foreach_follow_the_reference(name):
    "loop within rtol of the reference, each tensor to its own scale; foreach bit-exact with loop and bucket-wise."
    ref = reference_run(name)
    assert_moved(ref, make_model())
    loop, _ = cbopt_run(name, 'loop')
    assert_rel_close(loop, ref, rtol=CASES[name][2], msg=f'{name} loop vs reference:')
    each, _ = cbopt_run(name, 'foreach')
    assert_same_params(each, loop, msg=f'{name} foreach vs loop:')


@pytest.mark.parametrize('name', ['lion', 'adan', 'ademamix', 'stableadamw'])
def test_fastai_opt_func(name):
    "As a fastai `opt_func`, it trains a Learner as the reference class does through fastai's `OptimWrapper`."
    Learner = pytest.importorskip('fastai.learner').Learner
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastai.optimizer import OptimWrapper
    from fastcore.basics import noop
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 6, generator=g), torch.randn(48, 3, generator=g)

    def fit(opt_func):
        dls = DataLoaders.from_dsets(TensorDataset(x[:32], y[:32]), TensorDataset(x[32:], y[32:]), bs=8, shuffle=False)
        learn = Learner(dls, make_model(), torch.nn.MSELoss(), opt_func=opt_func, wd=0., wd_bn_bias=True)
        learn.remove_cb(ProgressCallback)
        learn.logger = noop
        learn.fit(2, lr=1e-3)
        return learn

    ours, ref = fit(CASES[name][0]), fit(partial(OptimWrapper, opt=CASES[name][1]))
    assert isinstance(ours.opt, cbopt.Optimizer) and len(ours.recorder.losses) == 8
    assert_moved(ours.model, make_model())
    assert_rel_close(ours.model, ref.model, rtol=CASES[name][2])
