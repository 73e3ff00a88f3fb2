"""cbopt as a drop-in `opt_func` for fastai's Learner.

Every prebuilt optimizer trains through fit, fit_one_cycle, fine_tune, freezing with a splitter, discriminative lrs,
lr_find, save/load (weights_only), export and mixed precision; and it follows fastai's own optimizer of the same name
loss for loss, with the same data, model and callbacks. The model has a BatchNorm and three param groups, so the
Learner's `do_wd` / `force_train` flags and freezing all come into play."""
import copy
import subprocess
import sys
from functools import partial

import fastai.callback.hook  # noqa: F401  (patches Learner.summary)
import fastai.callback.schedule  # noqa: F401  (patches fit_one_cycle, fine_tune, lr_find)
import fastai.optimizer as fo
import numpy as np
import pytest
import torch
from fastai.callback.core import Callback
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.progress import ProgressCallback
from fastai.callback.tracker import ReduceLROnPlateau
from fastai.callback.training import GradientAccumulation
from fastai.data.core import DataLoaders
from fastai.learner import Learner, load_learner
from fastai.torch_core import norm_bias_params, params, set_seed, trainable_params
from fastcore.basics import even_mults, noop
from fastcore.foundation import L
from torch import nn
from torch.amp import GradScaler, autocast
from torch.utils.data import TensorDataset

import cbopt
from cbopt.core.flags import FLAGS
from conftest import assert_same_params

pytestmark = pytest.mark.usefixtures('one_thread')
NAMES = ['SGD', 'RMSProp', 'Adam', 'RAdam', 'QHAdam', 'Larc', 'Lamb', 'ranger']  # every prebuilt opt_func
COUNTS_STEPS = {'Adam', 'RAdam', 'QHAdam', 'Lamb', 'ranger'}  # the ones with `step_stat`: their bias corrections need it
TOL = 1e-5


class TensorDS(TensorDataset):
    "A TensorDataset that `Learner.export` can empty (it calls `dataset.new_empty()`)."
    def new_empty(self): return type(self)(*(t[:0] for t in self.tensors))


# -- a tiny problem: 48 train / 16 valid samples, an MLP with a BatchNorm, three param groups ----------------------
def make_dls(bs: int = 16) -> DataLoaders:
    "A noisy linear target; the same batches in the same order every time (fastai seeds its shuffling from `random`)."
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(64, 1, generator=g)
    set_seed(0)
    return DataLoaders.from_dsets(TensorDS(x[:48], y[:48]), TensorDS(x[48:], y[48:]), bs=bs, num_workers=0)


def learner_model() -> nn.Module:
    "No bias before the BatchNorm (it would only get rounding noise as a grad, which Adam-like steps blow up)."
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(),
                             nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def splitter(m: nn.Module) -> list:
    "Three groups: body (with the BatchNorm), middle, head."
    return [params(m[0]) + params(m[1]), params(m[3]), params(m[5])]


def group_names(model: nn.Module) -> list[list[str]]:
    "The FQNs of `splitter`'s groups."
    ids = [[id(p) for p in g] for g in splitter(model)]
    return [[n for n, p in model.named_parameters() if id(p) in g] for g in ids]


def make_learner(opt_func=cbopt.Adam, path='.', bs: int = 16, split=splitter, **kwargs) -> Learner:
    "A Learner on the tiny problem; `split=trainable_params` is fastai's default splitter (one group)."
    learn = Learner(make_dls(bs), learner_model(), nn.MSELoss(), opt_func=opt_func, splitter=split, path=path, **kwargs)
    learn.remove_cb(ProgressCallback)
    learn.logger = noop
    return learn


