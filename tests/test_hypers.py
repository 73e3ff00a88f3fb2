"""Hypers: fastai's live `opt.hypers` and torch's `param_groups` are one thing; `set_hyper`, per-param flags and
freezing behave as fastai's Optimizer does on the same param lists."""
import warnings

import numpy as np
import pytest
import torch
from fastai.optimizer import Optimizer as FastaiOptimizer
from fastai.optimizer import average_grad as fai_average_grad
from fastai.optimizer import momentum_step as fai_momentum_step
from fastai.optimizer import sgd_step as fai_sgd_step
from fastai.optimizer import weight_decay as fai_weight_decay
from fastcore.basics import even_mults
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cbopt
from cbopt import Optimizer

CBS = [cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step]
FAI_CBS = [fai_weight_decay, fai_average_grad, fai_momentum_step]


def param_lists(sizes=(2, 3, 1), seed=0):
    "Groups of small leaf tensors, as a splitter would return them."
    torch.manual_seed(seed)
    return [[torch.randn(3, requires_grad=True) for _ in range(n)] for n in sizes]


def both(sizes=(2, 3, 1), **hypers):
    "A cbopt and a fastai optimizer over identical copies of the same param lists."
    return Optimizer(param_lists(sizes), CBS, **hypers), FastaiOptimizer(param_lists(sizes), FAI_CBS, **hypers)


def all_params(opt): return [p for pl in opt.param_lists for p in pl]


def step_both(opt, ref, n=5):
    for i in range(n):
        for o in (opt, ref):
            g = torch.Generator().manual_seed(i)
            for p in all_params(o):
                p.grad = torch.randn(p.shape, generator=g) if p.requires_grad else None
            o.step()


def assert_same_param_lists(opt, ref):
    "The params of a cbopt and a fastai optimizer agree, list by list (to float tolerance)."
    for p, q in zip(all_params(opt), all_params(ref)): torch.testing.assert_close(p, q)


# -- live, in sync both ways -------------------------------------------------------------------------------------
def test_hypers_are_live_views_of_param_groups():
    opt = Optimizer(param_lists(), CBS, lr=0.1, mom=0.9)
    opt.hypers[0]['lr'] = 0.5
    assert opt.param_groups[0]['lr'] == 0.5
    opt.param_groups[1]['lr'] = 0.2
    assert opt.hypers[1]['lr'] == 0.2
    h = opt.hypers[2]  # a dict held on to (as ReduceLROnPlateau does) still sees later writes, and writes through
    opt.param_groups[2]['wd'] = 0.3
    assert h['wd'] == 0.3
    h['mom'] = 0.4
    assert opt.param_groups[2]['mom'] == opt.param_groups[2]['momentum'] == 0.4
    assert 'params' not in opt.hypers[0] and 'param_names' not in opt.hypers[0] and 'momentum' not in opt.hypers[0]
    with pytest.raises(KeyError): opt.hypers[0]['params'] = []


def test_live_writes_are_used_by_the_step():
    opt, ref = both(lr=0.1, mom=0.9, wd=0.01)
    step_both(opt, ref, 2)
    opt.param_groups[0]['lr'] = 0.02
    ref.hypers[0]['lr'] = 0.02
    opt.hypers[1]['wd'] = 0.2
    ref.hypers[1]['wd'] = 0.2
    opt.param_groups[2]['momentum'] = 0.3  # torch's name
    ref.hypers[2]['mom'] = 0.3
    step_both(opt, ref)
    assert_same_param_lists(opt, ref)


# -- set_hyper ---------------------------------------------------------------------------------------------------
VALUES = {'scalar': 0.1, 'list': [0.1, 0.2, 0.3], 'tuple': (0.1, 0.2, 0.3), 'array': np.array([0.1, 0.2, 0.3]),
          'np-float': np.float64(0.25), 'np-float32': np.float32(0.5), 'slice': slice(1e-4, 1e-2),
          'slice-none': slice(None, 1e-2), 'array-0d': np.array(0.3)}


@pytest.mark.parametrize('kind', VALUES)
def test_set_hyper_matches_fastai(kind):
    opt, ref = both(lr=1e-3)
    v = VALUES[kind]
    opt.set_hyper('lr', v)
    ref.set_hyper('lr', v.item() if isinstance(v, (np.generic, np.ndarray)) and v.ndim == 0 else v)  # fastai: L(v) fails
    ours, theirs = [h['lr'] for h in opt.hypers], [float(h['lr']) for h in ref.hypers]
    assert ours == pytest.approx(theirs, rel=1e-12, abs=0)
    assert all(type(v) is float for v in ours)  # plain numbers: checkpoints load with weights_only, loggers log them


