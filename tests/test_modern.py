"""The modern optimizers (cbopt.modern_optimizers) against the packages their users install: lion-pytorch,
pytorch-optimizer, torch-optimi, schedulefree.

For every config: 40+ steps on a tiny MLP with real grads follow the reference class within a tolerance relative to
each tensor's own scale, in the `loop` and `foreach` backends, foreach bit for bit with loop and with no warning (no
param-by-param fallback). Each also trains a fastai Learner as its `opt_func` as the reference does through fastai's
`OptimWrapper`. (Backends, resume, weights_only checkpoints and check_callback: the registry cases in cases.py.)"""
import copy
import warnings
from functools import partial

import pytest
import torch

import cbopt
from cases import MODERN_CONFIGS
from conftest import assert_moved, assert_rel_close, assert_same_params, make_model, train

pytestmark = pytest.mark.usefixtures('one_thread')

STEPS = 50


def cbopt_run(name: str, backend, steps: int = STEPS, dtype=torch.float32):
    "The cbopt twin of case `name` trained `steps` steps on a fresh `make_model`, warnings as errors."
    model = make_model(dtype=dtype)
    opt = MODERN_CONFIGS[name][0](model.named_parameters(), backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a foreach fallback or a compile failure warns
        train(opt, model, steps)
    return model, opt


def reference_run(name: str, steps: int = STEPS, dtype=torch.float32, with_opt: bool = False):
    "The reference class of case `name`, trained `steps` steps on a fresh `make_model`."
    model = make_model(dtype=dtype)
    opt = MODERN_CONFIGS[name][1](model.parameters())
    train(opt, model, steps)
    return (model, opt) if with_opt else model


@pytest.mark.parametrize('name', MODERN_CONFIGS)
def test_loop_and_foreach_follow_the_reference(name):
    "loop within rtol of the reference, each tensor to its own scale; foreach bit-exact with loop and bucket-wise."
    ref = reference_run(name)
    assert_moved(ref, make_model())
    loop, _ = cbopt_run(name, 'loop')
    assert_rel_close(loop, ref, rtol=MODERN_CONFIGS[name][2], msg=f'{name} loop vs reference:')
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

    ours, ref = fit(MODERN_CONFIGS[name][0]), fit(partial(OptimWrapper, opt=MODERN_CONFIGS[name][1]))
    assert isinstance(ours.opt, cbopt.Optimizer) and len(ours.recorder.losses) == 8
    assert_moved(ours.model, make_model())
    assert_rel_close(ours.model, ref.model, rtol=MODERN_CONFIGS[name][2])


@pytest.mark.parametrize('name', ['sf-sgd-hypers', 'sf-adamw-hypers'])
@pytest.mark.parametrize('backend', ['loop', 'foreach'])
def test_schedule_free_modes_swap_as_schedulefree(name, backend):
    """`opt.eval()` puts the averaged weights in the params and `opt.train()` puts the training point back, bit for bit
    as schedulefree's; a step in eval mode is refused before anything changes; the mode is saved and loaded."""
    ref, ref_opt = reference_run(name, steps=20, with_opt=True)
    model, opt = cbopt_run(name, backend, steps=20)
    y = [p.detach().clone() for p in model.parameters()]
    opt.eval(), ref_opt.eval()
    assert_same_params(model, ref, msg='eval:')
    assert all((p - q).abs().max() > 1e-3 * q.abs().max() for p, q in zip(model.parameters(), y))  # x is not y
    x = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r'eval mode .* call opt.train\(\) before opt.step\(\)'): train(opt, model, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), x))
    assert opt.state_dict()['param_groups'][0]['train_mode'] is False
    opt.eval()  # already there: nothing moves
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), x))
    opt.train(), ref_opt.train()
    assert_same_params(model, ref, msg='train:')
    train(opt, model, 10, start=20), train(ref_opt, ref, 10, start=20)
    assert_same_params(model, ref, msg='after:')


