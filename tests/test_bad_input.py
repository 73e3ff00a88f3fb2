"""Bad input, one table: every public entry point, given what a user may wrongly give it, raises a clear error (torch's
own message where torch has one, computed from torch here, not copied) and changes nothing, in every backend: the
optimizer's params, names, hypers, state and freezing are as before, and it steps on exactly as a twin that never saw
the bad call. A new case is a new row of `CASES`."""
from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import cbopt

BACKENDS = ['loop', 'foreach', 'fused', 'auto']
SGD_CBS = [cbopt.weight_decay, cbopt.average_grad, cbopt.momentum_step]


def reads_own(p, note=None, flag=None, scale=None, my_hyper=None, **kwargs):
    "A user callback reading hypers of its own (and doing nothing with them)."
reads_own.state = {}
OWN_CBS = [*SGD_CBS, reads_own]


def make_model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def set_grads(params: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params: p.grad = torch.randn(p.shape, generator=g)


class Env:
    """A model and a stepped two-group cbopt.Adam over it (the optimizer the bad calls are made on), in one backend.
    `named()` and `plain()` give the model's params afresh for the construction rows."""
    def __init__(self, backend: str):
        self.backend, self.model = backend, make_model()
        ps = list(self.model.named_parameters())
        self.opt = cbopt.Adam([ps[:2], ps[2:]], lr=0.01, wd=0.1, backend=backend)
        self.step()

    def named(self): return self.model.named_parameters()
    def plain(self): return list(self.model.parameters())
    def step(self, seed: int = 0) -> None:
        set_grads(self.opt.params, seed)
        self.opt.step()


def torch_says(make: Callable[[list[torch.Tensor]], object]) -> str:
    "torch's own message (as a regex) for the same bad input, given fresh params; torch must refuse it too."
    try: make([torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)])
    except (TypeError, ValueError) as e: return re.escape(str(e))
    raise AssertionError("torch accepts this input: the row should not claim torch's wording")


def _sgd_checkpoint(e: Env) -> dict:
    "A torch.optim.SGD (momentum) state_dict of the same model: another algorithm than the Adam it is loaded into."
    m = make_model()
    sgd = torch.optim.SGD([{'params': list(m.parameters())[:2]}, {'params': list(m.parameters())[2:]}], lr=0.1, momentum=0.9)
    set_grads(list(m.parameters()), 0)
    sgd.step()
    return sgd.state_dict()


def _ckpt(e: Env, edit: Callable[[dict], object]) -> dict:
    "This optimizer's own checkpoint (keyed by name) with one thing broken by `edit`."
    sd = copy.deepcopy(e.opt.named_state_dict())
    edit(sd)
    return sd


def _drop_last_group(sd: dict) -> None:
    "`sd` without its last group and that group's state."
    for k in sd['param_groups'].pop()['params']: sd['state'].pop(k, None)


def _positional_ckpt(e: Env, edit: Callable[[dict], object]) -> dict:
    "This optimizer's checkpoint in torch's layout without param names (matched by position), broken by `edit`."
    sd = copy.deepcopy(e.opt.state_dict())
    for g in sd['param_groups']: del g['param_names']
    edit(sd)
    return sd


def _spent_generator(e: Env):
    g = e.model.parameters()
    list(g)  # used once already, e.g. by another optimizer
    return g


class Case(NamedTuple):
    id: str
    call: Callable[[Env], object]   # does the bad thing
    exc: type[BaseException]
    match: str                      # a regex the message must match (re.search)


MOD = r"nn\.Module \({}\).*model\.parameters\(\).*model\.named_parameters\(\)"
SET = torch_says(lambda ps: torch.optim.SGD([{'params': set(ps)}], lr=0.1))  # torch refuses sets in group dicts
EMPTY = torch_says(lambda ps: torch.optim.SGD([], lr=0.1))
NT = torch.tensor