def test_set_hyper_slices():
    opt = Optimizer(param_lists((1, 1, 1, 1)), CBS)
    opt.set_hyper('lr', slice(1e-5, 1e-1))
    assert [h['lr'] for h in opt.hypers] == pytest.approx(list(even_mults(1e-5, 1e-1, 4)))
    assert np.allclose(np.diff(np.log([h['lr'] for h in opt.hypers])), np.log(10) * 4 / 3)  # log-spaced
    opt.set_hyper('lr', slice(None, 0.3))
    assert [h['lr'] for h in opt.hypers] == [0.03, 0.03, 0.03, 0.3]


def test_set_hyper_wrong_length_changes_nothing():
    opt = Optimizer(param_lists(), CBS, lr=0.1)
    for bad in ([0.1, 0.2], (1, 2, 3, 4), np.array([1., 2.])):
        with pytest.raises(ValueError, match=f"{len(bad)} values.*3 parameter groups"): opt.set_hyper('lr', bad)
    assert [h['lr'] for h in opt.hypers] == [0.1] * 3


def test_set_hypers():
    opt, ref = both(lr=0.1)
    opt.set_hypers(lr=slice(1e-3, 1e-1), wd=[0.1, 0.2, 0.3], mom=np.float64(0.8))
    ref.set_hypers(lr=slice(1e-3, 1e-1), wd=[0.1, 0.2, 0.3], mom=0.8)
    for h, fh in zip(opt.hypers, ref.hypers):
        for k in ('lr', 'wd', 'mom'): assert h[k] == pytest.approx(float(fh[k]))
    step_both(opt, ref)
    assert_same_param_lists(opt, ref)


# -- per-param flags ---------------------------------------------------------------------------------------------
def test_do_wd_false_skips_decay():
    opt = Optimizer(param_lists((2,)), [cbopt.weight_decay, cbopt.sgd_step], lr=0.1, wd=0.5)
    ref = FastaiOptimizer(param_lists((2,)), [fai_weight_decay, fai_sgd_step], lr=0.1, wd=0.5)
    for o in (opt, ref): o.state[all_params(o)[0]]['do_wd'] = False
    before = [p.detach().clone() for p in opt.params]
    for o in (opt, ref):
        for p in all_params(o): p.grad = torch.zeros_like(p)
        o.step()
    torch.testing.assert_close(opt.params[0], before[0], rtol=0, atol=0)  # no decay for it
    torch.testing.assert_close(opt.params[1], before[1] * (1 - 0.1 * 0.5))  # decay for the other
    step_both(opt, ref)
    for p, q in zip(all_params(opt), all_params(ref)): torch.testing.assert_close(p, q)
    assert opt.state[opt.params[0]]['do_wd'] is False  # the flag stays through steps


def test_force_train_trains_while_frozen():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    splits = [[list(m[0].parameters()) + list(m[1].parameters()), list(m[2].parameters())] for m in models]
    opt = Optimizer(splits[0], CBS, lr=0.1, mom=0.9)
    ref = FastaiOptimizer(splits[1], FAI_CBS, lr=0.1, mom=0.9)
    for o, m in zip((opt, ref), models):
        for p in m[1].parameters(): o.state[p]['force_train'] = True  # as Learner does for BatchNorm (train_bn)
        o.freeze()
    assert [p.requires_grad for p in opt.params] == [p.requires_grad for p in all_params(ref)] == \
        [False, False, True, True, True, True]
    before = [p.detach().clone() for p in models[0].parameters()]
    x = torch.randn(8, 3)
    for _ in range(3):
        for o, m in zip((opt, ref), models):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(models[0].parameters(), models[1].parameters()): torch.testing.assert_close(p, q)
    changed = [not torch.equal(p, b) for p, b in zip(models[0].parameters(), before)]
    assert changed == [False, False, True, True, True, True]  # frozen Linear kept, BatchNorm and head trained


# -- freezing ----------------------------------------------------------------------------------------------------
def _freeze(o, op):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        if op == 'freeze': o.freeze()
        elif op == 'unfreeze': o.unfreeze()
        else: o.freeze_to(op)
    return [str(x.message) for x in w if 'Freezing' in str(x.message)]


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 3), min_size=2, max_size=4), data=st.data())
def test_freezing_matches_fastai(sizes, data):
    opt, ref = both(tuple(sizes))
    n = len(sizes)
    flags = data.draw(st.lists(st.booleans(), min_size=sum(sizes), max_size=sum(sizes)))
    for o in (opt, ref):
        for p, f in zip(all_params(o), flags):
            if f: o.state[p]['force_train'] = True
    ops = data.draw(st.lists(st.one_of(st.integers(-n, n + 1), st.sampled_from(['freeze', 'unfreeze'])), max_size=5))
    for op in ops:
        assert _freeze(opt, op) == _freeze(ref, op)
        assert opt.frozen_idx == ref.frozen_idx
        assert [p.requires_grad for p in opt.params] == [p.requires_grad for p in all_params(ref)]


