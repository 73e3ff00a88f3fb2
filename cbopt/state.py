"""Named state: state_dicts keyed by fully qualified param names (FQNs), and strict, atomic loading.

A cbopt state_dict is `{'state': {fqn: {key: value}}, 'param_groups': [{**hypers, 'params': [fqn, ...]}]}` and
holds only tensors, numbers, strings, lists and dicts, so `torch.load(..., weights_only=True)` reads it.
`prepare_load` also reads torch.optim state_dicts (integer ids) and fastai's (state by position), checks
everything, and builds the new state aside, so that a failed load changes nothing.
"""
from __future__ import annotations

from collections.abc import Mapping
from numbers import Number
from typing import TYPE_CHECKING, Any

import torch

from .hypers import NOT_HYPERS, Hypers, _plain

if TYPE_CHECKING: from .optimizer import Optimizer

__all__ = ['FLAGS', 'split_flags', 'first_step_state', 'named_state_dict', 'prepare_load', 'to_named']

FLAGS = ('do_wd', 'force_train')  # per-param settings that live in `state[p]` but are not algorithm state

# torch.optim's names for the same state and hypers (SGD, Adam/AdamW, RMSprop, RAdam)
TORCH_STATE_KEYS = {'exp_avg': 'grad_avg', 'exp_avg_sq': 'sqr_avg', 'momentum_buffer': 'grad_avg', 'square_avg': 'sqr_avg'}
TORCH_HYPER_KEYS = {'lr': 'lr', 'eps': 'eps', 'weight_decay': 'wd', 'momentum': 'mom', 'alpha': 'sqr_mom',
                    'dampening': 'dampening', 'nesterov': 'nesterov', 'initial_lr': 'initial_lr'}


def split_flags(state: Mapping) -> tuple[dict, dict]:
    "A param's state as (algorithm state, flags): the flags are settings of the optimizer, not what a step computes."
    algo, flags = {}, {}
    for k, v in state.items(): (flags if k in FLAGS else algo)[k] = v
    return algo, flags


def first_step_state(opt: Optimizer, p: torch.Tensor, group: Mapping) -> dict:
    "The state the callbacks create for `p` on a first step with a zero grad, computed on a copy of `p`."
    from .optimizer import run_chain
    with torch.no_grad():
        q = p.detach().clone()
        q.grad = torch.zeros_like(q)
        st = split_flags(opt.state.get(p, {}))[1]
        run_chain(opt.cbs, q, st, Hypers(group))
    return split_flags(st)[0]


def named_state_dict(opt: Optimizer) -> dict:
    "The optimizer's state keyed by FQN, and its groups' hypers with the FQNs of their params."
    state = {}
    for name, p in zip(opt.param_names, opt.params):
        s = opt.state.get(p)
        if s: state[name] = {k: _plain(v) for k, v in s.items()}
    groups = [{**{k: _plain(v) for k, v in Hypers(g).items()}, 'params': list(g['param_names'])} for g in opt.param_groups]
    return {'state': state, 'param_groups': groups}


# -- reading other formats ---------------------------------------------------------------------------------------
def _is_positional(names: list[str]) -> bool: return all(n == str(i) for i, n in enumerate(names))


def _from_torch(opt: Optimizer, sd: Mapping) -> dict:
    "A torch.optim state_dict (integer ids in param order) renamed to FQNs and to cbopt's state and hyper names."
    groups, ours = sd['param_groups'], opt.param_groups
    if len(groups) != len(ours):
        raise ValueError(f"the torch.optim state_dict has {len(groups)} param groups, this optimizer {len(ours)}")
    id2name, out_groups = {}, []
    for i, (g, mine) in enumerate(zip(groups, ours)):
        if len(g['params']) != len(mine['params']):
            raise ValueError(f"param group {i} has {len(g['params'])} params in the torch.optim state_dict, "
                             f"{len(mine['params'])} here")
        their_names = g.get('param_names')
        for j, (pid, name) in enumerate(zip(g['params'], mine['param_names'])):
            if their_names is not None and not _is_positional(opt.param_names) and their_names[j] != name:
                raise ValueError(f"param {j} of group {i} is {their_names[j]!r} in the torch.optim state_dict "
                                 f"but {name!r} here")
            id2name[pid] = name
        hypers = {TORCH_HYPER_KEYS[k]: v for k, v in g.items() if k in TORCH_HYPER_KEYS}
        if 'betas' in g: hypers['mom'], hypers['sqr_mom'] = g['betas'][0], g['betas'][1]
        out_groups.append({**hypers, 'params': list(mine['param_names'])})
    state = {}
    for pid, s in sd['state'].items():
        if pid not in id2name: raise ValueError(f"the torch.optim state_dict has state for param id {pid}, which no group lists")
        new = {}
        for k, v in s.items():
            if v is None: continue
            if k == 'step': v = int(v.item()) if isinstance(v, torch.Tensor) else int(v)
            new[TORCH_STATE_KEYS.get(k, k)] = v
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