CASES = [
    # -- params, at construction ------------------------------------------------------------------------------------
    Case('params-module', lambda e: cbopt.Optimizer(e.model, SGD_CBS, backend=e.backend), TypeError, MOD.format('Sequential')),
    Case('params-submodule', lambda e: cbopt.SGD(e.model[0], backend=e.backend), TypeError, MOD.format('Linear')),
    Case('params-list-of-modules', lambda e: cbopt.Adam([e.model[0], e.model[2]], backend=e.backend), TypeError,
         r"position 0 is an " + MOD.format('Linear')),
    Case('params-module-in-dict', lambda e: cbopt.RAdam({'enc': e.model}, backend=e.backend), TypeError,
         r"params at 'enc' is an " + MOD.format('Sequential')),
    Case('params-module-in-group', lambda e: cbopt.QHAdam([{'params': e.model}], backend=e.backend), TypeError,
         MOD.format('Sequential')),
    Case('params-module-in-pair', lambda e: cbopt.Lamb([('enc', e.model)], backend=e.backend), TypeError,
         r"'enc' is an " + MOD.format('Sequential')),
    Case('params-state-dict', lambda e: cbopt.Adam(e.model.state_dict(), backend=e.backend), TypeError,
         r"model\.state_dict\(\).*never get a grad.*model\.parameters\(\)"),
    Case('params-set', lambda e: cbopt.SGD(set(e.plain()), backend=e.backend), TypeError, r"params is a set: " + SET),
    Case('params-frozenset', lambda e: cbopt.Adam(frozenset(e.plain()), backend=e.backend), TypeError, SET),
    Case('params-set-in-group', lambda e: cbopt.RMSProp([{'params': set(e.plain())}], backend=e.backend), TypeError, SET),
    Case('params-set-nested', lambda e: cbopt.Larc({'enc': {'layer': set(e.plain())}}, backend=e.backend), TypeError,
         r"params at 'enc\.layer' is a set: " + SET),
    Case('params-set-as-fastai-group', lambda e: cbopt.Adam([set(e.plain()[:2]), e.plain()[2:]], backend=e.backend),
         TypeError, r"position 0 is a set: " + SET),
    Case('params-set-hint', lambda e: cbopt.SGD(set(e.plain()), backend=e.backend), TypeError, r"checkpoint would load another param's state"),
    Case('params-int', lambda e: cbopt.SGD(3, backend=e.backend), TypeError,
         r"params argument given to the optimizer should be an iterable of Tensors or dicts, but got int"),
    Case('params-str', lambda e: cbopt.Adam('model', backend=e.backend), TypeError, r"iterable of Tensors or dicts, but got str"),
    Case('params-empty', lambda e: cbopt.Adam([], backend=e.backend), ValueError, EMPTY),
    Case('params-spent-generator', lambda e: cbopt.Adam(_spent_generator(e), backend=e.backend), ValueError,
         EMPTY + r".*generator.*only once"),
    Case('params-dict-of-floats', lambda e: cbopt.SGD({'w': 3.0}, backend=e.backend), TypeError, r"params at 'w' is a float"),
    Case('params-none-in-list', lambda e: cbopt.SGD([e.model[0].weight, None], backend=e.backend), TypeError,
         r"holds a NoneType at position 1"),
    Case('params-pair-int-name', lambda e: cbopt.SGD([(0, e.model[0].weight)], backend=e.backend), TypeError,
         r"pair at position 0 whose name is an int \(0\): param names are strings"),
    Case('params-int-in-list', lambda e: cbopt.SGD([e.model[0].weight, 3], backend=e.backend), TypeError,
         r"params holds an int at position 1, not a Tensor or a \(name, Tensor\) pair"),
    Case('params-bool-in-list', lambda e: cbopt.SGD([e.model[0].weight, True], backend=e.backend), TypeError,
         r"params holds a bool at position 1"),
    Case('params-empty-name', lambda e: cbopt.SGD({'': e.model[0].weight}, backend=e.backend), TypeError, r"non-empty strings, got ''"),
    Case('params-non-leaf', lambda e: cbopt.SGD({'w': e.model[0].weight * 2}, backend=e.backend), ValueError, r"'w'.*not a leaf"),
    Case('params-twice', lambda e: cbopt.SGD([e.plain(), e.plain()[:1]], backend=e.backend), ValueError,
         r"^some parameters appear in more than one parameter group: param '4' \(group 1\) is the same tensor as "
         r"'0' \(group 0\)$"),  # (torch's words first: its test_errors matches them)
    Case('params-mixed-groups', lambda e: cbopt.SGD([{'params': e.plain()[:2]}, e.plain()[2]], backend=e.backend), TypeError,
         r"mixes group dicts"),
    Case('params-param-names-length', lambda e: cbopt.SGD([{'params': e.plain(), 'param_names': ['a']}], backend=e.backend),
         ValueError, r"4 params but 1 param_names"),
    Case('params-param-names-conflict', lambda e: cbopt.SGD([{'params': e.named(), 'param_names': list('abcd')}], backend=e.backend),
         ValueError, r"both '0\.weight' and 'a'"),
    # -- hypers, at construction (torch's message for the same value where torch refuses it) ------------------------
    Case('Optimizer-lr-negative', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, lr=-1e-3, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.SGD(ps, lr=-1e-3))),
    Case('Optimizer-lr-str', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, lr='1e-3', backend=e.backend), TypeError,
         r"hyper 'lr' got a str \('1e-3'\)"),
    Case('Optimizer-lr-bool', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, lr=True, backend=e.backend), TypeError, r"'lr' got a bool"),
    Case('Optimizer-lr-none', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, lr=None, backend=e.backend), TypeError, r"'lr' got a NoneType"),
    Case('Optimizer-lr-bad-slice', lambda e: cbopt.Optimizer([e.plain()[:2], e.plain()[2:]], SGD_CBS, lr=slice(-1e-3, 1e-2),
                                                             backend=e.backend), ValueError, r"Invalid learning rate: -0\.001"),
    Case('Optimizer-lr-empty-slice', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, lr=slice(None), backend=e.backend),
         ValueError, r"use slice\(start, stop\)"),
    Case('Optimizer-lr-set', lambda e: cbopt.Optimizer([e.plain()[:2], e.plain()[2:]], SGD_CBS, lr={1e-3, 1e-2}, backend=e.backend),
         TypeError, r"'lr' got a set: a set has no order"),
    Case('Optimizer-lr-per-group-nan', lambda e: cbopt.Optimizer([e.plain()[:2], e.plain()[2:]], SGD_CBS, lr=[1e-3, math.nan],
                                                                 backend=e.backend), ValueError, r"Invalid learning rate: nan \(group 1\)"),
    Case('Optimizer-not-a-hyper', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, param_names=['x'], backend=e.backend), KeyError,
         r"'param_names' is not a hyper"),
    Case('Optimizer-own-hyper-list', lambda e: cbopt.Optimizer(e.named(), OWN_CBS, my_hyper=[[1, 2]], backend=e.backend), TypeError,
         r"hyper 'my_hyper' got a list"),
    Case('Optimizer-group-lr', lambda e: cbopt.Optimizer([{'params': e.plain(), 'lr': -0.1}], SGD_CBS, backend=e.backend),
         ValueError, r"Invalid learning rate: -0\.1 \(group 0\)"),
    Case('Optimizer-group-mom-and-momentum', lambda e: cbopt.Optimizer([{'params': e.plain(), 'mom': 0.9, 'momentum': 0.5}],
                                                                       SGD_CBS, backend=e.backend), ValueError,
         r"both 'mom' \(0\.9\) and its torch name 'momentum' \(0\.5\)"),
    Case('SGD-lr-negative', lambda e: cbopt.SGD(e.named(), lr=-1e-3, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.SGD(ps, lr=-1e-3))),
    Case('SGD-lr-nan', lambda e: cbopt.SGD(e.named(), lr=math.nan, backend=e.backend), ValueError, r"Invalid learning rate: nan"),
    Case('SGD-lr-inf', lambda e: cbopt.SGD(e.named(), lr=math.inf, backend=e.backend), ValueError, r"Invalid learning rate: inf"),
    Case('SGD-mom-negative', lambda e: cbopt.SGD(e.named(), mom=-0.5, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=-0.5))),
    Case('SGD-mom-above-1', lambda e: cbopt.SGD(e.named(), mom=1.5, backend=e.backend), ValueError, r"Invalid momentum value: 1\.5"),
    Case('SGD-wd-negative', lambda e: cbopt.SGD(e.named(), wd=-0.1, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=-0.1))),
    Case('SGD-dampening', lambda e: cbopt.SGD(e.named(), mom=0.9, dampening=2., backend=e.backend), ValueError,
         r"Invalid dampening value: 2\.0"),
    Case('SGD-nesterov-no-mom', lambda e: cbopt.SGD(e.named(), nesterov=True, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.SGD(ps, lr=0.1, nesterov=True))),
    Case('Adam-lr-negative', lambda e: cbopt.Adam(e.named(), lr=-1e-3, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.Adam(ps, lr=-1e-3))),
    Case('Adam-lr-nan', lambda e: cbopt.Adam(e.named(), lr=math.nan, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.Adam(ps, lr=math.nan))),
    Case('Adam-lr-tensor', lambda e: cbopt.Adam(e.named(), lr=NT(-1e-3), backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.Adam(ps, lr=NT(-1e-3)))),
    Case('Adam-lr-tensor-shape', lambda e: cbopt.Adam(e.named(), lr=torch.ones(1, 2), backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.Adam(ps, lr=torch.ones(1, 2)))),
    Case('Adam-lr-str', lambda e: cbopt.Adam(e.named(), lr='1e-3', backend=e.backend), TypeError, r"hyper 'lr' got a str"),
    Case('Adam-eps-negative', lambda e: cbopt.Adam(e.named(), eps=-1e-8, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.Adam(ps, eps=-1e-8))),
    Case('Adam-mom-above-1', lambda e: cbopt.Adam(e.named(), mom=1.5, backend=e.backend), ValueError,
         r"Invalid momentum value: 1\.5.*betas\[0\]"),
    Case('Adam-sqr_mom-1', lambda e: cbopt.Adam(e.named(), sqr_mom=1.0, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.Adam(ps, betas=(0.9, 1.0)))),
    Case('Adam-wd-negative', lambda e: cbopt.Adam(e.named(), wd=-0.01, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.AdamW(ps, weight_decay=-0.01))),
    Case('RAdam-beta-negative', lambda e: cbopt.RAdam(e.named(), beta=-1., backend=e.backend), ValueError, r"Invalid beta value: -1\.0"),
    Case('RAdam-sqr_mom-negative', lambda e: cbopt.RAdam(e.named(), sqr_mom=-0.5, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.RAdam(ps, betas=(0.9, -0.5)))),
    Case('QHAdam-nu_1-nan', lambda e: cbopt.QHAdam(e.named(), nu_1=math.nan, backend=e.backend), ValueError, r"Invalid nu_1 value: nan"),
    Case('QHAdam-mom-1', lambda e: cbopt.QHAdam(e.named(), mom=1.0, backend=e.backend), ValueError, r"Invalid momentum value: 1\.0"),
    Case('Larc-trust_coeff', lambda e: cbopt.Larc(e.named(), trust_coeff=-0.02, backend=e.backend), ValueError,
         r"Invalid trust_coeff value: -0\.02"),
    Case('Larc-eps-str', lambda e: cbopt.Larc(e.named(), eps='1e-8', backend=e.backend), TypeError, r"hyper 'eps' got a str"),
    Case('Lamb-mom-negative', lambda e: cbopt.Lamb(e.named(), mom=-0.1, backend=e.backend), ValueError,
         r"Invalid momentum value: -0\.1"),
    Case('RMSProp-eps-negative', lambda e: cbopt.RMSProp(e.named(), eps=-1e-8, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.RMSprop(ps, eps=-1e-8))),
    Case('RMSProp-mom-negative', lambda e: cbopt.RMSProp(e.named(), mom=-0.5, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.RMSprop(ps, momentum=-0.5))),
    Case('RMSProp-sqr_mom-negative', lambda e: cbopt.RMSProp(e.named(), sqr_mom=-0.5, backend=e.backend), ValueError,
         r"Invalid beta parameter at index 1: -0\.5.*alpha in RMSprop"),
    Case('Lookahead-k-0', lambda e: cbopt.Lookahead(cbopt.SGD(e.named(), backend=e.backend), k=0), ValueError, r"Invalid k value: 0"),
    Case('Lookahead-k-float', lambda e: cbopt.Lookahead(cbopt.SGD(e.named(), backend=e.backend), k=2.5), TypeError,
         r"hyper 'k'.* got a float \(2\.5\): expected an int"),
    Case('Lookahead-alpha', lambda e: cbopt.Lookahead(cbopt.Adam(e.named(), backend=e.backend), alpha=1.5), ValueError,
         r"Invalid alpha value: 1\.5"),
    Case('ranger-lr', lambda e: cbopt.ranger(e.named(), lr=-1e-3, backend=e.backend), ValueError,
         torch_says(lambda ps: torch.optim.RAdam(ps, lr=-1e-3))),
    Case('ranger-params-set', lambda e: cbopt.ranger(set(e.plain()), backend=e.backend), TypeError, SET),
    # -- set_hyper / set_hypers on a stepped optimizer -----------------------------------------------------------------
    Case('set_hyper-lr-negative', lambda e: e.opt.set_hyper('lr', -1e-3), ValueError,
         torch_says(lambda ps: torch.optim.Adam(ps, lr=-1e-3))),
    Case('set_hyper-lr-str', lambda e: e.opt.set_hyper('lr', '1e-3'), TypeError, r"hyper 'lr' got a str"),
    Case('set_hyper-lr-nan-np', lambda e: e.opt.set_hyper('lr', np.float64('nan')), ValueError, r"Invalid learning rate: nan"),
    Case('set_hyper-one-bad-group', lambda e: e.opt.set_hyper('lr', [0.1, -0.2]), ValueError,
         r"Invalid learning rate: -0\.2 \(group 1\)"),
    Case('set_hyper-array-nan', lambda e: e.opt.set_hyper('lr', np.array([0.1, np.nan])), ValueError,
         r"Invalid learning rate: nan \(group 1\)"),
    Case('set_hyper-wrong-length', lambda e: e.opt.set_hyper('lr', [0.1, 0.2, 0.3]), ValueError, r"3 values for 'lr'.*2 parameter groups"),
    Case('set_hyper-set', lambda e: e.opt.set_hyper('lr', {0.1, 0.2}), TypeError, r"set has no order"),
    Case('set_hyper-mom-1', lambda e: e.opt.set_hyper('mom', 1.0), ValueError, r"Invalid momentum value: 1\.0"),
    Case('set_hyper-momentum-alias', lambda e: e.opt.set_hyper('momentum', -0.9), ValueError,
         torch_says(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=-0.9))),
    Case('set_hyper-eps-tensor-nan', lambda e: e.opt.set_hyper('eps', NT(math.nan)), ValueError, r"Invalid epsilon value: nan"),
    Case('set_hyper-params', lambda e: e.opt.set_hyper('params', []), KeyError, r"'params' is not a hyper"),
    Case('set_hyper-param_names', lambda e: e.opt.set_hyper('param_names', ['a', 'b']), KeyError, r"'param_names' is not a hyper"),
    Case('set_hyper-name-not-str', lambda e: e.opt.set_hyper(0, 0.1), TypeError, r"hyper names are strings"),
    Case('set_hyper-nesterov-int', lambda e: e.opt.set_hyper('nesterov', 1), TypeError, r"'nesterov' is a flag"),
    Case('set_hypers-wd', lambda e: e.opt.set_hypers(wd=-0.01), ValueError,
         torch_says(lambda ps: torch.optim.AdamW(ps, weight_decay=-0.01))),
    Case('set_hypers-sqr_mom', lambda e: e.opt.set_hypers(sqr_mom=[0.99, 1.5]), ValueError,
         r"Invalid beta parameter at index 1: 1\.5 \(group 1\)"),
    # -- add_param_group -----------------------------------------------------------------------------------------------
    Case('add_param_group-list', lambda e: e.opt.add_param_group([torch.zeros(2, requires_grad=True)]), TypeError, r"must be a dict"),
    Case('add_param_group-set', lambda e: e.opt.add_param_group({'params': {torch.zeros(2, requires_grad=True)}}), TypeError, SET),
    Case('add_param_group-module', lambda e: e.opt.add_param_group({'params': nn.Linear(2, 2)}), TypeError, MOD.format('Linear')),
    Case('add_param_group-lr', lambda e: e.opt.add_param_group({'params': [torch.zeros(2, requires_grad=True)], 'lr': -1.}),
         ValueError, r"Invalid learning rate: -1\.0"),
    Case('add_param_group-mom-str', lambda e: e.opt.add_param_group({'params': [torch.zeros(2, requires_grad=True)], 'mom': 'x'}),
         TypeError, r"hyper 'mom'.*got a str"),
    Case('add_param_group-existing', lambda e: e.opt.add_param_group({'params': [e.model[2].bias]}), ValueError,
         r"same tensor as '2\.bias'"),
    Case('add_param_group-no-params', lambda e: e.opt.add_param_group({'lr': 0.1}), TypeError,
         r"'lr' a hyper of a group dict that has no 'params' entry"),
    Case('add_param_group-names-length', lambda e: e.opt.add_param_group({'params': [torch.zeros(2, requires_grad=True)],
                                                                          'param_names': ['a', 'b']}), ValueError,
         r"param group 0 has 1 params but 2 param_names"),
    # -- freeze_to -----------------------------------------------------------------------------------------------------
    Case('freeze_to-str', lambda e: e.opt.freeze_to('1'), TypeError, r"freeze_to takes a group index \(an int\), got '1'"),
    Case('freeze-one-group', lambda e: cbopt.Adam(e.named(), backend=e.backend).freeze(), ValueError, r"two param groups"),
    # -- load_state_dict -----------------------------------------------------------------------------------------------
    Case('load-none', lambda e: e.opt.load_state_dict(None), TypeError, r"expected a state_dict with a 'state' entry, got NoneType"),
    Case('load-model-state-dict', lambda e: e.opt.load_state_dict(e.model.state_dict()), TypeError,
         r"expected a state_dict with a 'state' entry, got OrderedDict"),
    Case('load-no-groups', lambda e: e.opt.load_state_dict({'state': {}}), ValueError, r"no 'param_groups'"),
    Case('load-one-group', lambda e: e.opt.load_state_dict(_positional_ckpt(e, _drop_last_group)),
         ValueError, r"1 param groups, this optimizer 2"),
    Case('load-group-missing', lambda e: e.opt.load_state_dict(_ckpt(e, _drop_last_group)), KeyError,
         r"param '2\.weight' \(group 1\) is missing from the state_dict"),
    Case('load-unknown-param', lambda e: e.opt.load_state_dict(_ckpt(e, lambda sd: sd['param_groups'][1]['params'].append('ghost'))),
         KeyError, r"unknown param 'ghost'"),
    Case('load-missing-param', lambda e: e.opt.load_state_dict(_ckpt(e, lambda sd: sd['param_groups'][1]['params'].remove('2.bias'))),
         KeyError, r"'2\.bias' \(group 1\) is missing"),
    Case('load-shape', lambda e: e.opt.load_state_dict(_ckpt(e, lambda sd: sd['state']['2.bias'].update(grad_avg=torch.zeros(5)))),
         ValueError, r"'grad_avg' of param '2\.bias' has shape \(5,\)"),
    Case('load-other-algorithm', lambda e: e.opt.load_state_dict(_sgd_checkpoint(e)), ValueError, r"'0\.weight'"),
    Case('load-nan-lr', lambda e: e.opt.load_state_dict(_ckpt(e, lambda sd: sd['param_groups'][0].update(lr=float('nan')))),
         ValueError, r"Invalid learning rate: nan \(group 0\)"),
    # hypers that no callback reads would be silently ignored
    Case('Optimizer-unread-hyper', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, lr=0.1, wdd=0.1), TypeError,
         r"hyper 'wdd' is read by no callback of this optimizer.*did you mean 'wd'"),
    Case('Optimizer-torch-hyper-name-twice', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, wd=0.1, weight_decay=0.2),
         ValueError, r"weight_decay=0\.2 and wd=0\.1 name one hyper"),
    Case('group-torch-hyper-name-twice', lambda e: cbopt.Adam([{'params': e.named(), 'wd': 0., 'weight_decay': 0.1}]),
         ValueError, r"weight_decay=0\.1 \(group 0\) and wd=0\.0 name one hyper"),
    Case('group-betas-not-a-pair', lambda e: cbopt.Adam([{'params': e.named(), 'betas': 0.9}]), ValueError,
         r"betas \(group 0\) must be a sequence of 2 values \(mom, sqr_mom\), got 0\.9"),
    Case('group-unread-hyper', lambda e: cbopt.Adam([{'params': e.named(), 'amsgrad': True}]), TypeError,
         r"hyper 'amsgrad' \(group 0\) is read by no callback"),
    Case('add_param_group-unread-hyper', lambda e: e.opt.add_param_group({'params': [torch.zeros(2, requires_grad=True)],
                                                                          'wdd': 0.1}), TypeError,
         r"hyper 'wdd' \(group 2\).*did you mean 'wd'"),
    Case('Optimizer-mom-and-momentum', lambda e: cbopt.Optimizer(e.named(), SGD_CBS, mom=0.9, momentum=0.5), ValueError,
         r"momentum=0\.5 and mom=0\.9 name one hyper"),
    Case('SGD-without-momentum-under-OneCycleLR',
         lambda e: torch.optim.lr_scheduler.OneCycleLR(cbopt.SGD(e.named(), lr=0.1), max_lr=0.1, total_steps=10),
         ValueError, r"momentum=0\.95 set on a param group whose chain \[weight_decay,sgd_step\] has no 'mom'"),
    # params no chain can step
    Case('Adafactor-complex-param', lambda e: cbopt.Adafactor([torch.zeros(2, dtype=torch.cfloat, requires_grad=True)]),
         TypeError, r"^param '0' \(group 0\) is complex \(torch\.complex64\), which 'adafactor_step' does not support \(as "
         r"torch's Adafactor and Muon do not\): keep its real and imaginary parts as a real param of shape \(\.\.\., 2\) "
         r"and use torch\.view_as_complex\(param\) in the model$"),
    Case('Optimizer-int-param', lambda e: cbopt.SGD([torch.zeros(2, dtype=torch.long)]), TypeError,
         r"param '0' \(group 0\) has dtype torch.int64: only floating-point"),
    # a step is all or nothing: what can be checked is checked before anything changes
    Case('step-grad-of-another-shape', lambda e: (setattr(e.model[2].bias.grad, 'data', torch.ones(3)), e.opt.step()), RuntimeError,
         r"param '2\.bias' has shape \(2,\) but its grad has shape \(3,\)"),
    Case('step-sparse-grad', lambda e: (setattr(e.model[2].bias, 'grad', torch.ones(2).to_sparse()), e.opt.step()),
         RuntimeError, r"param '2\.bias' has a sparse gradient"),
    # atomic setters
    Case('set_hypers-one-bad', lambda e: e.opt.set_hypers(lr=0.5, mom=1.5), ValueError, r"Invalid momentum value: 1\.5"),
    Case('freeze_to-float', lambda e: e.opt.freeze_to(1.5), TypeError, r"freeze_to takes a group index"),
]


