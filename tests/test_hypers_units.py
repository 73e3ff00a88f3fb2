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
from cbopt.hypers import ParamGroup, expand_hyper


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
    h = cbopt.hypers.Hypers(g)
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
    assert cbopt.hypers.model_entries(g) == {'skip_nonfinite.skipped_total': 2}
    for k in ('params', 'skip_nonfinite.skipped_total'):  # set_hyper's path: refused before any value is looked at
        with pytest.raises(KeyError) as e: expand_hyper(k, [1, 2, 3], 2)  # before the count is checked
        assert e.value.args == (f"{k!r} is not a hyper",)


def test_torch_and_cbopt_names_of_one_hyper_must_agree() -> None:
    """`weight_decay` and `wd` given together must be equal; tensors are the same only if they are the same tensor
    (two tensors' `==` has no one truth value, and a number never equals a tensor here)."""
    from cbopt.hypers import from_torch_names
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