def test_schedule_free_validates_on_the_average_in_a_fastai_learner():
    """A Learner with `opt_func=cbopt.ScheduleFreeAdamW` validates on the averaged weights (cbopt's fastai integration
    calls opt.eval() before validation and opt.train() before training): its validation losses are those of
    schedulefree's AdamWScheduleFree driven by hand in the same loop, and not those of the training point."""
    Learner = pytest.importorskip('fastai.learner').Learner
    from fastai.callback.progress import ProgressCallback
    from fastai.data.core import DataLoaders
    from fastcore.basics import noop
    from torch.utils.data import TensorDataset
    from cbopt.integrations.fastai import OptimizerModes
    import schedulefree
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g)
    loss_fn, epochs, lr = torch.nn.MSELoss(), 3, 1e-2
    dls = DataLoaders.from_dsets(TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), bs=8, shuffle=False)
    learn = Learner(dls, make_model(), loss_fn, opt_func=partial(cbopt.ScheduleFreeAdamW, warmup_steps=5))
    learn.remove_cb(ProgressCallback)
    learn.logger = noop
    learn.fit(epochs, lr=lr)
    assert sum(isinstance(cb, OptimizerModes) for cb in learn.cbs) == 1
    ours = [v[1] for v in learn.recorder.values]  # valid_loss per epoch

    model = make_model()
    opt = schedulefree.AdamWScheduleFree(model.parameters(), lr=lr, warmup_steps=5)
    theirs, at_y = [], []
    val = lambda: torch.stack([loss_fn(model(xb), yb) for xb, yb in zip(x[48:].split(8), y[48:].split(8))]).mean().item()
    for _ in range(epochs):
        opt.train()
        for xb, yb in zip(x[:48].split(8), y[:48].split(8)):
            loss_fn(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad(): at_y.append(val())
        opt.eval()
        with torch.no_grad(): theirs.append(val())
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert all(abs(a - b) > 1e-4 * b for a, b in zip(ours, at_y))  # the training point's losses differ: eval() matters
    assert_rel_close(learn.model, model, rtol=1e-5)  # after fit: the averaged weights, as after opt.eval()


@pytest.mark.parametrize('name', ['sf-sgd-hypers', 'sf-adamw-hypers'])
def test_schedule_free_compiles_without_recompiles(name):
    """The fused backend compiles schedule-free's chain once per shape and never recompiles (the weight sums are 0-d
    tensors in state, the warmup has no branch), through warmup and after: no fallback warning, and the same numbers
    as the loop (within float-op reordering: 1e-6 of each tensor's scale)."""
    from torch._dynamo.utils import counters
    backend = cbopt.Backend('fused', compiler='aot_eager')
    # from a fresh dynamo: a graph of the same chain compiled by an earlier test in this process (under another
    # torch.set_num_threads, a guard of dynamo's global state) would count as this test's recompile
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        fused, opt = cbopt_run(name, backend, steps=15)  # (warnings are errors: a compile failure warns)
    assert counters['stats']['unique_graphs'] >= 1 and not counters['recompiles']
    loop, _ = cbopt_run(name, 'loop', steps=15)
    assert_rel_close(fused, loop, rtol=1e-6)
    st = opt.state[next(fused.parameters())]
    assert st['weight_sum'].ndim == 0 and st['weight_sum'].dtype == torch.float64 and st['lr_max'].dtype == torch.float64


def test_schedule_free_loads_checkpoints_with_number_sums():
    "A checkpoint from when the weight sums were Python numbers loads (as 0-d tensors) and goes on bit for bit."
    model, opt = cbopt_run('sf-adamw-hypers', 'loop', steps=10)
    ref, ref_opt = copy.deepcopy(model), None
    sd = opt.state_dict()
    for st in sd['state'].values(): st['weight_sum'], st['lr_max'] = st['weight_sum'].item(), st['lr_max'].item()
    ref_opt = MODERN_CONFIGS['sf-adamw-hypers'][0](ref.named_parameters(), backend='loop')
    ref_opt.load_state_dict(sd)
    assert torch.is_tensor(ref_opt.state[next(ref.parameters())]['weight_sum'])
    train(opt, model, 5, start=10), train(ref_opt, ref, 5, start=10)
    assert_same_params(ref, model)