def snapshot(e: Env) -> dict:
    "Everything a call may change: params (values, requires_grad), names, groups' entries, state, freezing."
    opt, where = e.opt, {id(p): n for n, p in e.model.named_parameters()}
    return {'params': [(n, p.detach().clone(), p.requires_grad) for n, p in e.model.named_parameters()],
            'groups': [({k: v for k, v in g.items() if k not in ('params', 'chain')}, [where.get(id(p), id(p)) for p in g['params']])
                       for g in opt.param_groups],
            'state': {n: copy.deepcopy(dict(opt.state[p])) for n, p in opt.named_params().items() if p in opt.state},
            'frozen_idx': opt.frozen_idx, 'defaults': dict(opt.defaults)}


def assert_same(a, b, path='') -> None:
    "Deep, exact equality (tensors bit for bit, NaN equal to NaN)."
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor): torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=path)
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a: assert_same(a[k], b[k], f'{path}.{k}')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)): assert_same(x, y, f'{path}[{i}]')
    else: assert a == b or (a != a and b != b), (path, a, b)


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('case', CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, backend: str):
    e, twin = Env(backend), Env(backend)
    before = snapshot(e)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # e.g. the whole-model freezing warning: the error is what this tests
        with pytest.raises(case.exc) as info: case.call(e)
    msg = info.value.args[0] if isinstance(info.value, KeyError) else str(info.value)
    assert re.search(case.match, msg), f"{msg!r} does not match {case.match!r}"
    assert_same(snapshot(e), before)
    for i in (1, 2):  # and it steps on exactly as a twin that never saw the bad call
        e.step(i), twin.step(i)
    assert_same(snapshot(e), snapshot(twin))


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