def assert_same_training(ours: Learner, ref: Learner, tol: float = TOL, hps: bool = True) -> None:
    "Same recorded batch losses, epoch values, scheduled hypers (`hps`) and final params as `ref` (e.g. fastai's)."
    assert len(ours.recorder.losses) == len(ref.recorder.losses) > 0
    np.testing.assert_allclose(np.array(ours.recorder.losses), np.array(ref.recorder.losses), atol=tol, rtol=0)
    np.testing.assert_allclose(np.array(ours.recorder.values, dtype=float), np.array(ref.recorder.values, dtype=float),
                               atol=tol, rtol=0)
    for k, v in (vars(ref.recorder).get('hps', {}) if hps else {}).items():  # only a ParamScheduler sets it
        np.testing.assert_allclose(ours.recorder.hps[k], np.array(v, dtype=float), rtol=1e-12)
    for (n, p), q in zip(ours.model.named_parameters(), ref.model.parameters()):
        err = (p - q).abs().max().item()
        assert err <= tol, f"param {n} differs from fastai's by {err:.3g}"


def assert_trained(learn: Learner, but_zeros: bool = False) -> None:
    "Training really changed every param (parity on params that never move would prove nothing), `but_zeros` aside."
    for (n, p), p0 in zip(learn.model.named_parameters(), learner_model().parameters()):
        if but_zeros and not p0.any(): continue
        assert not torch.equal(p, p0), f"param {n} never moved"


def opt_states(learn: Learner) -> dict:
    "A deep copy of the optimizer state, keyed by FQN."
    return {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in learn.opt.state[p].items()}
            for n, p in learn.opt.named_params().items()}


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].keys() == b[n].keys(), n
        for k in a[n]:
            if isinstance(a[n][k], torch.Tensor): assert torch.equal(a[n][k], b[n][k]), (n, k)
            else: assert a[n][k] == b[n][k], (n, k)


def opt_warnings(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if 'optimizer state' in str(w.message)]


# -- no fastai import ----------------------------------------------------------------------------------------------
def test_import_does_not_import_fastai():
    "fastai support is duck-typed in the core: `import cbopt`, building, stepping and loading never import fastai."
    code = ("import sys, torch, cbopt; p = torch.nn.Parameter(torch.ones(3)); opt = cbopt.Adam([p]); "
            "p.grad = torch.ones(3); opt.step(); opt.load_state_dict(opt.state_dict()); "
            "bad = sorted(m for m in sys.modules if m == 'fastai' or m.startswith('fastai.')); "
            "assert not bad, bad")
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# -- parity with fastai's own optimizers ---------------------------------------------------------------------------
def freeze_then_unfreeze(learn: Learner) -> Learner:
    learn.freeze()
    learn.fit_one_cycle(1, 1e-2)
    learn.unfreeze()
    learn.fit_one_cycle(2, slice(1e-3, 1e-2))
    return learn


@pytest.mark.parametrize('name', NAMES)
def test_follows_fastai_through_freeze_and_one_cycle(name, tmp_path):
    "fit_one_cycle (lr and mom set every batch, as numpy values) on a frozen, then an unfrozen model, with wd."
    ours = freeze_then_unfreeze(make_learner(getattr(cbopt, name), tmp_path, wd=0.1))
    ref = freeze_then_unfreeze(make_learner(getattr(fo, name), tmp_path, wd=0.1))
    assert isinstance(ours.opt, cbopt.Optimizer)
    assert_same_training(ours, ref)
    assert_trained(ours, but_zeros=name == 'Larc')  # LARC's lr is proportional to |p|: a zero BN bias stays zero
    assert ours.opt.frozen_idx == ref.opt.frozen_idx == 0


@pytest.mark.parametrize('name', ['Adam', 'ranger'])
def test_follows_fastai_through_fine_tune(name, tmp_path):
    ours, ref = (make_learner(getattr(m, name), tmp_path) for m in (cbopt, fo))
    for learn in (ours, ref): learn.fine_tune(1, base_lr=1e-2)
    assert_same_training(ours, ref)