def to_named(opt: Optimizer, sd: Any) -> dict:
    "Any supported state_dict (cbopt, torch.optim, fastai) as a cbopt FQN-keyed one."
    if not isinstance(sd, Mapping) or 'state' not in sd:
        raise TypeError(f"expected a state_dict with a 'state' entry, got {type(sd).__name__}")
    if 'hypers' in sd and not isinstance(sd['state'], Mapping): return _from_fastai(opt, sd)
    if 'param_groups' not in sd: raise ValueError("the state_dict has no 'param_groups'")
    ids = [pid for g in sd['param_groups'] for pid in g['params']]
    if ids and all(isinstance(i, int) for i in ids): return _from_torch(opt, sd)
    if not all(isinstance(i, str) for i in ids):
        raise ValueError("the state_dict's param groups list params that are neither FQNs (str) nor torch ids (int)")
    return sd


# -- strict, atomic loading --------------------------------------------------------------------------------------
def _check_groups(opt: Optimizer, groups: list) -> None:
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"the state_dict has {len(groups)} param groups, this optimizer {len(opt.param_groups)}")
    where = {n: i for i, g in enumerate(opt.param_groups) for n in g['param_names']}
    for i, (g, mine) in enumerate(zip(groups, opt.param_groups)):
        theirs, ours = list(g['params']), set(mine['param_names'])
        for n in theirs:
            if n not in where: raise KeyError(f"unknown param {n!r} in the state_dict's group {i}: this optimizer has no such param")
            if where[n] != i: raise ValueError(f"param {n!r} is in group {i} of the state_dict but in group {where[n]} here")
        for n in ours - set(theirs): raise KeyError(f"param {n!r} (group {i}) is missing from the state_dict")


def _load_value(name: str, key: str, value: Any, like: Any) -> Any:
    "`value` from a checkpoint made like `like` (this optimizer's own value): same kind, shape, device and dtype."
    if isinstance(like, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state {key!r} of param {name!r} is a {type(value).__name__} in the state_dict, a Tensor here")
        if value.shape != like.shape:
            raise ValueError(f"state {key!r} of param {name!r} has shape {tuple(value.shape)} in the state_dict, "
                             f"{tuple(like.shape)} here")
        if (value.is_floating_point(), value.is_complex()) != (like.is_floating_point(), like.is_complex()):
            raise TypeError(f"state {key!r} of param {name!r} has dtype {value.dtype} in the state_dict, {like.dtype} here")
        return value.detach().to(device=like.device, dtype=like.dtype, copy=True)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and isinstance(like, Number): value = value.item()
    if isinstance(like, Number) and not isinstance(value, Number):
        raise TypeError(f"state {key!r} of param {name!r} is a {type(value).__name__} in the state_dict, a number here")
    return type(like)(value) if isinstance(like, Number) and not isinstance(like, bool) else value


def prepare_load(opt: Optimizer, sd: Any, fresh_ok: bool = False) -> tuple[dict, list]:
    """Check `sd` against `opt` and build the state to load, without touching `opt`.
    Returns `({param: algorithm state}, [hypers per group])`; raises an error naming the param on any mismatch.
    A param with state here but none in `sd` raises, unless `fresh_ok` and `sd` holds no state at all (a checkpoint
    of a fresh optimizer, as fastai's `lr_find` makes): then every param restarts."""
    sd = to_named(opt, sd)
    groups = list(sd['param_groups'])
    _check_groups(opt, groups)
    their_state = sd['state']
    names = set(opt.param_names)
    for n in their_state:
        if n not in names: raise KeyError(f"unknown param {n!r} in the state_dict's state: this optimizer has no such param")
    fresh = fresh_ok and not any(split_flags(s)[0] for s in their_state.values())
    new_state, expected_cache = {}, {}
    for gi, g in enumerate(opt.param_groups):
        for name, p in zip(g['param_names'], g['params']):
            ck = split_flags(their_state.get(name, {}))[0]
            cur, flags = split_flags(opt.state.get(p, {}))
            if cur and not ck and not fresh:
                raise ValueError(f"the state_dict has no state for param {name!r}, which has state here "
                                 f"({sorted(cur)}): loading it would silently restart {name!r}; call clear_state() first")
            if not ck:
                new_state[p] = {}
                continue
            if cur: expected = cur
            else:
                key = (gi, p.shape, p.dtype, p.device, tuple(sorted(flags.items())))
                if key not in expected_cache: expected_cache[key] = first_step_state(opt, p, g)
                expected = expected_cache[key]
            if set(ck) != set(expected):
                if not expected: raise ValueError(f"the state_dict has state {sorted(ck)} for param {name!r}, "
                                                  f"but this optimizer keeps no state for it")
                raise ValueError(f"param {name!r} has state keys {sorted(ck)} in the state_dict but {sorted(expected)} "
                                 "here: it was saved by a different algorithm")
            new_state[p] = {k: _load_value(name, k, ck[k], expected[k]) for k in expected}
    hypers = [{k: _plain(v) for k, v in g.items() if k not in NOT_HYPERS} for g in groups]
    return new_state, hypers