# -- what must keep working: values that look odd but are valid give the right numbers ------------------------------
def _trained(make: Callable[[nn.Module], cbopt.Optimizer], backend: str) -> list[torch.Tensor]:
    "The params of a fresh model after 3 steps of the optimizer `make` builds over it."
    m = make_model()
    opt = make(m)
    opt.backend = backend
    for i in range(3):
        set_grads(list(m.parameters()), i)
        opt.step()
    return [p.detach().clone() for p in m.parameters()]


# (id, the optimizer with the odd but valid value, the same optimizer with the plain Python value, backends)
VALID = [
    # an fp32 tensor lr rounds differently from the Python float: compared with tolerance below. Only 'loop': Adam with
    # a tensor lr fails in the foreach/fused/auto backends today ("Expected packed scalar Tensor to be of dimension 1")
    ('tensor-lr', lambda m: cbopt.Adam(m.parameters(), lr=NT(0.01)), lambda m: cbopt.Adam(m.parameters(), lr=0.01), ['loop']),
    ('tensor-lr-sgd', lambda m: cbopt.SGD(m.parameters(), lr=NT(0.25), mom=0.9), lambda m: cbopt.SGD(m.parameters(), lr=0.25, mom=0.9),
     BACKENDS),
    ('numpy-lr', lambda m: cbopt.SGD(m.parameters(), lr=np.float32(0.25), mom=np.float64(0.5)),
     lambda m: cbopt.SGD(m.parameters(), lr=float(np.float32(0.25)), mom=0.5), BACKENDS),
    ('numpy-0d-array', lambda m: cbopt.Adam(m.parameters(), lr=np.array(0.01)), lambda m: cbopt.Adam(m.parameters(), lr=0.01),
     BACKENDS),
    ('int-lr', lambda m: cbopt.SGD(m.parameters(), lr=1), lambda m: cbopt.SGD(m.parameters(), lr=1.), BACKENDS),
    ('zeros', lambda m: cbopt.Adam(m.parameters(), mom=0, sqr_mom=0, eps=0.1, wd=0),
     lambda m: cbopt.Adam(m.parameters(), mom=0., sqr_mom=0., eps=0.1, wd=0.), BACKENDS),
    ('momentum-alias', lambda m: cbopt.Optimizer(m.parameters(), SGD_CBS, lr=0.1, momentum=0.5),
     lambda m: cbopt.Optimizer(m.parameters(), SGD_CBS, lr=0.1, mom=0.5), BACKENDS),
    ('own-hypers', lambda m: cbopt.Optimizer(m.parameters(), OWN_CBS, lr=0.1, note='any', flag=None, scale=NT(2.)),
     lambda m: cbopt.Optimizer(m.parameters(), OWN_CBS, lr=0.1), BACKENDS),
    ('no-grad-param', lambda m: cbopt.SGD([*m.parameters(), torch.zeros(2)], lr=0.1), lambda m: cbopt.SGD(m.parameters(), lr=0.1),
     BACKENDS),
    ('ParameterList', lambda m: cbopt.SGD(nn.ParameterList(m.parameters()), lr=0.1), lambda m: cbopt.SGD(m.parameters(), lr=0.1),
     BACKENDS),
    ('group-param_names', lambda m: cbopt.SGD([{'params': list(m.parameters()), 'param_names': list('abcd')}], lr=0.1),
     lambda m: cbopt.SGD(m.parameters(), lr=0.1), BACKENDS),
    ('group-tensor-lr', lambda m: cbopt.SGD([{'params': m.parameters(), 'lr': NT(0.25)}]), lambda m: cbopt.SGD(m.parameters(), lr=0.25),
     BACKENDS),
]


