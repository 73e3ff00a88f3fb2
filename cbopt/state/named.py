"""Named state: state_dicts keyed by fully qualified param names (FQNs), and strict, atomic loading.

A cbopt state_dict is `{'state': {fqn: {key: value}}, 'param_groups': [{**hypers, 'chain': name, 'params': [fqn, ...]}]}`
(`chain` names the callbacks the group ran, so another algorithm's checkpoint is refused per group) and
holds only tensors, numbers, strings, lists and dicts, so `torch.load(..., weights_only=True)` reads it.
`prepare_load` also reads torch.optim state_dicts (integer ids) and fastai's (state by position), checks
everything, and builds the new state aside, so that a failed load changes nothing.
"""
from __future__ import annotations

from collections.abc import Mapping
from numbers import Number
from typing import TYPE_CHECKING, Any

import torch

from ..chain import chain_name, init_chain_state, is_declared, model_param_state, param_chain, run_chain, transient_keys
from ..hypers import NOT_HYPERS, Hypers, _plain, check_hyper, is_model_entry, model_entries
from .flags import split_flags
from .formats import TORCH_OPTIONAL_STATE, to_named

if TYPE_CHECKING: from ..optimizer import Optimizer

__all__ = ['initial_state', 'chain_initial_state', 'named_state_dict', 'prepare_load']


def initial_state(opt: Optimizer, p: torch.Tensor, group: Mapping) -> dict:
    """The state `group`'s chain keeps for `p` before its first step (see `chain_initial_state`), with `p`'s flags."""
    return chain_initial_state(group['cbs'], p, Hypers(group), split_flags(opt.state.get(p, {}))[1])


def chain_initial_state(cbs: list, p: Any, hyper: Mapping, flags: Mapping | None = None) -> dict:
    """The state a chain keeps for `p` (a param or a stand-in): as declared by its callbacks (the values before a
    first step), or, for a chain with an undeclared (fastai-style) callback, what a first step with a zero grad
    creates, computed on a copy of `p`."""
    if is_declared(cbs): return init_chain_state(cbs, p)
    model = init_chain_state([cb for cb in cbs if cb not in param_chain(cbs)], p)  # whole-model callbacks declare theirs
    cbs = param_chain(cbs)
    with torch.no_grad():
        q = p.detach().clone()
        q.grad = torch.zeros_like(q)
        st = dict(flags or {})
        run_chain(cbs, q, st, hyper)
    return {**{k: v for k, v in split_flags(st)[0].items() if k not in transient_keys(cbs)}, **model}


def named_state_dict(opt: Optimizer) -> dict:
    """The optimizer's state keyed by FQN, and its groups' hypers with the FQNs of their params. A snapshot: its
    tensors are copies, so a checkpoint kept in memory does not change as training goes on (torch's aliases the live
    state tensors, while cbopt's step counts are Python numbers: aliasing would mix a later step's moments with an
    earlier step's count)."""
    state = {}
    for name, p in zip(opt.param_names, opt.params):
        s = opt.state.get(p)
        if s: state[name] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else _plain(v) for k, v in s.items()}
    groups = [{**{k: _plain(v) for k, v in Hypers(g).items()}, **{k: _plain(v) for k, v in model_entries(g).items()},
               'chain': chain_name(g['cbs']), 'params': list(g['param_names'])} for g in opt.param_groups]
    return {'state': state, 'param_groups': groups}


# -- strict, atomic loading --------------------------------------------------------------------------------------
def _check_groups(opt: Optimizer, groups: list) -> None:
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"the state_dict has {len(groups)} param groups, this optimizer {len(opt.param_groups)}")
    where = {n: i for i, g in enumerate(opt.param_groups) for n in g['param_names']}
    for i, (g, mine) in enumerate(zip(groups, opt.param_groups)):
        if 'chain' in g and g['chain'] != chain_name(mine['cbs']):
            raise ValueError(f"param group {i} ({', '.join(map(repr, mine['param_names']))}) was saved by the chain "
                             f"[{g['chain']}], but runs [{chain_name(mine['cbs'])}] here: its state belongs to another algorithm")
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
    raw, (sd, origin) = sd, to_named(opt, sd)
    groups = list(sd['param_groups'])
    if origin == 'torch':  # torch's layout (DCP turns cbopt's names into ids) keeps group entries: whole-model state too
        groups = [{**g, **model_entries(r)} for g, r in zip(groups, raw['param_groups'])]
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
            ck = {k: v for k, v in ck.items() if k not in transient_keys(g['cbs'])}  # older checkpoints saved them
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
                if key not in expected_cache: expected_cache[key] = initial_state(opt, p, g)
                expected = expected_cache[key]
            if origin == 'torch': ck = {k: v for k, v in ck.items() if k in expected or k not in TORCH_OPTIONAL_STATE}
            if set(ck) != set(expected):
                if not expected: raise ValueError(f"the state_dict has state {sorted(ck)} for param {name!r}, "
                                                  f"but this optimizer keeps no state for it")
                raise ValueError(f"param {name!r} has state keys {sorted(ck)} in the state_dict but {sorted(expected)} "
                                 "here: it was saved by a different algorithm")
            new_state[p] = {k: _load_value(name, k, ck[k], expected[k]) for k in expected}
    hypers = [{k: _plain(v) for k, v in g.items() if k not in NOT_HYPERS and not is_model_entry(k)} for g in groups]
    for i, h in enumerate(hypers):
        for k, v in h.items():
            if k != 'initial_lr': check_hyper(k, v, i)  # a corrupt checkpoint must not load a NaN lr
    strict = origin == 'cbopt' or any(model_entries(g) for g in groups)
    for i, (h, g, mine) in enumerate(zip(hypers, groups, opt.param_groups)):
        ours = model_entries(mine)
        if strict: h.update(_model_entries(i, model_entries(g), ours))
    return new_state, hypers


def _model_entries(i: int, theirs: Mapping, ours: Mapping) -> dict:
    """Whole-model callbacks' state of group `i` from a checkpoint: exactly the entries this optimizer keeps (an
    unknown or missing one is an error naming it), each a value of the same kind. (A torch.optim or fastai checkpoint
    with no such entries at all leaves ours as they are: those optimizers have none.)"""
    for k in theirs:
        if k not in ours: raise KeyError(f"unknown whole-model callback state {k!r} in the state_dict's group {i}: "
                                         f"this optimizer keeps {sorted(ours) or 'none'} there")
    for k in ours:
        if k not in theirs: raise KeyError(f"whole-model callback state {k!r} (group {i}) is missing from the state_dict")
    return {k: _load_value(f'group {i}', k, theirs[k], ours[k]) for k in ours}
