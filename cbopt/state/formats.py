"""Every state_dict cbopt loads, read into one form (`Checkpoint`: params in order with their names if any, and
groups): cbopt's own two layouts (torch's integer ids with `param_names`, and the name-keyed one), torch.optim's
(integer ids, with or without `param_names`; `exp_avg` is `grad_avg`, `betas` are `mom`/`sqr_mom`, ...), the
name-keyed dicts torch's DCP `set_optimizer_state_dict` passes, and fastai's (state listed by position, one hypers
dict per group, Lookahead's slow weights). Matching them to an optimizer's params is `named.prepare_load`'s."""
from __future__ import annotations

from collections.abc import Mapping
from functools import cache as cached_once
from typing import Any, NamedTuple

import torch

from ..core.chain import chain_name, chain_reads, is_model_cb, model_key
from ..core.hypers import from_torch_names, is_framework_key, torch_hyper_names
from ..core.flags import split_flags
from ..core.spec import spec
from .lowbit import stored_base, stored_part

__all__ = ['known_state_names', 'foreign_state_keys', 'read_checkpoint', 'Checkpoint', 'Saved', 'torch_hypers', 'TORCH_OPTIONAL_STATE',
           'TORCH_CHAIN_FLAGS', 'TORCH_DECOUPLED', 'TORCH_FIXED_FLAGS', 'TORCH_STEPLESS', 'torch_hyper_names', 'torch_state_names',
           'chain_flags', 'torch_state', 'torch_model_state', 'torch_model_entries']

# torch's group entries -> cbopt's hypers: `cbopt.hypers.TORCH_HYPER_NAMES`, and what callbacks declare (`cb.torch_names`).
# torch's state names are declared by the callbacks that create or read each entry, `cb.torch_state` (`cbopt.chain`): one
# cbopt entry has different torch names in different algorithms (`grad_avg` is Adam's `exp_avg`, SGD's `momentum_buffer`)

# torch's flags that choose the algorithm, which cbopt chooses by listing a callback: the callback declaring
# `cb.torch_flag = 'amsgrad'` is in the chain exactly when torch's group says amsgrad=True (a chain that reads the
# name as a hyper takes it as one: Muon's `nesterov`)
TORCH_CHAIN_FLAGS = ('amsgrad', 'maximize', 'nesterov', 'centered', 'decoupled_weight_decay')
TORCH_OPTIONAL_STATE = ('step',  # torch counts steps in every algorithm but SGD and Muon; cbopt where the math uses it
                        'eta', 'mu')  # ASGD's lr and averaging weight: cbopt computes them from the step
TORCH_DECOUPLED = ('Adafactor', 'Muon')  # torch's classes whose weight_decay is decoupled with no flag saying so
# flags torch's classes save in every group though their constructor does not take them (AdamW is Adam with this set,
# by default: a group dict may say otherwise)
TORCH_FIXED_FLAGS = {'AdamW': {'decoupled_weight_decay': True}}
# a key only torch's L2-decaying classes save (SGD, RMSprop, Adagrad, Adadelta, ASGD): a group holding one decays by L2
# though it has no `decoupled_weight_decay` flag (Adam's and AdamW's groups from before torch 2.6 have neither: unknown)
TORCH_L2_KEYS = ('dampening', 'centered', 'lr_decay', 'rho', 'lambd')
TORCH_STEPLESS = ('SGD', 'Muon')  # torch's classes that keep no step count (every other one's state must have one)


def torch_state_names(cbs) -> dict:
    "torch's state names -> cbopt's for the chain `cbs`, as its callbacks declare them (`cb.torch_state`)."
    names = {}
    for cb in cbs: names.update(spec(cb).torch_state)
    return names


@cached_once
def known_state_names() -> frozenset:
    """Every per-param state name a cbopt callback keeps, by cbopt's name and torch.optim's (`grad_avg`, `exp_avg`,
    `momentum_buffer`, `step`...): a state entry of one of these names that a param's chain does not keep is another
    algorithm's state (refused on load and on a torch-format save); any other name is a framework's own entry (timm's
    Lookahead keeps `lookahead_slow_buff` in `opt.state[p]`), carried through saving and loading untouched, as torch
    does. Computed once, from the callbacks `cbopt.callbacks` exports."""
    from .. import callbacks  # (the callbacks import only cbopt.core: no cycle)
    names = {'step', 'eta', 'mu', 'al'}  # (torch's ASGD and LBFGS keep these beside the names callbacks declare)
    for name in dir(callbacks):
        cb = getattr(callbacks, name)
        if not callable(cb) or isinstance(cb, type): continue
        try: s = spec(cb)
        except Exception: continue  # (a helper that is no callback)
        names.update(s.state or ())
        names.update(s.torch_state)
        names.update(s.torch_state.values())
    return frozenset(names)


def foreign_state_keys(state: Mapping, chain_keys: Any) -> set:
    """The entries of a param's `state` that are a framework's own (see `known_state_names`): not kept by its chain
    (`chain_keys`) and named as no cbopt or torch.optim state is."""
    known = known_state_names()
    return {k for k in state if k not in chain_keys and k not in known}