@pytest.mark.parametrize('odd,plain,backend', [(odd, plain, b) for _, odd, plain, bs in VALID for b in bs],
                         ids=[f'{i}-{b}' for i, _, _, bs in VALID for b in bs])
def test_valid_values_give_the_right_numbers(odd, plain, backend):
    exact = odd is not VALID[0][1]  # an fp32 tensor lr of 0.01 is not the float 0.01 (0.25 is exact in both)
    for p, q in zip(_trained(odd, backend), _trained(plain, backend)):
        torch.testing.assert_close(p, q, **({'rtol': 0, 'atol': 0} if exact else {}))


def test_valid_forms_keep_their_names():
    "A ParameterDict and a group's own `param_names` name the params (as torch's param_groups hold them)."
    m = make_model()
    pd = nn.ParameterDict({'w': m[0].weight, 'b': m[0].bias})
    assert cbopt.SGD(pd).param_names == list(pd.keys())  # torch sorts the keys of a plain dict
    assert cbopt.SGD([{'params': [m[2].weight], 'param_names': ['head.w']}]).param_names == ['head.w']


def test_scheduler_writes_are_not_validated():
    "As in torch, an LR scheduler's direct write to a group is not checked (it happens every step; fastai writes numpy)."
    opt = cbopt.Adam(make_model().parameters())
    opt.param_groups[0]['lr'] = np.float64(0.5)
    assert opt.hypers[0]['lr'] == 0.5 and type(opt.hypers[0]['lr']) is float


