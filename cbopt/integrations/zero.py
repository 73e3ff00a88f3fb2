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
  callbacks' state included): each rank keeps its own chain and names.
- **cbopt's checkpoint layout** (a `state_dict` post-hook): each group names its chain (`chain`), saves `mom` without
  torch's alias `momentum`, and lists the names of *its* params in ZeRO's global order, gathered from the ranks'
  consolidated state_dicts: positions (`'0', '1', ...`) unless the ranks' optimizers were named, e.g. with
  `zero.optim.name_params(model)` on every rank. So the checkpoint is readable with weights_only and loads into a
  plain cbopt optimizer by name (by position when unnamed), strictly and atomically.
- **a chain check on load** (a `load_state_dict` pre-hook): a checkpoint saved by other chains raises a `ValueError`
  naming the group. ZeRO's own load has by then written this rank's state itself (it matches params by global position
  and checks nothing else): a strict, atomic, by-name load is a plain cbopt optimizer's `load_state_dict`.

This module never imports torch.distributed: no frame can be ZeRO's unless it is imported.
"""
from __future__ import annotations

import sys
from typing import Any

from .. import optimizer as _optimizer
from ..chain import chain_name
from ..hypers import ALIASES, NOT_HYPERS
from ..state.names import is_positional

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


def _check_chains(zero, state_dict: dict) -> None:
    "Refuse a checkpoint whose groups were saved by other chains than this rank's optimizer runs."
    for i, (g, mine) in enumerate(zip(state_dict['param_groups'], zero.optim.param_groups)):
        theirs = g['chain'] if 'chain' in g else chain_name(g['cbs']) if 'cbs' in g else None
        if theirs is not None and theirs != chain_name(mine['cbs']):
            raise ValueError(f"param group {i} was saved by the chain [{theirs}], but runs [{chain_name(mine['cbs'])}] "
                             "here: its state belongs to another algorithm")


def _sync_hypers(src: list, dst: list) -> None:
    "ZeRO's `_sync_param_groups`, for the hypers only: each rank's optimizer keeps its own chain and names."
    if len(src) != len(dst): raise AssertionError("Mismatch between number of source and destination parameter groups")
    for s, d in zip(src, dst):
        for k in [k for k in s if k not in NOT_HYPERS]: d[k] = s[k]


def hook_zero(opt) -> None:
    "If a ZeroRedundancyOptimizer is building `opt` (its rank's optimizer), give that ZeRO cbopt's sync and checkpoints."
    zero = zero_building()
    if zero is None: return
    zero._sync_param_groups = _sync_hypers  # an instance attribute: ZeRO calls `self._sync_param_groups(src, dst)`
    zero.register_state_dict_post_hook(_checkpoint_groups)
    zero.register_load_state_dict_pre_hook(_check_chains)


_optimizer.on_create.append(hook_zero)
