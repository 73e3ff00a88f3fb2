"""`cbopt.ZeroRedundancyOptimizer`: torch's `ZeroRedundancyOptimizer` for cbopt optimizers, as the only place in
cbopt that knows about it. It imports torch.distributed's optim, so `import cbopt` does not import this module:
`cbopt.ZeroRedundancyOptimizer` does, on first use.

ZeRO builds one optimizer per rank over that rank's share of the params, and copies every entry of the groups both
ways between that optimizer and its own global groups (at its start, around every step, when consolidating and
loading). A live cbopt group holds, besides hypers, its chain (`chain`, callables) and the names of its params
(`param_names`, the rank's own). Copied, they made ZeRO's consolidated `state_dict()` hold live callbacks (unreadable
with `torch.load(weights_only=True)`) and rank 0's names on every group; and copied back, a rank's names became stale
ones. ZeRO's own groups are plain dicts, which can hold one hyper under both its names (`momentum` given to ZeRO or
written by a scheduler such as OneCycleLR, and `mom`): copied key by key, the stale one won whenever it came last.
ZeRO's load wrote each rank's state as it went and checked nothing but the group sizes, after writing.

The subclass is what the user constructs in place of torch's (same arguments); it gives:

- **a sync of the hypers only** (every group entry but `params`, `param_names` and the chain; whole-model callbacks'
  state included), keeping `momentum` and `mom` equal on ZeRO's side and copying the one written since: each rank
  keeps its own chain and names; ZeRO gives it bare tensors, which it names by their global positions (`'3'` is
  ZeRO's param 3 on whichever rank owns it), as ZeRO's checkpoint does.
- **cbopt's checkpoint layout**: each group names its chain (`chain`), saves `mom` without torch's alias `momentum`,
  and lists the names of *its* params in ZeRO's global order, gathered from the ranks by `consolidate_state_dict`:
  positions (`'0', '1', ...`) unless the ranks' optimizers were named, e.g. with `zero.optim.name_params(model)` on
  every rank. So the checkpoint is readable with weights_only and loads into a plain cbopt optimizer by name (by
  position when unnamed), strictly and atomically.
- **a load that is all or nothing on every rank**: each rank reads its share of the checkpoint (the params of each
  group at the positions of its own, as ZeRO matches them; where both sides name a param, the names must agree) with
  its optimizer's strict load (chain, state keys, shapes, dtypes, hypers, whole-model state), without changing
  anything; the ranks then agree (a collective: every rank must load, as with ZeRO's own), and either every rank
  commits or every rank raises, the error naming the param or group (and the rank that refused it, on the others).

torch's own `ZeroRedundancyOptimizer(params, optimizer_class=cbopt.Adam)` is not recognised (cbopt has no way to see
who builds its optimizer without reading the call stack): it trains, as torch's ZeRO does with any optimizer class,
but has none of the above (see the README's "Scale out").
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer

from ..core.chain import chain_name
from ..core.hypers import ALIASES, NOT_HYPERS, same_value
from ..optimizer import Optimizer

__all__ = ['ZeroRedundancyOptimizer']


class ZeroRedundancyOptimizer(TorchZeroRedundancyOptimizer):
    """torch's `ZeroRedundancyOptimizer` over a cbopt optimizer class: `cbopt.ZeroRedundancyOptimizer(
    model.parameters(), optimizer_class=cbopt.Adam, lr=..., wd=...)`, torch's arguments. Each rank's optimizer
    (`zero.optim`) keeps its own chain and param names, ZeRO's groups hold the hypers, `state_dict()` (after
    `consolidate_state_dict()` on every rank) is cbopt's checkpoint layout, and `load_state_dict` is all or nothing on
    every rank (see `cbopt.integrations.zero`).

    It overrides these of torch's methods, which torch itself calls:
    - `_sync_param_groups` (torch calls it at construction, around every step, when consolidating and loading): the
      hypers only, and of `momentum` and `mom` the one written since the last sync;
    - `add_param_group`: a new group's params, bare tensors, are named by their global positions as at construction;
    - `consolidate_state_dict`: also gathers each rank's names for its params (a collective, as torch's already is);
    - `state_dict`: torch's, in cbopt's layout;
    - `load_state_dict`: in place of torch's, which writes each rank's state before checking anything.
    `overlap_with_ddp=True` needs one of torch's functional optimizers, which cbopt's are not: it is refused. Its
    `defaults` also hold torch's name of a hyper (`momentum`) that the rank's optimizer has, as cbopt's optimizers'
    do, so that OneCycleLR cycles it whichever name it was given by."""

    def __init__(self, params: Iterable, optimizer_class: Callable[..., Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False, **defaults: Any):
        if overlap_with_ddp:
            raise ValueError("cbopt.ZeroRedundancyOptimizer(overlap_with_ddp=True): overlapping needs one of torch's "
                             "functional optimizers (torch.distributed.optim), which a cbopt optimizer is not")
        self._names: list[str] = []  # each param's name in ZeRO's global order, as of the last consolidation
        super().__init__(params, optimizer_class, process_group=process_group,
                         parameters_as_bucket_view=parameters_as_bucket_view, **defaults)
        if not isinstance(self.optim, Optimizer):
            raise TypeError(f"cbopt.ZeroRedundancyOptimizer(optimizer_class={getattr(optimizer_class, '__name__', optimizer_class)}) "
                            f"built a {type(self.optim).__name__}, not a cbopt optimizer: use "
                            f"torch.distributed.optim.ZeroRedundancyOptimizer for it")
        self._name_by_position(self.optim.param_groups)
        for alias in ALIASES:  # torch's name of a hyper the rank's optimizer has: OneCycleLR looks for `momentum` here
            if alias in self.optim.defaults: self.defaults.setdefault(alias, self.optim.defaults[alias])

    # -- naming --------------------------------------------------------------------------------------------------
    def _global_index(self) -> dict:
        "Each param's position in ZeRO's global order (its groups' params, in order: torch's numbering)."
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g['params'])}

    def _name_by_position(self, groups: list) -> None:
        "Name the params of `groups` (this rank's, given bare by ZeRO) by their global positions."
        index = self._global_index()
        for g in groups: g['param_names'] = [str(index[p]) for p in g['params']]

    def add_param_group(self, param_group: dict) -> None:
        """torch's (call it on every rank); the params that the new group gives this rank's optimizer are named by their
        global positions, if its params so far are (otherwise `zero.optim.name_params(model)` names them). (cbopt names
        a new bare param by its position in the rank's optimizer, which may be another param's global one: so the
        rank's params are named by their local positions while torch adds the group.)"""
        if not getattr(self, 'initialized', False): return super().add_param_group(param_group)  # (torch's __init__)
        index = self._global_index()
        if not all(n == str(index[p]) for g in self.optim.param_groups for p, n in zip(g['params'], g['param_names'])):
            return super().add_param_group(param_group)
        names = (str(i) for i in range(len(self.optim.params)))
        for g in self.optim.param_groups: g['param_names'] = [next(names) for _ in g['params']]
        try: super().add_param_group(param_group)
        finally: self._name_by_position(self.optim.param_groups)

    # -- torch's sync, for the hypers only -------------------------------------------------------------------------
    @staticmethod
    def _sync_param_groups(src_param_groups: list, dst_param_groups: list) -> None:
        "The hypers only (see the class docstring); torch calls it with ZeRO's groups and the rank's, either way."
        sync_hypers(src_param_groups, dst_param_groups)

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """torch's (call it on every rank), and each rank's names for its params, gathered on every rank (names only):
        `state_dict()` on rank `to` then lists them in ZeRO's global order."""
        super().consolidate_state_dict(to)
        index = self._global_index()
        mine = {index[p]: n for g in self.optim.param_groups for p, n in zip(g['params'], g['param_names'])}
        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.process_group)
        names = {i: n for ranks in every for i, n in ranks.items()}
        self._names = [names.get(i, str(i)) for i in range(len(index))]

    def state_dict(self) -> dict[str, Any]:
        """torch's consolidated state_dict (on the rank `consolidate_state_dict` was given) in cbopt's layout: each group
        with its chain's name, `mom` without `momentum`, and its params' names in ZeRO's global order."""
        sd = super().state_dict()
        for i, (g, mine) in enumerate(zip(sd['param_groups'], self.optim.param_groups)):
            g = sd['param_groups'][i] = dict(g)  # (a plain dict: a ParamGroup would pop `mom` with `momentum`)
            g.pop('cbs', None)
            g['chain'] = chain_name(mine['cbs'])
            for alias, canon in ALIASES.items():
                if canon in g: g.pop(alias, None)
            g['param_names'] = [self._names[k] if k < len(self._names) else str(k) for k in g['params']]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ZeRO's consolidated checkpoint (cbopt's layout or torch's), all or nothing on every rank (a collective:
        call it on every rank). Each rank checks its share with its optimizer's strict load, changing nothing; if any
        rank refuses it, every rank raises (the refusing rank's error, naming the param or group; on the others, that
        rank too) and nothing changed anywhere. ZeRO's groups then take the hypers loaded, as after a step."""
        commit, error = None, None
        if isinstance(state_dict, dict): state_dict = state_dict.copy()  # shallow, as torch's: a hook may rebind its keys
        try:
            for hook in self._optimizer_load_state_dict_pre_hooks.values():  # (torch's load runs them: so does this)
                if (out := hook(self, state_dict)) is not None: state_dict = out
            commit = self.optim.prepared_load(rank_share(self, state_dict))
        except Exception as e: error = e
        agree(self.process_group, error)
        commit()
        sync_hypers(self.optim.param_groups, self.param_groups)
        for hook in self._optimizer_load_state_dict_post_hooks.values(): hook(self)


def rank_share(zero: ZeroRedundancyOptimizer, state_dict: Mapping) -> dict:
    """The part of ZeRO's checkpoint that this rank's optimizer holds: in each group, the saved params at the positions
    of its own in ZeRO's group (ZeRO's and torch's rule), with their state and the group's entries, named by this
    rank's names. Where both the checkpoint and this rank name a param (not by its position), the names must agree."""
    if not isinstance(state_dict, Mapping) or not {'state', 'param_groups'} <= set(state_dict):
        raise TypeError(f"expected a state_dict with 'state' and 'param_groups' entries, got {type(state_dict).__name__}")
    saved_groups = state_dict['param_groups']
    if len(saved_groups) != len(zero.param_groups):
        raise ValueError(f"the state_dict has {len(saved_groups)} param groups, this ZeroRedundancyOptimizer "
                         f"{len(zero.param_groups)}")
    index = zero._global_index()
    state, groups, n = {}, [], 0
    for i, (saved, mine, local) in enumerate(zip(saved_groups, zero.param_groups, zero.optim.param_groups)):
        keys = list(saved['params'])
        if len(keys) != len(mine['params']):
            raise ValueError(f"param group {i} has {len(keys)} params in the state_dict, {len(mine['params'])} here")
        saved_names = saved.get('param_names')
        saved_names = list(saved_names) if saved_names is not None and len(saved_names) == len(keys) else None
        where = {p: j for j, p in enumerate(mine['params'])}
        ids = list(range(n, n + len(local['params'])))
        n += len(ids)
        for k, p, name in zip(ids, local['params'], local['param_names']):
            j = where[p]
            if saved_names is not None and name != str(index[p]) and saved_names[j] != str(keys[j]) \
                    and saved_names[j] != name:
                raise ValueError(f"param {name!r} (ZeRO's param {index[p]}, group {i}) is {saved_names[j]!r} in the "
                                 f"state_dict: ZeRO loads by position, and this checkpoint names another param there")
            if keys[j] in state_dict['state']: state[k] = state_dict['state'][keys[j]]
        groups.append({**{k: v for k, v in saved.items() if k not in ('params', 'param_names')},
                       'param_names': list(local['param_names']), 'params': ids})  # matched by position: its own names
    return {'state': state, 'param_groups': groups}


def agree(process_group: Any, error: BaseException | None) -> None:
    """Every rank's verdict on a load (a collective over `process_group`): if any rank refused it, every rank raises,
    the refusing ranks their own error, the others the first refusing rank's, naming that rank."""
    verdicts: list = [None] * dist.get_world_size(process_group)
    mine = None if error is None else (type(error), error.args[0] if len(error.args) == 1 else str(error))
    dist.all_gather_object(verdicts, mine, group=process_group)
    if error is not None: raise error
    for rank, verdict in enumerate(verdicts):
        if verdict is None: continue
        kind, message = verdict
        try: other = kind(f"rank {rank} refused the state_dict: {message}")
        except Exception: other = RuntimeError(f"rank {rank} refused the state_dict ({kind.__name__}): {message}")
        raise other


def sync_hypers(src: list, dst: list) -> None:
    """torch's group sync for the hypers only: each rank's optimizer keeps its own chain and names. ZeRO's own groups
    are plain dicts, which can hold one hyper under both its names (`momentum` given to ZeRO or written by a scheduler
    such as OneCycleLR, and `mom`): copied key by key, the stale one of the two won whenever it came last. Both names
    are kept equal there, and the one written since the last sync is the one copied."""
    if len(src) != len(dst): raise AssertionError("Mismatch between number of source and destination parameter groups")
    for s, d in zip(src, dst):
        for k in [k for k in s if k not in NOT_HYPERS and k not in ALIASES and k not in ALIASES.values()]: d[k] = s[k]
        for alias, canon in ALIASES.items():
            held = [s[k] for k in (canon, alias) if dict.__contains__(s, k)]  # (a ParamGroup holds `canon` only)
            if not held: continue
            now = d.get(canon)
            d[canon] = value = next((v for v in held if not same_value(v, now)), held[0])  # the one written since, if any
            if dict.__contains__(d, alias): d[alias] = value