def test_freeze_needs_two_groups():
    with pytest.raises(ValueError, match='two param groups'): Optimizer(param_lists((3,)), CBS).freeze()


# -- state -------------------------------------------------------------------------------------------------------
def test_clear_state_keeps_flags():
    opt, ref = both(lr=0.1, mom=0.9, wd=0.1)
    for o in (opt, ref):
        ps = all_params(o)
        o.state[ps[0]]['do_wd'] = False
        o.state[ps[1]]['force_train'] = True
    step_both(opt, ref, 2)
    assert 'grad_avg' in opt.state[opt.params[0]]
    opt.clear_state(), ref.clear_state()
    assert [dict(opt.state[p]) for p in opt.params] == [dict(ref.state[p]) for p in all_params(ref)]
    assert opt.state[opt.params[0]] == {'do_wd': False} and opt.state[opt.params[1]] == {'force_train': True}
    step_both(opt, ref, 3)  # and the state restarts from scratch as fastai's does
    assert_same_param_lists(opt, ref)


# -- add_param_group ---------------------------------------------------------------------------------------------
def test_add_param_group():
    opt = Optimizer(param_lists((2, 1)), CBS, lr=0.1, mom=0.9)
    a, b, c = (torch.randn(2, requires_grad=True) for _ in range(3))
    opt.add_param_group({'params': [a], 'lr': 0.5})
    opt.add_param_group({'params': {'head': {'w': b}}})
    assert opt.param_names == ['0', '1', '2', '3', 'head.w']  # unnamed: next position; named: its FQN
    assert opt.params[-2] is a and opt.params[-1] is b
    assert [h['lr'] for h in opt.hypers] == [0.1, 0.1, 0.5, 0.1] and opt.hypers[3]['mom'] == 0.9
    assert opt.param_groups[3]['momentum'] == 0.9
    for bad, msg in [({'params': [a]}, 'same tensor'), ({'params': {'head.w': c}}, "duplicate param name 'head.w'"),
                     ({'params': {'x': b}}, "'x'.*same tensor as 'head.w'"), ([c], 'must be a dict')]:
        with pytest.raises((ValueError, TypeError), match=msg): opt.add_param_group(bad)
    assert len(opt.param_groups) == 4 and opt.param_names[-1] == 'head.w'  # rejected groups leave no trace
    opt.set_hyper('lr', slice(None, 1.))
    assert [h['lr'] for h in opt.hypers] == [0.1, 0.1, 0.1, 1.]
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    a0, b0 = a.detach().clone(), b.detach().clone()
    opt.step()  # the new groups step with their own hypers
    torch.testing.assert_close(a, a0 - 0.1)
    torch.testing.assert_close(b, b0 - 1.)


# -- torch's `momentum` name for `mom` ---------------------------------------------------------------------------
def test_momentum_alias():
    ps1, ps2 = param_lists((2,)), param_lists((2,))
    a = Optimizer(ps1, CBS, lr=0.1, mom=0.8)
    b = Optimizer(ps2, CBS, lr=0.1, momentum=0.8)
    assert a.hypers == b.hypers and b.hypers[0]['mom'] == 0.8 and b.param_groups[0]['momentum'] == 0.8
    assert a.defaults['momentum'] == b.defaults['momentum'] == 0.8
    b.set_hyper('momentum', 0.5)
    a.set_hyper('mom', 0.5)
    assert b.hypers[0]['mom'] == b.param_groups[0]['momentum'] == 0.5
    for i in range(4):
        for o in (a, b):
            g = torch.Generator().manual_seed(i)
            for p in o.params: p.grad = torch.randn(p.shape, generator=g)
            o.step()
    for p, q in zip(a.params, b.params): torch.testing.assert_close(p, q, rtol=0, atol=0)


# -- defaults ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('name', ['SGD', 'RMSProp', 'Adam', 'RAdam', 'QHAdam', 'Larc', 'Lamb', 'Lookahead', 'ranger'])
def test_lr_defaults_to_1e_3(name):
    "The README: `lr` defaults to 1e-3 as in torch.optim, for every prebuilt optimizer (Lookahead: its inner one's)."
    p = torch.zeros(3, requires_grad=True)
    opt = cbopt.Lookahead(cbopt.SGD([p])) if name == 'Lookahead' else getattr(cbopt, name)([p])
    assert opt.hypers[0]['lr'] == opt.param_groups[0]['lr'] == 1e-3


def test_default_lr_steps_as_torch_sgd():
    "With no lr given, cbopt's SGD and torch's take the same step: p - 1e-3 * grad."
    p, q = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    opt, ref = cbopt.SGD([p]), torch.optim.SGD([q])
    for t in (p, q): t.grad = torch.tensor([1., 2., -4.])
    opt.step(), ref.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1 - 1e-3, 1 - 2e-3, 1 + 4e-3]), rtol=0, atol=0)
    torch.testing.assert_close(p, q, rtol=0, atol=0)