# -- cbopt refuses exactly what torch refuses, where both have the hyper --------------------------------------------
def _refuses(make) -> bool:
    try: make()
    except ValueError: return True
    return False


# (cbopt factory and hyper, the torch.optim equivalent of the same value)
SAME_RANGE = {
    'Adam-lr': (lambda ps, v: cbopt.Adam(ps, lr=v), lambda ps, v: torch.optim.Adam(ps, lr=v)),
    'Adam-eps': (lambda ps, v: cbopt.Adam(ps, eps=v), lambda ps, v: torch.optim.Adam(ps, eps=v)),
    'Adam-wd': (lambda ps, v: cbopt.Adam(ps, wd=v), lambda ps, v: torch.optim.AdamW(ps, weight_decay=v)),
    'Adam-mom': (lambda ps, v: cbopt.Adam(ps, mom=v), lambda ps, v: torch.optim.Adam(ps, betas=(float(v), 0.99))),
    'Adam-sqr_mom': (lambda ps, v: cbopt.Adam(ps, sqr_mom=v), lambda ps, v: torch.optim.Adam(ps, betas=(0.9, float(v)))),
    'SGD-lr': (lambda ps, v: cbopt.SGD(ps, lr=v), lambda ps, v: torch.optim.SGD(ps, lr=v)),
    'SGD-wd': (lambda ps, v: cbopt.SGD(ps, wd=v), lambda ps, v: torch.optim.SGD(ps, lr=0.1, weight_decay=v)),
    'RMSProp-eps': (lambda ps, v: cbopt.RMSProp(ps, eps=v), lambda ps, v: torch.optim.RMSprop(ps, eps=v)),
}