def test_hypers_are_numbers_for_recorder_and_schedulers(tmp_path):
    "ParamScheduler records `opt.hypers[-1]`, Recorder reads the lr, loggers log every hyper: all plain numbers."
    ours, ref = make_learner(cbopt.Adam, tmp_path), make_learner(fo.Adam, tmp_path)
    for learn in (ours, ref): learn.fit_one_cycle(1, slice(1e-3, 1e-2))
    assert_same_training(ours, ref)
    assert set(ours.recorder.hps) == {'lr', 'mom'}
    for v in ours.recorder.hps['lr'] + ours.recorder.hps['mom'] + list(ours.recorder.lrs):
        assert type(v) is float
    for h in ours.opt.hypers:
        for k, v in h.items(): assert isinstance(v, (int, float)), (k, type(v))
    lrs, ref_lrs = [h['lr'] for h in ours.opt.hypers], [h['lr'] for h in ref.opt.hypers]
    np.testing.assert_allclose(lrs, np.array(ref_lrs, dtype=float), rtol=1e-12)


def test_reduce_lr_on_plateau_writes_live_hypers(tmp_path):
    "ReduceLROnPlateau divides `h['lr']` in place in every `opt.hypers` dict: the groups must see it."
    cb = lambda: ReduceLROnPlateau(patience=0, min_delta=100.)  # never 'improves' after epoch 0: lr / 10 each epoch
    ours, ref = make_learner(cbopt.SGD, tmp_path), make_learner(fo.SGD, tmp_path)
    for learn in (ours, ref): learn.fit(3, slice(1e-3, 1e-1), cbs=cb())
    assert_same_training(ours, ref)
    lrs = [g['lr'] for g in ours.opt.param_groups]
    np.testing.assert_allclose(lrs, [h['lr'] for h in ref.opt.hypers], rtol=1e-12)
    np.testing.assert_allclose(lrs, np.array(even_mults(1e-3, 1e-1, 3)) / 100, rtol=1e-12)  # epoch 0 is a new best


def test_discriminative_lr_and_freeze_to(tmp_path):
    "`lr=slice(a, b)` spreads log-evenly over the splitter's groups; freeze_to(n) trains only groups n+ (and the BN)."
    learn = make_learner(cbopt.Adam, tmp_path)
    learn.freeze_to(1)
    assert learn.opt.frozen_idx == 1
    summary = learn.summary()  # reads opt.frozen_idx and each param's requires_grad
    assert 'Model frozen up to parameter group #1' in summary
    assert 'Total trainable params: 321' in summary  # BN 16+16, Linear 16x16+16, Linear 16+1; not the 8x16 weight
    before = {n: p.detach().clone() for n, p in learn.model.named_parameters()}
    learn.fit(1, slice(1e-4, 1e-2))
    np.testing.assert_allclose([h['lr'] for h in learn.opt.hypers], even_mults(1e-4, 1e-2, 3), rtol=1e-12)
    after = dict(learn.model.named_parameters())
    assert torch.equal(after['0.weight'], before['0.weight'])  # frozen
    for n in ['1.weight', '1.bias', '3.weight', '5.weight']:  # the BN trains too: force_train
        assert not torch.equal(after[n], before[n]), n
    assert 'step' not in learn.opt.state[after['0.weight']]
    learn.unfreeze()
    assert learn.opt.frozen_idx == 0 and all(p.requires_grad for p in learn.model.parameters())
    assert all(set(learn.opt.state[p]) <= set(FLAGS) for p in learn.model.parameters())  # freeze_to clears state
    summary = learn.summary()
    assert 'Model unfrozen' in summary and 'Total trainable params: 449' in summary


def test_frozen_after_training_stays_put(tmp_path):
    """Freezing after training: cbopt's zero_grad (torch's) sets grads to None, so frozen params are skipped, weight
    decay included. (fastai's own zero_grad keeps zero grads, so its optimizers go on decaying frozen params.)"""
    learn = make_learner(cbopt.Adam, tmp_path, wd=0.1)
    learn.fit(1, 1e-2)
    before = {n: p.detach().clone() for n, p in learn.model.named_parameters()}
    learn.freeze()
    learn.fit(1, 1e-2)
    for n, p in learn.model.named_parameters():
        assert torch.equal(p, before[n]) == n.startswith(('0.', '3.')), n  # groups 0-1 frozen, but the BN trains


