"""`ParamGroup` and `Hypers` as the Python objects users and libraries handle (issue #14, mutation testing of
`cbopt/hypers.py`): copies and pickles keep the torch/fastai aliases tied, a deepcopy of a model with its optimizer
keeps the params shared, and fastai's `Hypers` view measures, prints and compares as the dict of hypers it shows."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import cbopt
from cbopt.core.hypers import ParamGroup, expand_hyper


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
