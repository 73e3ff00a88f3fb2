"""torch's `ZeroRedundancyOptimizer(params, optimizer_class=cbopt.Adam, ...)`, as the only place in cbopt that knows
about it.

ZeRO builds one cbopt optimizer per rank over that rank's share of the params, and copies every entry of the groups
both ways between that optimizer and its own global groups (`_sync_param_groups`: at its start, around every step,
when consolidating and loading). A live cbopt group holds, besides hypers, its chain (`cbs`, callables) and the names
of its params (`param_names`, the rank's own). Copied, they made ZeRO's consolidated `state_dict()` hold live
callbacks (unreadable with `torch.load(weights_only=True)`) and rank 0's names on every group; and copied back, a
rank's names became stale ones.

When ZeRO's `_init_local_optimizer` is building a cbopt optimizer, this module gives that ZeRO:

- **a sync of the hypers only** (every group entry but `params`, `param_names`, `cbs` and `chain`; whole-model
  callbacks' state included): each rank keeps its own chain and names; ZeRO gives it bare tensors, which it names by
  their global positions (`'3'` is ZeRO's param 3 on whichever rank owns it), as ZeRO's checkpoint does.
- **cbopt's checkpoint layout** (a `state_dict` post-hook): each group names its chain (`chain`), saves `mom` without
  torch's alias `momentum`, and lists the names of *its* params in ZeRO's global order, gathered from the ranks'
  consolidated state_dicts: positions (`'0', '1', ...`) unless the ranks' optimizers were named, e.g. with
  `zero.optim.name_params(model)` on every rank. So the checkpoint is readable with weights_only and loads into a
  plain cbopt optimizer by name (by position when unnamed), strictly and atomically.
- **a load that is all or nothing on every rank** (`load_state_dict`, in place of ZeRO's, which wrote each rank's
  state as it went and checked nothing but the group sizes, after writing): each rank reads its share of the
  checkpoint (the params of each group at the positions of its own, as ZeRO matches them) with its optimizer's strict
  load (chain, state keys, shapes, dtypes, hypers, whole-model state), without changing anything; the ranks then
  agree (a collective: every rank must load, as with ZeRO's own), and either every rank commits or every rank raises,
  the error naming the param or group (and the rank that refused it, on the others).

This module imports torch.distributed only once a ZeRO exists: no frame can be ZeRO's unless it is imported.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from types import MethodType
from typing import Any

from .. import optimizer as _optimizer
from ..core.chain import chain_name
from ..core.hypers import ALIASES, NOT_HYPERS, same_value
from ..core.names import is_positional

__all__ = ['zero_building', 'hook_zero']

MAX_DEPTH = 6  # frames between ZeRO's _init_local_optimizer and cbopt's on_create (factory, Optimizer.__init__)
ZERO_MODULE = 'torch.distributed.optim.zero_redundancy_optimizer'


def zero_building(depth: int = MAX_DEPTH) -> Any:
    "The ZeroRedundancyOptimizer whose `_init_local_optimizer` is among our `depth` callers, if any."
    mod = sys.modules.get(ZERO_MODULE)
    if mod is None: return None
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None: return None
        if frame.f_code.co_name == '_init_local_optimizer' and isinstance(zero := frame.f_locals.get('self'),
                                                                          mod.ZeroRedundancyOptimizer): return zero
        frame = frame.f_back
    return None


def _global_names(zero) -> list[str]:
    """The name of each param in ZeRO's global order: its rank's optimizer's name for it, from the consolidated
    state_dicts, or its global position when that rank's params are named by position."""
    names = [str(i) for i in range(len(zero._param_to_index))]
    for rank, local in enumerate(zero._all_state_dicts):
        local_names = [n for g in local['param_groups'] for n in g.get('param_names', ())]
        if is_positional(local_names): continue
        parts = zero._partition_parameters()[rank]
        for g, part in zip(local['param_groups'], parts):
            for name, p in zip(g['param_names'], part['params']): names[zero._param_to_index[p]] = name
    return names


def _checkpoint_groups(zero, state_dict: dict) -> dict:
    "ZeRO's consolidated state_dict as cbopt's own: each group with its chain's name and its params' names."
    names = _global_names(zero)
    for i, (g, mine) in enumerate(zip(state_dict['param_groups'], zero.optim.param_groups)):
        g = state_dict['param_groups'][i] = dict(g)  # (a plain dict: a ParamGroup would pop `mom` with `momentum`)
        g.pop('cbs', None)
        g['chain'] = chain_name(mine['cbs'])
        for alias, canon in ALIASES.items():
            if canon in g: g.pop(alias, None)
        g['param_names'] = [names[i] for i in g['params']]
    return state_dict