def test_norm_and_bias_flags_are_set_and_honoured(tmp_path):
    "wd_bn_bias=False puts do_wd=False, train_bn=True puts force_train=True in opt.state[p]; the step follows them."
    results = {}
    for wd_bn_bias in (False, True):
        for train_bn in (True, False):
            kw = dict(wd=0.5, wd_bn_bias=wd_bn_bias, train_bn=train_bn)
            ours, ref = make_learner(cbopt.SGD, tmp_path, **kw), make_learner(fo.SGD, tmp_path, **kw)
            ours.create_opt()
            for p in norm_bias_params(ours.model, True):
                assert ours.opt.state[p].get('do_wd', True) is wd_bn_bias
            bn = list(ours.model[1].parameters())
            for p in bn: assert ours.opt.state[p].get('force_train', False) is train_bn
            for learn in (ours, ref):
                learn.freeze()
                learn.fit(1, 1e-2)
            assert_same_training(ours, ref)
            assert all(p.requires_grad is train_bn for p in bn)
            results[wd_bn_bias, train_bn] = {n: p.detach().clone() for n, p in ours.model.named_parameters()}
    bn_moved = lambda r: not torch.equal(r['1.weight'], learner_model()[1].weight)
    assert bn_moved(results[False, True]) and not bn_moved(results[False, False])
    assert not torch.equal(results[False, True]['5.bias'], results[True, True]['5.bias'])  # do_wd changes the bias


def step_count(learn: Learner):
    "The steps the head's weight took, for the optimizers that count them (`step_stat`), else None."
    return learn.opt.state[learn.model[5].weight].get('step', None)


def expected_steps(name: str, steps: int):
    "What `step_count` must read after `steps` optimizer steps: only the optimizers with `step_stat` count."
    return steps if name in COUNTS_STEPS else None


@pytest.mark.parametrize('name', NAMES)
def test_gradient_accumulation(name, tmp_path):
    "GradientAccumulation skips step and zero_grad: grads accumulate over 2 batches of 8, one step per 16 samples."
    ours, ref = (make_learner(getattr(m, name), tmp_path, bs=8, cbs=GradientAccumulation(16)) for m in (cbopt, fo))
    for learn in (ours, ref): learn.fit(1, 1e-2)
    assert_same_training(ours, ref)
    assert step_count(ours) == expected_steps(name, 3)  # 6 batches of 8, one step per 16 samples


# -- mixed precision -----------------------------------------------------------------------------------------------
class CPUMixedPrecision(MixedPrecision):
    "fastai's MixedPrecision with bf16 autocast and a real (enabled) GradScaler on the CPU."
    def before_fit(self):
        self.autocast, self.scales = autocast('cpu', dtype=torch.bfloat16), L()
        self.learn.scaler = GradScaler('cpu', init_scale=2.**10)


class InfOnBatch1(Callback):
    "Put an inf in a grad on batch 1 (before MixedPrecision runs), so that the GradScaler skips that step."
    order = MixedPrecision.order - 1
    def before_step(self):
        if self.iter == 1: self.model[5].weight.grad[0, 0] = float('inf')


@pytest.mark.parametrize('name', NAMES)
def test_mixed_precision_grad_scaler_on_cpu(name, tmp_path):
    "The scaler unscales grads in place through `opt.param_groups` (else SGD steps 1024x too far) and skips inf steps."
    ours, ref = (make_learner(getattr(m, name), tmp_path, cbs=CPUMixedPrecision()) for m in (cbopt, fo))
    for learn in (ours, ref):
        learn.fit(1, 1e-2, cbs=InfOnBatch1())
    assert_same_training(ours, ref)
    assert torch.isfinite(ours.model[5].weight).all()
    assert step_count(ours) == expected_steps(name, 2)  # 3 batches, one skipped


