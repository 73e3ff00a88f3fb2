"""Hypers: fastai's live `opt.hypers` and torch's `param_groups` are one thing; `set_hyper`, per-param flags and
freezing behave as fastai's Optimizer does on the same param lists.

`ParamGroup` and `Hypers` as the Python objects users and libraries handle (issue #14, mutation testing of
`cbopt/hypers.py`): copies and pickles keep the torch/fastai aliases tied, a deepcopy of a model with its optimizer
keeps the params shared, and fastai's `Hypers` view measures, prints and compares as the dict of hypers it shows."""
import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from fastai.optimizer import average_grad as fai_average_grad
from fastai.optimizer import momentum_step as fai_momentum_step
from fastai.optimizer import Optimizer as FastaiOptimizer
from fastai.optimizer import sgd_step as fai_sgd_step
from fastai.optimizer import weight_decay as fai_weight_decay
from fastcore.basics import even_mults
from hypothesis import given, settings, strategies as st
from torch import nn

import cbopt
from cbopt import Optimizer
from cbopt.core.hypers import expand_hyper, ParamGroup

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
    for bad, msg in [({'params': [a]}, 'same tensor'),  # (a name repeated in another group is accepted, as torch does)
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


def group(**kw) -> ParamGroup:
    return ParamGroup(params=[torch.zeros(2, requires_grad=True)], param_names=['w'], lr=0.1, mom=0.9, **kw)


@pytest.mark.parametrize('how', ['pickle', 'copy', 'deepcopy'])
def test_copies_are_param_groups_with_the_aliases_tied(how) -> None:
    "A pickled or copied group is a ParamGroup: writing torch's `momentum` still writes fastai's `mom`; the original is untouched."
    g = group()
    c = {'pickle': lambda: pickle.loads(pickle.dumps(g)), 'copy': lambda: copy.copy(g),
         'deepcopy': lambda: copy.deepcopy(g)}[how]()
    assert type(c) is ParamGroup and c is not g
    assert c['lr'] == 0.1 and c['mom'] == c['momentum'] == 0.9
    c['momentum'] = 0.5
    assert c['mom'] == 0.5 and g['mom'] == g['momentum'] == 0.9
    c['lr'] = 1.
    assert g['lr'] == 0.1


def test_deepcopy_copies_tensors_and_keeps_what_is_shared_shared() -> None:
    """A deepcopy of (model param, group) gives a group holding the copied param itself, as torch's deepcopy of a
    model with its optimizer does; a tensor hyper is copied, not shared with the original."""
    p = torch.zeros(2, requires_grad=True)
    lr = torch.tensor(0.1)
    g = ParamGroup(params=[p], param_names=['w'], lr=lr)
    p2, g2 = copy.deepcopy((p, g))
    assert g2['params'][0] is p2 and p2 is not p
    assert g2['lr'] is not lr and torch.equal(g2['lr'], lr)
    assert g2['param_names'] == ['w'] and g2['param_names'] is not g['param_names']


def test_hypers_len_repr_eq() -> None:
    "fastai's view holds the hypers only: not the params, their names, the chain, torch's aliases or whole-model state."
    opt = cbopt.Optimizer([torch.zeros(2, requires_grad=True)], [cbopt.skip_nonfinite, cbopt.average_grad,
                                                                 cbopt.momentum_step], lr=0.1, mom=0.9)
    h = opt.hypers[0]
    expected = {'lr': 0.1, 'mom': 0.9, 'max_consecutive': None}
    assert dict(h) == expected and len(h) == len(expected) == 3
    assert repr(h) == repr(dict(h))
    assert h == expected and h == dict(expected) and not (h != expected)
    assert h != {**expected, 'lr': 0.2} and h != {'lr': 0.1}
    assert h == opt.hypers[0] and h != 3 and h != 'lr'


def test_hypers_keys_and_errors() -> None:
    "Reading a non-hyper is a KeyError naming it; writing one says it is not a hyper; a snapshot is the hypers alone."
    g = group(momentum=0.9, **{'skip_nonfinite.skipped_total': 2})
    h = cbopt.core.hypers.Hypers(g)
    for k in ('params', 'param_names', 'momentum', 'skip_nonfinite.skipped_total'):
        with pytest.raises(KeyError) as e: h[k]
        assert e.value.args == (k,)
    for k in ('params', 'chain', 'skip_nonfinite.skipped_total'):
        with pytest.raises(KeyError) as e: h[k] = 1
        assert e.value.args == (f"{k!r} is not a hyper",)
    assert h.snapshot() == {'lr': 0.1, 'mom': 0.9} and dict(h) == h.snapshot()
    h['wd'] = 0.5
    assert g['wd'] == 0.5
    del h['wd']
    assert 'wd' not in g
    assert cbopt.core.hypers.model_entries(g) == {'skip_nonfinite.skipped_total': 2}
    for k in ('params', 'skip_nonfinite.skipped_total'):  # set_hyper's path: refused before any value is looked at
        with pytest.raises(KeyError) as e: expand_hyper(k, [1, 2, 3], 2)  # before the count is checked
        assert e.value.args == (f"{k!r} is not a hyper",)


def test_torch_and_cbopt_names_of_one_hyper_must_agree() -> None:
    """`weight_decay` and `wd` given together must be equal; tensors are the same only if they are the same tensor
    (two tensors' `==` has no one truth value, and a number never equals a tensor here)."""
    from cbopt.core.hypers import from_torch_names
    t = torch.tensor(0.1)
    assert from_torch_names({'weight_decay': 0.1, 'wd': 0.1}) == {'wd': 0.1}
    assert from_torch_names({'weight_decay': t, 'wd': t})['wd'] is t
    for a, b in ((t, torch.tensor(0.1)), (0.1, torch.tensor(0.1)), (t, 0.1), (0.1, 0.2)):
        with pytest.raises(ValueError, match=r"^weight_decay=.* and wd=.* name one hyper: give one$"):
            from_torch_names({'weight_decay': a, 'wd': b})
    assert from_torch_names({'betas': (0.8, 0.9)}) == {'mom': 0.8, 'sqr_mom': 0.9}


def test_numpy_values_become_python_numbers() -> None:
    "fastai's schedules write numpy scalars; a group stores them as Python numbers, so checkpoints load with weights_only."
    g = group()
    g['lr'] = np.float32(0.5)
    g['momentum'] = np.array(0.25)
    assert type(g['lr']) is float and g['lr'] == 0.5
    assert type(g['mom']) is float and g['mom'] == g['momentum'] == 0.25
    g.update(lr=np.float64(2.))
    assert type(g['lr']) is float
    assert expand_hyper('lr', np.float64(0.3), 2) == [0.3, 0.3] and type(expand_hyper('lr', np.float64(0.3), 1)[0]) is float


def test_setdefault_sees_the_alias() -> None:
    g = group()
    assert g.setdefault('momentum', 0.1) == 0.9 and g['mom'] == 0.9
    g2 = ParamGroup(lr=0.1)
    assert g2.setdefault('momentum', 0.3) == 0.3 and g2['mom'] == 0.3



def test_an_alias_is_a_name_of_one_entry_not_an_entry() -> None:
    """`momentum` (torch's name of `mom`) and `cbs` (the chain, held as `chain`) read, write, test and delete the entry
    they name, but a group holds, iterates and copies that entry alone: its entries are its checkpoint's, which DCP's
    flattened load rebuilds a group from."""
    chain = [cbopt.average_grad, cbopt.momentum_step]
    g = group(cbs=chain, momentum=0.5)
    assert list(g) == ['params', 'param_names', 'lr', 'mom', 'chain'] and g['mom'] == 0.5 and g['chain'] is chain
    assert g['momentum'] == 0.5 and g['cbs'] is chain and 'momentum' in g and 'cbs' in g and g.get('cbs') is chain
    assert 'momentum' not in dict(g) and 'cbs' not in {**g} and set(copy.copy(g)) == set(g)
    g['cbs'] = chain[:1]
    assert g['chain'] == chain[:1] and list(g).count('chain') == 1
    assert g.pop('cbs') == chain[:1] and 'chain' not in g and g.get('cbs', 'none') == 'none'


@pytest.mark.parametrize('key, other', [('momentum', 'mom'), ('mom', 'momentum')])
def test_deleting_one_alias_deletes_both(key: str, other: str) -> None:
    "`del g['momentum']` (or `pop`) takes `mom` with it: the two stay one value, and a later setdefault sets both."
    g = group()
    del g[key]
    assert key not in g and other not in g and g['lr'] == 0.1
    assert g.setdefault(key, 0.3) == 0.3 and g[other] == 0.3
    assert g.pop(other) == 0.3 and 'mom' not in g and 'momentum' not in g
    assert g.pop(key, 'none') == 'none'
    with pytest.raises(KeyError):
        g.pop(key)
    with pytest.raises(KeyError):
        del g[key]
    assert g.pop('lr') == 0.1 and 'lr' not in g

# -- check_hyper's refusals, whole (issue #14: mutation testing of `cbopt/hypers.py`) -------------------------------
REFUSALS = [  # (name, value, group index) -> (error, the whole message)
    ((3, 0.1, None), (TypeError, "hyper names are strings, got 3 (int)")),
    (('params', [], None), (KeyError, "'params' is not a hyper")),
    (('skip.total', 1, None), (KeyError, "'skip.total' is not a hyper")),  # a whole-model callback's state entry
    (('nesterov', 'yes', None), (TypeError, "hyper 'nesterov' is a flag: True or False, got 'yes' (str)")),
    (('lr', torch.tensor(True), None), (TypeError, "hyper 'lr' got a tensor of dtype torch.bool: expected a real number")),
    (('lr', torch.tensor(1 + 0j), None), (TypeError, "hyper 'lr' got a tensor of dtype torch.complex64: expected a real "
                                                     "number")),
    (('k', torch.tensor(2.), None), (TypeError, "hyper 'k' got a tensor of dtype torch.float32: expected a real number")),
    (('lr', 'x', None), (TypeError, "hyper 'lr' got a str ('x'): expected a number (or a 1-element tensor)")),
    (('k', 2.5, 1), (TypeError, "hyper 'k' (group 1) got a float (2.5): expected an int")),
    (('lr', -1., None), (ValueError, "Invalid learning rate: -1.0 (expected lr >= 0, finite)")),
    (('wd', -1., 2), (ValueError, "Invalid weight_decay value: -1.0 (group 2) (expected wd >= 0, finite; wd is torch's "
                                  "weight_decay)")),
]


@pytest.mark.parametrize('case, expected', REFUSALS, ids=[f'{c[0]}-{type(c[1]).__name__}' for c, _ in REFUSALS])
def test_check_hyper_refusals_in_these_words(case, expected) -> None:
    "Each refusal names the hyper, the group when given, what it got and what it takes; a range's note only if any."
    err, msg = expected
    with pytest.raises(err) as e: cbopt.core.hypers.check_hyper(*case)
    assert e.value.args == (msg,)


def test_hypers_view_refuses_what_is_not_a_hyper() -> None:
    """fastai's view neither reads nor writes the group's params, names, torch aliases or whole-model entries: a
    KeyError of the key (as a dict's), or saying it is not a hyper, and the group unchanged."""
    g = group(**{'skip_nonfinite.skipped_total': 3})
    h, before = cbopt.core.hypers.Hypers(g), dict(g)
    for k in ('params', 'momentum', 'skip_nonfinite.skipped_total'):
        with pytest.raises(KeyError) as e: h[k]
        assert e.value.args == (k,)
    for k in ('param_names', 'skip_nonfinite.skipped_total'):
        with pytest.raises(KeyError) as e: h[k] = 1
        assert e.value.args == (f"{k!r} is not a hyper",)
    assert dict(g) == before
    assert cbopt.core.hypers.model_entries(g) == {'skip_nonfinite.skipped_total': 3}


def test_snapshot_gives_a_tensor_hyper_as_a_0d_view_of_itself() -> None:
    "A tensor lr of shape [1] or [1, 1] reaches the callbacks 0-d, the same storage (in-place changes reach the step)."
    for shape in ((1,), (1, 1), ()):
        lr = torch.full(shape, 0.1)
        g = group()
        g['lr'] = lr
        s = cbopt.core.hypers.Hypers(g).snapshot()
        assert s['lr'].shape == () and s['lr'].data_ptr() == lr.data_ptr()
        lr.fill_(0.2)
        assert s['lr'].item() == pytest.approx(0.2)


def test_snapshot_follows_the_groups_keys_as_they_change() -> None:
    """A snapshot is every hyper of the group as it is now: an entry added or removed between snapshots is in or out
    of the next (the hyper keys are found once per set of keys), never the params, names, chain, torch's aliases or
    whole-model entries."""
    g = group()
    first = cbopt.core.hypers.Hypers(g).snapshot()
    g['my_hyper'] = 3
    g['clip.count'] = 2  # a whole-model callback's state
    second = cbopt.core.hypers.Hypers(g).snapshot()
    assert second == {**first, 'my_hyper': 3}
    del g['my_hyper']
    assert cbopt.core.hypers.Hypers(g).snapshot() == first
    assert not {'params', 'param_names', 'cbs', 'chain', 'momentum', 'clip.count'} & set(second)


@pytest.mark.parametrize('shape', [(), (1,), (1, 1)])
def test_a_one_element_tensor_hyper_is_one_value_for_every_group(shape) -> None:
    "A 1-element tensor of any shape is one value, the same tensor for each group; a tensor of n values is one each."
    lr = torch.full(shape, 0.1)
    assert all(v is lr for v in expand_hyper('lr', lr, 3))
    per_group = expand_hyper('lr', torch.tensor([0.1, 0.2]), 2)
    assert [v.shape for v in per_group] == [(), ()] and [v.item() for v in per_group] == pytest.approx([0.1, 0.2])


def test_param_names_of_another_length_are_not_written() -> None:
    """ZeroRedundancyOptimizer copies rank 0's group entries into every rank's groups, `param_names` too: names of
    another rank's params (another count) are skipped; names of as many params are written."""
    g = ParamGroup(params=[torch.zeros(1), torch.zeros(1)], param_names=['a', 'b'], lr=0.1)
    g['param_names'] = ['x']
    assert g['param_names'] == ['a', 'b']
    g.update(param_names=['c', 'd'])
    assert g['param_names'] == ['c', 'd']