def _rank_share(zero, state_dict: Mapping) -> dict:
    """The part of ZeRO's checkpoint that this rank's optimizer holds: in each group, the saved params at the positions
    of its own in ZeRO's group (ZeRO's and torch's rule), with their state, names and the group's entries."""
    if not isinstance(state_dict, Mapping) or not {'state', 'param_groups'} <= set(state_dict):
        raise TypeError(f"expected a state_dict with 'state' and 'param_groups' entries, got {type(state_dict).__name__}")
    saved_groups = state_dict['param_groups']
    if len(saved_groups) != len(zero.param_groups):
        raise ValueError(f"the state_dict has {len(saved_groups)} param groups, this ZeroRedundancyOptimizer "
                         f"{len(zero.param_groups)}")
    state, groups, n = {}, [], 0
    for i, (saved, mine, local) in enumerate(zip(saved_groups, zero.param_groups, zero.optim.param_groups)):
        keys = list(saved['params'])
        if len(keys) != len(mine['params']):
            raise ValueError(f"param group {i} has {len(keys)} params in the state_dict, {len(mine['params'])} here")
        where = {p: j for j, p in enumerate(mine['params'])}
        ids = list(range(n, n + len(local['params'])))
        n += len(ids)
        for k, p in zip(ids, local['params']):
            if keys[where[p]] in state_dict['state']: state[k] = state_dict['state'][keys[where[p]]]
        groups.append({**{k: v for k, v in saved.items() if k not in ('params', 'param_names')},
                       'param_names': list(local['param_names']), 'params': ids})  # matched by position: its own names
    return {'state': state, 'param_groups': groups}


def _agree(zero, error: BaseException | None) -> None:
    """Every rank's verdict on a load (a collective over ZeRO's group): if any rank refused it, every rank raises, the
    refusing ranks their own error, the others the first refusing rank's, naming that rank."""
    import torch.distributed as dist  # (ZeRO's own module has imported it)
    verdicts: list = [None] * dist.get_world_size(zero.process_group)
    mine = None if error is None else (type(error), error.args[0] if len(error.args) == 1 else str(error))
    dist.all_gather_object(verdicts, mine, group=zero.process_group)
    if error is not None: raise error
    for rank, verdict in enumerate(verdicts):
        if verdict is None: continue
        kind, message = verdict
        try: other = kind(f"rank {rank} refused the state_dict: {message}")
        except Exception: other = RuntimeError(f"rank {rank} refused the state_dict ({kind.__name__}): {message}")
        raise other


def _load_state_dict(zero, state_dict: dict) -> None:
    """ZeRO's `load_state_dict` for a cbopt optimizer, all or nothing on every rank (see the module docstring); ZeRO's
    groups then take the hypers loaded, as after a step."""
    zero._check_overlap_initialized()
    try:
        for hook in zero._optimizer_load_state_dict_pre_hooks.values():
            if (out := hook(zero, state_dict)) is not None: state_dict = out
        commit, error = zero.optim.prepared_load(_rank_share(zero, state_dict)), None
    except Exception as e: error = e
    _agree(zero, error)
    commit()
    _sync_hypers(zero.optim.param_groups, zero.param_groups)
    for hook in zero._optimizer_load_state_dict_post_hooks.values(): hook(zero)


def _sync_hypers(src: list, dst: list) -> None:
    """ZeRO's `_sync_param_groups`, for the hypers only: each rank's optimizer keeps its own chain and names. ZeRO's
    own groups are plain dicts, which can hold one hyper under both its names (`momentum` given to ZeRO or written by
    a scheduler such as OneCycleLR, and `mom`): copied key by key, the stale one of the two won whenever it came
    last. Both names are kept equal there, and the one written since the last sync is the one copied."""
    if len(src) != len(dst): raise AssertionError("Mismatch between number of source and destination parameter groups")
    for s, d in zip(src, dst):
        for k in [k for k in s if k not in NOT_HYPERS and k not in ALIASES and k not in ALIASES.values()]: d[k] = s[k]
        for alias, canon in ALIASES.items():
            held = [s[k] for k in (canon, alias) if dict.__contains__(s, k)]  # (a ParamGroup holds `canon` only)
            if not held: continue
            now = d.get(canon)
            d[canon] = value = next((v for v in held if not same_value(v, now)), held[0])  # the one written since, if any
            if dict.__contains__(d, alias): d[alias] = value


def hook_zero(opt) -> None:
    "If a ZeroRedundancyOptimizer is building `opt` (its rank's optimizer), give that ZeRO cbopt's sync and checkpoints."
    zero = zero_building()
    if zero is None: return
    zero._sync_param_groups = _sync_hypers  # an instance attribute: ZeRO calls `self._sync_param_groups(src, dst)`
    zero.register_state_dict_post_hook(_checkpoint_groups)
    zero.load_state_dict = MethodType(_load_state_dict, zero)  # (ZeRO's writes each rank's state before checking)
    if is_positional(opt.param_names):  # ZeRO passes bare tensors: each is named by its global position, as in ZeRO's
        for g in opt.param_groups: g['param_names'] = [str(zero._param_to_index[p]) for p in g['params']]  # checkpoint


_optimizer.on_create.append(hook_zero)