@pytest.mark.filterwarnings('ignore:.*CUDA is not available')
@pytest.mark.parametrize('to', ['to_fp16', 'to_bf16'])
def test_fastai_mixed_precision_runs_on_cpu(to, tmp_path):
    "fastai's own to_fp16/to_bf16 target CUDA: on the CPU they disable autocast and the scaler, and training goes on."
    ours, ref = make_learner(cbopt.Adam, tmp_path), make_learner(fo.Adam, tmp_path)
    for learn in (ours, ref):
        getattr(learn, to)()
        learn.fit(1, 1e-2)
    assert_same_training(ours, ref)


# -- lr_find, save / load, export ----------------------------------------------------------------------------------
def test_lr_find_on_fresh_optimizer_restores_it(tmp_path, recwarn):
    "lr_find saves the fresh optimizer, trains, loads it back via fastai's load_model: no warning, state fresh again."
    learn = make_learner(cbopt.Adam, tmp_path)
    learn.create_opt()
    state0 = opt_states(learn)
    model0 = {k: v.clone() for k, v in learn.model.state_dict().items()}
    lrs0 = [h['lr'] for h in learn.opt.hypers]
    assert state0['1.weight'] == {'do_wd': False, 'force_train': True} and state0['3.weight'] == {}
    learn.lr_find(num_it=10, show_plot=False)
    assert opt_warnings(recwarn) == []
    assert_states_equal(opt_states(learn), state0)  # flags kept, algorithm state gone
    for k, v in learn.model.state_dict().items(): assert torch.equal(v, model0[k]), k
    assert [h['lr'] for h in learn.opt.hypers] == lrs0
    learn.fit(1, 1e-2)  # and training goes on from a fresh state
    assert learn.opt.state[learn.model[5].weight]['step'] == 3


def test_lr_find_after_training_restores_state(tmp_path, recwarn):
    learn = make_learner(cbopt.ranger, tmp_path)
    learn.fit_one_cycle(1, 1e-2)
    state0 = opt_states(learn)
    learn.lr_find(num_it=10, show_plot=False)
    assert opt_warnings(recwarn) == []
    assert_states_equal(opt_states(learn), state0)


def test_empty_checkpoint_stays_strict_outside_fastai():
    "The fresh-checkpoint exception is lr_find's only: a plain load of an empty state_dict still raises."
    model = learner_model()
    opt = cbopt.Adam(model.named_parameters(), lr=1e-2)
    fresh = opt.state_dict()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    before = {n: dict(opt.state[p]) for n, p in opt.named_params().items()}
    with pytest.raises(ValueError, match="no state for param '0.weight'"): opt.load_state_dict(fresh)
    assert {n: dict(opt.state[p]) for n, p in opt.named_params().items()} == before  # atomic


def test_fresh_checkpoint_restarts_only_in_lr_find(tmp_path, recwarn):
    """The restart is lr_find's (cbopt's `LRFindRestore`, which the Learner got once, clears the state just before the
    LRFinder loads): `learn.load` of a fresh checkpoint after training is refused as any strict load is (fastai warns),
    and `learn.opt.clear_state()` first makes it load."""
    from cbopt.integrations.fastai import LRFindRestore
    learn = make_learner(cbopt.Adam, tmp_path)
    learn.create_opt()
    learn.save('fresh', with_opt=True)
    learn.fit(1, 1e-2)
    learn.create_opt()  # a second optimizer: no second callback
    assert sum(isinstance(cb, LRFindRestore) for cb in learn.cbs) == 1
    learn.fit(1, 1e-2)
    state0 = opt_states(learn)
    learn.load('fresh', with_opt=True)
    assert opt_warnings(recwarn) == ['Could not load the optimizer state.']
    assert_states_equal(opt_states(learn), state0)
    learn.opt.clear_state()
    learn.load('fresh', with_opt=True)
    assert len(opt_warnings(recwarn)) == 1
    assert all(set(learn.opt.state[p]) <= set(FLAGS) for p in learn.model.parameters())