def chain_flags(cbs) -> set:
    "The torch flags (`TORCH_CHAIN_FLAGS`) the chain `cbs` runs as True: those its callbacks declare (`cb.torch_flag`)."
    return {f for cb in cbs if (f := spec(cb).torch_flag) is not None}


def _decay_kind(decoupled: bool) -> str:
    return "decoupled (AdamW's: the param shrinks by lr * weight_decay)" if decoupled else \
        "by L2 (weight_decay * param added to the grad)"


def _check_flags(i: int, g: Mapping, cbs) -> None:
    """A torch group's algorithm flags (`TORCH_CHAIN_FLAGS`) must be what the chain `cbs` does: else another algorithm.
    `decoupled_weight_decay` (torch's Adam, AdamW, RAdam, NAdam save it) matters only with a nonzero weight_decay."""
    ours, reads = chain_flags(cbs), chain_reads(cbs)
    if any(k in g for k in TORCH_L2_KEYS): g = {'decoupled_weight_decay': False, **g}  # an L2 class's group says so
    for flag in TORCH_CHAIN_FLAGS:
        if flag not in g or flag in reads or bool(g[flag]) == (flag in ours): continue
        if flag != 'decoupled_weight_decay':
            raise ValueError(f"param group {i} of the torch.optim state_dict has {flag}={g[flag]!r}, but this "
                             f"optimizer's chain [{chain_name(cbs)}] runs as {flag}={flag in ours}: build it with {flag}={bool(g[flag])}")
        if wd := g.get('weight_decay'):  # (without decay: the same numbers either way)
            raise ValueError(f"param group {i} of the torch.optim state_dict decays the weights {_decay_kind(g[flag])}, "
                             f"weight_decay={wd}, but this optimizer's chain [{chain_name(cbs)}] does not: loading it "
                             f"would change what weight_decay means. Build the optimizer with decouple_wd={bool(g[flag])} "
                             f"(cbopt.optim's class of the same name for torch's), or set the group's "
                             f"weight_decay to 0 in the state_dict")


class Saved(NamedTuple):
    """One param of a checkpoint: its name (None if the checkpoint has none), its state, its group's index, and its
    position in that group (None when the format does not say: fastai's)."""
    name: str | None
    state: dict
    group: int | None
    at: int | None = None


class Checkpoint(NamedTuple):
    """Any supported state_dict, read: its params in order, its groups (hypers, whole-model entries and `chain`; a
    torch.optim group's entries as torch names them, read by `torch_hypers` with the chain they load into), each group's size (None when the format does not say: fastai's), and where it came from."""
    params: list[Saved]
    groups: list[dict]
    sizes: list[int] | None
    origin: str  # 'cbopt', 'torch' or 'fastai'
    unlisted: list = []  # keys of the state that no group lists (an error once the params are matched)
    by_name: bool = False  # its groups list their params by name (cbopt's named layout, DCP's load dicts)
    others: dict = {}  # state entries that are no param's (keys not of the groups' kind: a hook's), loaded as they are


def torch_hypers(i: int, g: Mapping, cbs) -> dict:
    """torch.optim group `i`'s entries as hypers of the chain `cbs` (by cbopt's names: `betas` are `mom` and `sqr_mom`,
    `weight_decay` is `wd`, ...; see `torch_hyper_names`), its algorithm flags checked against the chain, its whole-model
    entries and a framework's own (`is_framework_key`: timm's `lr_scale`) kept."""
    _check_flags(i, g, cbs)
    names = torch_hyper_names(cbs)
    hypers = {k: v for k, v in g.items() if '.' in k or k not in names and is_framework_key(k, cbs)}  # (lr_scale...)
    return {**hypers, **from_torch_names({k: v for k, v in g.items() if k in names}, names, f' (torch.optim group {i})')}


def torch_state(s: Mapping, cbs) -> dict:
    "A torch.optim param state by cbopt's names for the chain `cbs` (`torch_state_names`); `step` (a tensor in torch) as an int."
    names, new = torch_state_names(cbs), {}
    for k, v in s.items():
        if v is None: continue
        if k == 'step': v = int(v.item()) if isinstance(v, torch.Tensor) else int(v)
        part = stored_part(k) if isinstance(k, str) else None  # (low-bit state: `'exp_avg.codes'`)
        new[names.get(k, k) if part is None else f'{names.get(stored_base(k), stored_base(k))}.{part}'] = v
    return new


def _group_names(g: Mapping) -> list:
    """The names of a group's params: its `params` if they are names (cbopt's named layout; DCP's load dicts, keyed by
    the model's FQNs), else its `param_names` (torch's layout), else none. `param_names` of another length than
    `params` name other params (ZeroRedundancyOptimizer copies rank 0's into every group) and are ignored."""
    params, names = list(g['params']), g.get('param_names')
    if params and all(isinstance(k, str) for k in params): return params
    if names is not None and len(names) == len(params): return list(names)
    return [None] * len(params)