@pytest.mark.parametrize('ours,theirs', SAME_RANGE.values(), ids=SAME_RANGE.keys())
@settings(max_examples=40, deadline=None)
@given(v=st.one_of(st.floats(-2, 2), st.sampled_from([0., -0., 1., -1e-300, 1 - 1e-16]), st.integers(-2, 2)))
def test_range_matches_torch(ours, theirs, v):
    """For every finite value, cbopt refuses a hyper iff torch refuses it. NaN and inf cbopt always refuses (torch's SGD
    takes a NaN lr, as `nan < 0` is False), and cbopt's `mom` has Adam's upper bound in SGD too (see check_hyper)."""
    ps = lambda: [torch.zeros(2, requires_grad=True)]
    assert _refuses(lambda: ours(ps(), v)) == _refuses(lambda: theirs(ps(), v)), v
    for bad in (math.nan, math.inf): assert _refuses(lambda: ours(ps(), bad))


@pytest.mark.parametrize('backend', BACKENDS)
def test_grads_with_other_strides_than_their_params(backend):
    "A transposed param with a contiguous grad, and a channels_last param: every backend steps as the loop does."
    def run(be):
        g = torch.Generator().manual_seed(0)
        ps = [torch.randn(4, 6, generator=g).t().requires_grad_(), torch.randn(2, 3, 4, 4, generator=g).to(
              memory_format=torch.channels_last).requires_grad_()]
        opt = cbopt.Adam(ps, lr=0.1, wd=0.1, backend=be)
        for i in range(3):
            for p in ps: p.grad = torch.randn(p.shape, generator=g)  # contiguous, unlike its param
            opt.step()
        return ps
    for a, b in zip(run(backend), run('loop')): torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_state_dict_is_a_snapshot():
    "An in-memory checkpoint is not changed by later steps: moments and step counts stay those of when it was taken."
    e = Env('loop')
    sd = e.opt.state_dict()
    kept = copy.deepcopy(sd)
    e.step(1)
    assert_same(sd, kept)
    fresh = Env('loop')
    fresh.opt.load_state_dict(sd)
    assert_same(fresh.opt.state_dict(), kept)