def test_partial_checkpoint_stays_strict_inside_fastai(tmp_path, recwarn):
    "Through fastai's load_model, a checkpoint missing the state of *some* params is still refused (fastai warns)."
    learn = make_learner(cbopt.Adam, tmp_path)
    learn.fit(1, 1e-2)
    state0 = opt_states(learn)
    sd = learn.opt.named_state_dict()
    del sd['state']['3.weight']
    (tmp_path / 'models').mkdir()
    torch.save({'model': learn.model.state_dict(), 'opt': sd}, tmp_path / 'models' / 'partial.pth')
    learn.load('partial', with_opt=True)
    assert opt_warnings(recwarn) == ['Could not load the optimizer state.']
    assert_states_equal(opt_states(learn), state0)


@pytest.mark.parametrize('name', NAMES)
def test_lr_find_fine_tune_save_load(name, tmp_path, recwarn):
    """lr_find on a fresh optimizer, fine_tune, then learn.save(with_opt) / learn.load under weights_only=True:
    no optimizer-state warning anywhere, every state entry restored, and training continues alike."""
    opt_func = getattr(cbopt, name)
    a = make_learner(opt_func, tmp_path)
    a.lr_find(num_it=10, show_plot=False)
    assert all(set(a.opt.state[p]) <= set(FLAGS) for p in a.model.parameters())
    a.fine_tune(1, base_lr=1e-2)
    file = a.save('ck', with_opt=True)
    torch.load(file, weights_only=True)  # a plain safe load works too
    b = make_learner(opt_func, tmp_path).load('ck', with_opt=True)
    assert opt_warnings(recwarn) == []
    assert_states_equal(opt_states(b), opt_states(a))
    assert [dict(h) for h in b.opt.hypers] == [dict(h) for h in a.opt.hypers]
    a.dls = make_dls()
    for learn in (a, b): learn.fit(1, 1e-2)
    assert_same_training(b, a, tol=0, hps=False)


def test_export_and_load_learner(tmp_path):
    "export pickles the Learner without the optimizer (opt_func must pickle), then rebuilds and reloads it in place."
    opt_func = partial(cbopt.Adam, sqr_mom=0.95)
    learn, twin = make_learner(opt_func, tmp_path), make_learner(opt_func, tmp_path)
    for l_ in (learn, twin): l_.fit(1, 1e-2)
    learn.export('export.pkl')
    for l_ in (learn, twin):  # export did not perturb the optimizer: both continue alike
        l_.dls = make_dls()
        l_.fit(1, 1e-2)
    assert_same_training(learn, twin, tol=0, hps=False)
    with pytest.warns(UserWarning, match='insecure pickle'):
        loaded = load_learner(tmp_path / 'export.pkl')
    assert loaded.opt is None
    x = torch.randn(5, 8)
    loaded.dls = make_dls()
    loaded.create_opt()
    assert isinstance(loaded.opt, cbopt.Optimizer) and loaded.opt.hypers[0]['sqr_mom'] == 0.95
    from cbopt.integrations.fastai import LRFindRestore  # pickled with the Learner by export, found by name
    assert sum(isinstance(cb, LRFindRestore) for cb in loaded.cbs) == 1
    assert loaded.opt.param_names == [n for g in group_names(loaded.model) for n in g]
    loaded.fit(1, 1e-2)
    assert torch.isfinite(loaded.model.eval()(x)).all()


# -- named state: Learner checkpoints and plain PyTorch optimizers are interchangeable -----------------------------
def plain_opt(model: nn.Module, opt_func=cbopt.Adam):
    "A plain-PyTorch cbopt optimizer from `model.named_parameters()`, grouped as the splitter groups them."
    named = dict(model.named_parameters())
    return opt_func([{'params': [(n, named[n]) for n in g]} for g in group_names(model)], lr=1e-2)