def _read_groups(sd: Mapping) -> Checkpoint:
    "A state_dict with `param_groups` (cbopt's named or torch layout, torch.optim's, DCP's load dicts)."
    # cbopt's own (its state and hyper names are cbopt's): its groups name their chain, or hold it (a live group's
    # `chain`, or `cbs`, as ZeroRedundancyOptimizer's consolidated state_dict copied cbopt's groups)
    ours = any('chain' in g or 'cbs' in g for g in sd['param_groups'])
    state, params, groups, listed = sd['state'], [], [], set()
    for gi, g in enumerate(sd['param_groups']):
        keys = list(g['params'])
        if not all(isinstance(k, (int, str)) and not isinstance(k, bool) for k in keys):
            raise ValueError(f"group {gi} of the state_dict lists params that are neither names (str) nor torch ids (int)")
        for at, (k, name) in enumerate(zip(keys, _group_names(g))):
            if k in listed: raise ValueError(f"param {k!r} is listed twice in the state_dict's groups")
            listed.add(k)
            s = dict(state.get(k) or {})
            params.append(Saved(name, s, gi, at))  # torch's: see torch_state
        rest = {k: v for k, v in g.items() if k not in ('params', 'param_names', 'cbs')}  # torch's: see torch_hypers
        chain = g.get('chain', g.get('cbs'))  # a live group's copy holds the callbacks themselves
        if chain is not None and not isinstance(chain, str): rest['chain'] = chain_name(chain)
        groups.append(rest)
    # a key of another kind than the listed ones (a name among torch's integer ids) is no param's: torch saves such
    # entries of `opt.state` (a state_dict pre-hook's) as they are, and loads them back as they are
    kinds = {type(k) for k in listed}
    return Checkpoint(params, groups, [len(g['params']) for g in sd['param_groups']], 'cbopt' if ours else 'torch',
                      [k for k in state if k not in listed and (type(k) in kinds or not kinds)], str in kinds,
                      {k: v for k, v in state.items() if k not in listed and kinds and type(k) not in kinds})


def _read_fastai(sd: Mapping) -> Checkpoint:
    """A fastai Optimizer state_dict (state listed in param order, one hypers dict per group, no names). A fastai
    Lookahead's `count` and `slow_weights` become each param's `la_step` and `slow_p` (cbopt's Lookahead state)."""
    states, hypers = [dict(s) for s in sd['state']], [dict(h) for h in sd['hypers']]
    if sd.get('slow_weights') is not None:  # fastai's Lookahead: one step count, and slow weights listed per group
        slow = [w for g in sd['slow_weights'] for w in g]
        if len(slow) != len(states):
            raise ValueError(f"the fastai state_dict has slow weights for {len(slow)} params, state for {len(states)}")
        stateless = not any(split_flags(s)[0] for s in states)  # e.g. Lookahead over plain SGD: slow weights are all
        for s, w in zip(states, slow):
            if stateless or split_flags(s)[0]: s.update(slow_p=w, la_step=int(sd['count']))
    return Checkpoint([Saved(None, s, None) for s in states], hypers, None, 'fastai')


def read_checkpoint(sd: Any) -> Checkpoint:
    "Any supported state_dict (cbopt's two layouts, torch.optim's, fastai's, DCP's load dicts), read."
    if not isinstance(sd, Mapping) or 'state' not in sd:
        raise TypeError(f"expected a state_dict with a 'state' entry, got {type(sd).__name__}")
    if 'hypers' in sd and not isinstance(sd['state'], Mapping): return _read_fastai(sd)
    if 'param_groups' not in sd: raise ValueError("the state_dict has no 'param_groups'")
    return _read_groups(sd)


def torch_model_state(first: dict, cbs) -> dict:
    """The group entries of the whole-model callbacks of `cbs` that torch.optim keeps in the state of a group's first
    param (`cb.torch_model_state`: torch's key -> the callback's, None for torch's scratch), taken out of `first` (a
    checkpoint's state, read into a copy); entries torch has not created yet at their declared initial values."""
    out = {}
    for cb in cbs:
        names = spec(cb).torch_model_state
        if not is_model_cb(cb) or not names: continue
        declared = spec(cb).state  # (its initial values: a callback with torch_model_state declares its state)
        for theirs, ours in names.items():
            v = first.pop(theirs, None)
            if ours is not None: out[model_key(cb, ours)] = declared.get(ours) if v is None else v
    return out


def torch_model_entries(entries: Mapping, cbs) -> dict:
    """The reverse of `torch_model_state`: a group's whole-model entries that torch.optim keeps under the group's first
    param, by torch's names (those not created yet, None, are left out, as torch has not created them either)."""
    out = {}
    for cb in cbs:
        names = spec(cb).torch_model_state
        if not is_model_cb(cb) or not names: continue
        for theirs, ours in names.items():
            v = None if ours is None else entries.get(model_key(cb, ours))
            if v is not None: out[theirs] = v
    return out
