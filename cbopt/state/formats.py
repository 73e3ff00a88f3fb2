"""Other libraries' optimizer state_dicts read as cbopt's named format: torch.optim's (integer ids, with or without
`param_names`; `exp_avg` is `grad_avg`, `betas` are `mom`/`sqr_mom`, ...) and fastai's (state listed by position,
one hypers dict per group, Lookahead's slow weights)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..chain import chain_name, unwrap
from .flags import split_flags

if TYPE_CHECKING: from ..optimizer import Optimizer

__all__ = ['to_named', 'TORCH_STATE_KEYS', 'TORCH_HYPER_KEYS', 'TORCH_OPTIONAL_STATE', 'TORCH_CHAIN_FLAGS',
           'torch_hyper_names', 'torch_state_names']

# torch.optim's names for the same state and hypers (SGD, Adam/AdamW, RMSprop, RAdam)
TORCH_STATE_KEYS = {'exp_avg': 'grad_avg', 'exp_avg_sq': 'sqr_avg', 'momentum_buffer': 'grad_avg', 'square_avg': 'sqr_avg',
                    'sum': 'sqr_sum', 'acc_delta': 'delta_sqr_avg', 'exp_inf': 'inf_norm', 'ax': 'param_avg',
                    'prev': 'prev_grad',  # Adagrad, Adadelta, Adamax, ASGD, Rprop (cbopt.torch_optimizers)
                    'max_exp_avg_sq': 'max_sqr_avg'}  # Adam's amsgrad
# torch's group entries -> cbopt's hypers (a tuple of torch's, as `betas`, spreads over several); a callback whose
# torch algorithm names a hyper otherwise declares it, `cb.torch_names` (ASGD's `alpha` is not RMSprop's)
TORCH_HYPER_KEYS = {'lr': 'lr', 'eps': 'eps', 'betas': ('mom', 'sqr_mom'), 'weight_decay': 'wd', 'momentum': 'mom', 'alpha': 'sqr_mom',
                    'dampening': 'dampening', 'nesterov': 'nesterov', 'initial_lr': 'initial_lr',
                    'lr_decay': 'lr_decay', 'rho': 'sqr_mom', 'momentum_decay': 'momentum_decay', 'lambd': 'lambd',
                    't0': 't0', 'initial_accumulator_value': 'initial_accumulator_value'}  # Adagrad, Adadelta, NAdam, ASGD
# torch's flags that choose the algorithm, which cbopt chooses by listing a callback: the callback declaring
# `cb.torch_flag = 'amsgrad'` is in the chain exactly when torch's group says amsgrad=True
TORCH_CHAIN_FLAGS = ('amsgrad', 'maximize')
TORCH_OPTIONAL_STATE = ('step',  # torch counts steps in every algorithm (RMSprop too); cbopt only where the math uses it
                        'eta', 'mu')  # ASGD's lr and averaging weight: cbopt computes them from the step


def _is_positional(names: list[str]) -> bool: return all(n == str(i) for i, n in enumerate(names))


def torch_hyper_names(cbs) -> dict:
    "torch's group entries -> cbopt's hypers for the chain `cbs`: the common table, and what its callbacks declare."
    names = dict(TORCH_HYPER_KEYS)
    for cb in cbs: names.update(getattr(unwrap(cb), 'torch_names', None) or {})
    return names


def torch_state_names(cbs) -> dict:
    "torch's state names -> cbopt's for the chain `cbs`: the common table, and what its callbacks declare (`cb.torch_state`)."
    names = dict(TORCH_STATE_KEYS)
    for cb in cbs: names.update(getattr(unwrap(cb), 'torch_state', None) or {})
    return names


def _check_flags(i: int, g: Mapping, cbs) -> None:
    "A torch group's algorithm flags (`TORCH_CHAIN_FLAGS`) must be what the chain `cbs` does: else another algorithm."
    for flag in TORCH_CHAIN_FLAGS:
        if flag not in g: continue
        ours = any(getattr(unwrap(cb), 'torch_flag', None) == flag for cb in cbs)
        if bool(g[flag]) != ours:
            raise ValueError(f"param group {i} of the torch.optim state_dict has {flag}={g[flag]!r}, but this "
                             f"optimizer's chain [{chain_name(cbs)}] runs as {flag}={ours}: build it with {flag}={bool(g[flag])}")


def _from_torch(opt: Optimizer, sd: Mapping) -> dict:
    "A torch.optim state_dict (integer ids in param order) renamed to FQNs and to cbopt's state and hyper names."
    groups, ours = sd['param_groups'], opt.param_groups
    if len(groups) != len(ours):
        raise ValueError(f"the torch.optim state_dict has {len(groups)} param groups, this optimizer {len(ours)}")
    id2name, id2keys, out_groups = {}, {}, []
    for i, (g, mine) in enumerate(zip(groups, ours)):
        if len(g['params']) != len(mine['params']):
            raise ValueError(f"param group {i} has {len(g['params'])} params in the torch.optim state_dict, "
                             f"{len(mine['params'])} here")
        their_names, state_keys = g.get('param_names'), torch_state_names(mine['cbs'])
        for j, (pid, name) in enumerate(zip(g['params'], mine['param_names'])):
            if their_names is not None and not _is_positional(opt.param_names) and their_names[j] != name:
                raise ValueError(f"param {j} of group {i} is {their_names[j]!r} in the torch.optim state_dict "
                                 f"but {name!r} here")
            id2name[pid] = name
            id2keys[pid] = state_keys
        _check_flags(i, g, mine['cbs'])
        hypers, names = {}, torch_hyper_names(mine['cbs'])
        for k, v in g.items():
            if k not in names: continue
            if isinstance(names[k], tuple): hypers.update(zip(names[k], v, strict=True))
            else: hypers[names[k]] = v
        out_groups.append({**hypers, 'params': list(mine['param_names'])})
    state = {}
    for pid, s in sd['state'].items():
        if pid not in id2name: raise ValueError(f"the torch.optim state_dict has state for param id {pid}, which no group lists")
        new = {}
        for k, v in s.items():
            if v is None: continue
            if k == 'step': v = int(v.item()) if isinstance(v, torch.Tensor) else int(v)
            new[id2keys[pid].get(k, k)] = v
        state[id2name[pid]] = new
    return {'state': state, 'param_groups': out_groups}


def _from_fastai(opt: Optimizer, sd: Mapping) -> dict:
    """A fastai Optimizer state_dict (state listed in param order, one hypers dict per group) keyed by FQN. A fastai
    Lookahead's `count` and `slow_weights` become each param's `la_step` and `slow_p` (cbopt's Lookahead state)."""
    states, hypers = list(sd['state']), list(sd['hypers'])
    if len(hypers) != len(opt.param_groups):
        raise ValueError(f"the fastai state_dict has {len(hypers)} param groups, this optimizer {len(opt.param_groups)}")
    if len(states) != len(opt.params):
        raise ValueError(f"the fastai state_dict has state for {len(states)} params, this optimizer has {len(opt.params)}")
    state = {n: dict(s) for n, s in zip(opt.param_names, states) if s}
    if sd.get('slow_weights') is not None:  # fastai's Lookahead: one step count, and slow weights listed per group
        slow = [w for g in sd['slow_weights'] for w in g]
        if len(slow) != len(opt.params):
            raise ValueError(f"the fastai state_dict has slow weights for {len(slow)} params, "
                             f"this optimizer has {len(opt.params)}")
        stateless = not any(split_flags(s)[0] for s in states)  # e.g. Lookahead over plain SGD: slow weights are all
        for n, s, w in zip(opt.param_names, states, slow):
            if stateless or split_flags(s)[0]: state.setdefault(n, {}).update(slow_p=w, la_step=int(sd['count']))
    groups = [{**dict(h), 'params': list(g['param_names'])} for h, g in zip(hypers, opt.param_groups)]
    return {'state': state, 'param_groups': groups}


def to_named(opt: Optimizer, sd: Any) -> tuple[dict, str]:
    "Any supported state_dict as a cbopt FQN-keyed one, and where it came from: 'cbopt', 'torch' or 'fastai'."
    if not isinstance(sd, Mapping) or 'state' not in sd:
        raise TypeError(f"expected a state_dict with a 'state' entry, got {type(sd).__name__}")
    if 'hypers' in sd and not isinstance(sd['state'], Mapping): return _from_fastai(opt, sd), 'fastai'
    if 'param_groups' not in sd: raise ValueError("the state_dict has no 'param_groups'")
    ids = [pid for g in sd['param_groups'] for pid in g['params']]
    if ids and all(isinstance(i, int) for i in ids): return _from_torch(opt, sd), 'torch'
    if not all(isinstance(i, str) for i in ids):
        raise ValueError("the state_dict's param groups list params that are neither FQNs (str) nor torch ids (int)")
    return sd, 'cbopt'