def copy_flags(sd: dict, opt) -> None:
    "Set the per-param flags (`do_wd`, `force_train`) a checkpoint records on `opt`, as the Learner set them."
    state = by_name(sd)
    for n, p in opt.named_params().items():
        for k in FLAGS:
            if k in state[n]: opt.state[p][k] = state[n][k]


def by_name(sd: dict) -> dict:
    "The per-param states of a state_dict in torch's layout, by the names its groups list."
    return {n: sd['state'].get(i, {}) for g in sd['param_groups'] for i, n in zip(g['params'], g['param_names'])}


def step_alike(pairs: list, steps: int = 5) -> None:
    "Step each (model, opt) on the same batches."
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        for model, opt in pairs:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize('name', ['Adam', 'ranger'])
def test_learner_checkpoint_is_keyed_by_fqn_and_loads_into_plain_opt(name, tmp_path):
    learn = make_learner(getattr(cbopt, name), tmp_path, wd=0.1)
    learn.fit_one_cycle(1, 1e-2)
    file = learn.save('named', with_opt=True)
    sd = torch.load(file, weights_only=True)['opt']
    fqns = [n for n, _ in learn.model.named_parameters()]
    assert sorted(by_name(sd)) == sorted(fqns)
    assert [g['param_names'] for g in sd['param_groups']] == group_names(learn.model)
    assert by_name(sd)['1.bias']['do_wd'] is False and by_name(sd)['1.bias']['force_train'] is True
    # Learner -> plain PyTorch: the flags are part of the Learner's setup, so the plain user sets them too (by FQN)
    model = copy.deepcopy(learn.model)
    opt = plain_opt(model, getattr(cbopt, name))
    copy_flags(sd, opt)
    opt.load_state_dict(sd)
    assert_states_equal({n: opt.state[p] for n, p in opt.named_params().items()}, opt_states(learn))
    step_alike([(learn.model, learn.opt), (model, opt)])
    assert_same_params(learn.model, model)
    assert_states_equal({n: opt.state[p] for n, p in opt.named_params().items()}, opt_states(learn))
    # and back: plain PyTorch -> the Learner's optimizer
    step_alike([(model, opt)], steps=2)
    learn.model.load_state_dict(model.state_dict())
    learn.opt.load_state_dict(opt.state_dict())
    step_alike([(learn.model, learn.opt), (model, opt)])
    assert_same_params(learn.model, model)


@pytest.mark.parametrize('split', [trainable_params, splitter], ids=['default-splitter', 'three-groups'])
def test_learner_checkpoint_loads_into_the_readmes_plain_opt(split, tmp_path):
    """The README's words: a Learner checkpoint loads into a plain `cbopt.Adam(model.named_parameters())` and back,
    matched by name, whatever the Learner's splitter grouped (three groups into one, and one into three)."""
    learn = make_learner(cbopt.Adam, tmp_path, split=split, wd=0.1)
    learn.fit_one_cycle(1, 1e-2)
    sd = torch.load(learn.save('plain', with_opt=True), weights_only=True)['opt']
    model = copy.deepcopy(learn.model)
    opt = cbopt.Adam(model.named_parameters())
    copy_flags(sd, opt)
    opt.load_state_dict(sd)
    assert len(learn.opt.hypers) == (3 if split is splitter else 1)
    assert all(h == opt.hypers[0] for h in learn.opt.hypers)  # the Learner's last lr, mom and wd
    assert_states_equal({n: opt.state[p] for n, p in opt.named_params().items()}, opt_states(learn))
    step_alike([(learn.model, learn.opt), (model, opt)])
    assert_same_params(learn.model, model)
    step_alike([(model, opt)], steps=2)  # and back
    learn.model.load_state_dict(model.state_dict())
    learn.opt.load_state_dict(opt.state_dict())
    step_alike([(learn.model, learn.opt), (model, opt)])
    assert_same_params(learn.model, model)
