"""Strict, atomic loading: `prepare_load` reads any supported checkpoint (`formats`), matches its params to the
optimizer's by name wherever both sides have names (so a checkpoint loads across another grouping or order), by
position otherwise (as torch does), checks everything, and builds the new state aside, so a failed load changes
nothing."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from numbers import Number
from typing import TYPE_CHECKING, Any

import torch

from ..core.chain import chain_name, flat_model_keys, flat_size, transient_keys
from ..core.runtime import param_states, user_stacklevel
from ..core.hypers import NOT_HYPERS, _plain, check_hyper, is_model_entry, model_entries
from ..core.flags import split_flags
from .formats import (TORCH_OPTIONAL_STATE, Checkpoint, Saved, foreign_state_keys, read_checkpoint, torch_hypers, torch_model_state,
                      torch_state)
from ..core.names import canonical_names, is_positional
from ..core.params import distinct_names

from ..core.initial import initial_state
from .save import _copied
from . import lowbit

if TYPE_CHECKING: from ..optimizer import Optimizer

__all__ = ['prepare_load']


def _match(opt: Optimizer, ck: Checkpoint) -> list[Saved]:
    """The checkpoint's param for each of `opt`'s params (in `opt.params` order), each with the index of the
    checkpoint group it was saved in. By name when both sides name their params (wrapper prefixes removed: `names`),
    so the groupings may differ; by position otherwise, as torch does, in the same groups."""
    ours, theirs = opt.param_names, [s.name for s in ck.params]
    if not is_positional(ours) and not is_positional(theirs) and not _group_local_names(ck):
        index: dict[str, Saved] = {}
        for n, s in zip(_unprefixed(canonical_names(theirs), ours), ck.params):
            if n in index: raise ValueError(f"param {n!r} appears twice in the state_dict")
            index[n] = s
        known = set(ours)
        for n in index:
            if n not in known:
                raise KeyError(f"unknown param {n!r} in the state_dict: this optimizer has no such param "
                               f"(it has {', '.join(map(repr, ours[:4]))}{', ...' if len(ours) > 4 else ''})")
        for i, g in enumerate(opt.param_groups):
            for n in g['param_names']:
                if n not in index: raise KeyError(f"param {n!r} (group {i}) is missing from the state_dict")
        return [index[n] for n in ours]
    what = f"the {ck.origin} state_dict" if ck.origin != 'cbopt' else "the state_dict"
    if len(ck.groups) != len(opt.param_groups):
        raise ValueError(f"{what} has {len(ck.groups)} param groups, this optimizer {len(opt.param_groups)} (its params "
                         "have no names to match them by, so they are matched by position, in the same groups)")
    sizes = [len(g['params']) for g in opt.param_groups]
    if ck.sizes is None:
        if len(ck.params) != len(ours):
            raise ValueError(f"{what} has state for {len(ck.params)} params, this optimizer has {len(ours)}")
        return [s._replace(group=gi) for s, gi in zip(ck.params, (i for i, n in enumerate(sizes) for _ in range(n)))]
    for i, (theirs_n, ours_n) in enumerate(zip(ck.sizes, sizes)):
        if theirs_n != ours_n:
            raise ValueError(f"param group {i} has {theirs_n} params in {what}, {ours_n} here (its params have no "
                             "names to match them by, so they are matched by position)")
    return ck.params


def _unprefixed(theirs: list[str], ours: list[str]) -> list[str]:
    """The checkpoint's names `theirs` as ours, when one module prefix tells them apart: an optimizer named from an
    inner module, saved or loaded through the outer one (DCP's `get/set_optimizer_state_dict(outer, opt)` names params
    by the outer module's FQNs, `model.0.weight`; Composer keeps HF models at `self.model`), or the other way round.
    Only a prefix of attribute names (`model.`, `base_model.model.`; not an index, `0.`: `nn.Sequential(model)` is
    another structure, refused) that every name of one side has, making the two sides' names the same sets."""
    mine, seen = set(ours), set(theirs)
    if mine == seen or not theirs or not ours: return theirs
    for long, short, into_ours in ((theirs, mine, True), (ours, seen, False)):
        for n in short:
            if not long[0].endswith('.' + n): continue
            prefix = long[0][:len(long[0]) - len(n)]
            if any(part.isdigit() for part in prefix[:-1].split('.')): continue  # (an index: another structure)
            if all(x.startswith(prefix) for x in long) and {x[len(prefix):] for x in long} == short:
                return [x[len(prefix):] for x in theirs] if into_ours else [prefix + x for x in theirs]
    return theirs


def _group_local_names(ck: Checkpoint) -> bool:
    """Whether the checkpoint's names repeat across its groups but not within one, in torch's layout (integer ids with
    `param_names`): torch's groups built from submodules' `named_parameters()` name a `weight` in every group. Those
    names name no param; torch loads such a checkpoint by position, and so does cbopt. (In the layout keyed by names
    a repeated name is refused: its state would be one entry for two params.)"""
    if ck.by_name: return False
    seen: dict[str, int] = {}
    repeated = False
    for s, n in zip(ck.params, canonical_names([str(s.name) for s in ck.params])):
        if n in seen:
            if seen[n] == s.group: return False  # (within a group: refused by the match by name)
            repeated = True
        seen[n] = s.group
    return repeated


def adopted_names(opt: Optimizer, ck: Checkpoint, matched: list[Saved]) -> list[list[str]] | None:
    """The checkpoint's names for each group's params, when this optimizer's params have none (positions) and the
    checkpoint's, matched by position, have: torch's load keeps a state_dict's `param_names` in the groups that have
    none, so a named checkpoint names an unnamed optimizer's params. None when there is nothing to adopt."""
    theirs = [s.name for s in matched]
    if not is_positional(opt.param_names) or is_positional(theirs) or None in theirs: return None
    names, k = [], 0
    for g in opt.param_groups:
        names.append({'param_names': canonical_names(theirs[k:k + len(g['params'])]) if g['params'] else []})
        k += len(g['params'])
    distinct_names(names)
    if len({n for g in names for n in g['param_names']}) != len(theirs): return None  # (repeated within a group: keep ours)
    return [g['param_names'] for g in names]


def _check_chains(opt: Optimizer, ck: Checkpoint, matched: list[Saved], aligned: bool) -> None:
    "Each param's state was saved by the chain its group runs here (when the checkpoint says: cbopt's do)."
    k = 0
    for i, g in enumerate(opt.param_groups):
        mine = chain_name(g['cbs'])
        for name in g['param_names']:
            theirs = ck.groups[matched[k].group].get('chain', mine)
            k += 1
            if theirs == mine: continue
            what = f"param group {i} ({', '.join(map(repr, g['param_names']))})" if aligned else f"param {name!r} (group {i})"
            raise ValueError(f"{what} was saved by the chain [{theirs}], but runs [{mine}] here: its state belongs to "
                             "another algorithm")


def _from_torch(opt: Optimizer, ck: Checkpoint, matched: list[Saved]) -> tuple[Checkpoint, list[Saved]]:
    """A torch.optim checkpoint's groups and states by cbopt's names, each read with the chain of the group its params
    load into (callbacks declare torch's names for theirs)."""
    where = [i for i, g in enumerate(opt.param_groups) for _ in g['params']]
    dest = {}
    for s, i in zip(matched, where): dest.setdefault(s.group, i)
    chains = [opt.param_groups[dest.get(j, min(j, len(opt.param_groups) - 1))]['cbs'] for j in range(len(ck.groups))]
    groups = [torch_hypers(j, g, cbs) for j, (g, cbs) in enumerate(zip(ck.groups, chains))]
    for j, cbs in enumerate(chains):  # whole-model state torch keeps under a group's first param (LBFGS's)
        first = next((s for s in ck.params if s.group == j), None)
        groups[j].update(torch_model_state(first.state if first else {}, cbs))
    matched = [s._replace(state=torch_state(s.state, opt.param_groups[i]['cbs'])) for s, i in zip(matched, where)]
    return ck._replace(groups=groups), matched


def _aligned(opt: Optimizer, ck: Checkpoint, matched: list[Saved]) -> bool:
    "Whether the checkpoint's groups are this optimizer's: as many, each with the same params."
    if len(ck.groups) != len(opt.param_groups): return False
    groups = [i for i, g in enumerate(opt.param_groups) for _ in g['params']]
    return all(s.group == gi for s, gi in zip(matched, groups))


def _regrouped_hypers(opt: Optimizer, ck: Checkpoint, matched: list[Saved]) -> list[dict]:
    """Each group's hypers when the checkpoint grouped its params otherwise: those of the checkpoint groups its params
    come from. A hyper they disagree on keeps this optimizer's value (with a warning naming it)."""
    out, k = [], 0
    for i, g in enumerate(opt.param_groups):
        sources = sorted({matched[k + j].group for j in range(len(g['params']))})
        k += len(g['params'])
        merged: dict = {}
        for key in dict.fromkeys(key for s in sources for key in ck.groups[s]):
            if key in NOT_HYPERS or is_model_entry(key): continue
            values = [ck.groups[s][key] for s in sources if key in ck.groups[s]]
            if all(v == values[0] for v in values) and len(values) == len(sources): merged[key] = values[0]
            elif key in g:
                warnings.warn(f"group {i}'s params come from checkpoint groups {sources}, which give {key!r} the values "
                              f"{values}: group {i} keeps its own {key}={g[key]!r}", stacklevel=user_stacklevel())
        out.append(merged)
    return out


def _pooled_model_entries(ck: Checkpoint) -> tuple[dict, dict]:
    """Whole-model callbacks' state of a checkpoint grouped otherwise: each entry is one callback's, wherever it was;
    and the checkpoint group each came from."""
    pool, source = {}, {}
    for i, g in enumerate(ck.groups):
        for k, v in model_entries(g).items():
            if k in pool: raise ValueError(f"whole-model callback state {k!r} is in several groups of the state_dict, "
                                           "which groups its params otherwise than this optimizer: cannot tell whose it is")
            pool[k], source[k] = v, i
    return pool, source


def _in_our_order(where: str, entries: dict, group: Mapping, saved: list[Saved], ck: Checkpoint,
                  source: Mapping[str, int]) -> dict:
    """`entries` (whole-model state loaded into `group`) with those flat over the group's params (`cb.flat_state`:
    L-BFGS's history, each param's slice after the other) put from the order of the checkpoint group they were saved in
    (`source[key]`) into this group's: `saved` is the checkpoint's param for each of the group's params, in order. By
    position (no names) the orders are the same. Refused, naming the entry, when its length is not this group's
    params' or its checkpoint group held other params: a history of other params must not load as this one's."""
    sizes = [flat_size(p) for p in group['params']]
    at = [s.at for s in saved]
    # which of ours is the checkpoint's 1st, 2nd... param (None: the format does not say, fastai's)
    order = sorted(range(len(at)), key=at.__getitem__) if None not in at else None
    out = dict(entries)
    for key in sorted(flat_model_keys(group['cbs']) & set(entries)):
        value = entries[key]
        if value is None: continue
        vectors = list(value) if isinstance(value, (list, tuple)) else [value]
        for v in vectors:
            if not isinstance(v, torch.Tensor) or v.shape != (sum(sizes),):
                raise ValueError(f"whole-model callback state {key!r} ({where}) has shape "
                                 f"{tuple(getattr(v, 'shape', ()))} in the state_dict, but this group's params have "
                                 f"{sum(sizes)} elements: it is the state of other params")
        if order is None or at == sorted(at): continue  # the same order
        theirs = [s for s in ck.params if s.group == source[key]]
        if any(s.group != source[key] for s in saved) or sorted(at) != list(range(len(theirs))):
            raise ValueError(f"whole-model callback state {key!r} ({where}) is flat over the params of the state_dict's "
                             f"group {source[key]}, which are not this group's: it cannot be put in their order")
        def ours(v: torch.Tensor) -> torch.Tensor:
            pieces = dict(zip(order, v.split([sizes[k] for k in order])))
            return torch.cat([pieces[k] for k in range(len(sizes))])
        out[key] = type(value)(map(ours, vectors)) if isinstance(value, (list, tuple)) else ours(value)
    return out


def _load_value(what: str, value: Any, like: Any) -> Any:
    """`value` from a checkpoint made like `like` (this optimizer's own value): same kind, shape, device and dtype.
    `what` names it in errors (`state 'mom' of param '0.weight'`, `whole-model callback state 'warmup.iter' (group 0)`)."""
    if isinstance(like, torch.Tensor):
        if isinstance(value, Number) and not isinstance(value, bool) and like.ndim == 0:  # a number kept as a 0-d tensor
            return torch.tensor(value, dtype=like.dtype, device=like.device)  # now (schedule-free's sums): old checkpoints
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what} is a {type(value).__name__} in the state_dict, a Tensor here")
        if value.shape != like.shape:
            raise ValueError(f"{what} has shape {tuple(value.shape)} in the state_dict, "
                             f"{tuple(like.shape)} here")
        if (value.is_floating_point(), value.is_complex()) != (like.is_floating_point(), like.is_complex()):
            raise TypeError(f"{what} has dtype {value.dtype} in the state_dict, {like.dtype} here")
        return value.detach().to(device=like.device, dtype=like.dtype, copy=True)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and isinstance(like, Number): value = value.item()
    if isinstance(like, Number) and not isinstance(value, Number):
        raise TypeError(f"{what} is a {type(value).__name__} in the state_dict, a number here")
    return type(like)(value) if isinstance(like, Number) and not isinstance(like, bool) else _copied(value)


def prepare_load(opt: Optimizer, sd: Any) -> tuple[dict, list]:
    """Check `sd` against `opt` and build the state to load, without touching `opt`.
    Returns `({param: algorithm state}, [hypers per group])`, the first with the checkpoint's state entries that are
    no param's (`Checkpoint.others`: torch loads them as they are) under their own keys; raises an error naming the param on any mismatch.
    A param with state here but none in `sd` raises, even when `sd` holds no state at all (a checkpoint of a fresh
    optimizer): `opt.clear_state()` first restarts it on purpose (as cbopt's fastai `LRFindRestore` does for lr_find)."""
    ck = read_checkpoint(sd)
    matched = _match(opt, ck)
    for k in ck.unlisted:
        raise KeyError(f"unknown param {k!r} in the state_dict's state: no group of the state_dict lists it")
    stored_as = [g.get('state_precision', 'fp32') if isinstance(g, Mapping) else 'fp32' for g in ck.groups]  # (low-bit)
    if ck.origin == 'torch': ck, matched = _from_torch(opt, ck, matched)
    aligned = _aligned(opt, ck, matched)
    _check_chains(opt, ck, matched, aligned)
    new_state, expected_cache, k = {}, {}, 0
    for gi, g in enumerate(opt.param_groups):
        for name, p in zip(g['param_names'], g['params']):
            saved, fmt, k = split_flags(matched[k].state)[0], stored_as[matched[k].group], k + 1
            saved = {key: v for key, v in saved.items() if key not in transient_keys(g['cbs'])}  # older checkpoints saved them
            saved = lowbit.logical(saved, p, fmt, f"param {name!r}")  # (low-bit entries: one `Packed` each, checked)
            cur, flags = split_flags(param_states(opt).get(p, {}))
            cur = lowbit.logical(cur, p, lowbit.precision(g), f"param {name!r}", like=True)
            if cur and not saved:
                raise ValueError(f"the state_dict has no state for param {name!r}, which has state here "
                                 f"({sorted(cur)}): loading it would silently restart {name!r}; call clear_state() first")
            if not saved:
                new_state[p] = {}
                continue
            if cur:  # (less a framework's own entries: only when an entry has a name no cbopt callback's state has)
                foreign = foreign_state_keys(cur, ()) and foreign_state_keys(cur, _chain_keys(opt, p, g))
                expected = {key: v for key, v in cur.items() if key not in foreign}
            else:
                key = (gi, p.shape, p.dtype, p.device, tuple(sorted(flags.items())))
                if key not in expected_cache: expected_cache[key] = initial_state(opt, p, g, template=True)
                expected = expected_cache[key]
            if ck.origin == 'torch':
                saved = {key: v for key, v in saved.items() if key in expected or key not in TORCH_OPTIONAL_STATE}
            carried = foreign_state_keys(saved, expected)  # a framework's own entries (timm Lookahead's): as they are
            saved_algo = {key: v for key, v in saved.items() if key not in carried}
            if set(saved_algo) != set(expected):
                if not expected: raise ValueError(f"the state_dict has state {sorted(saved)} for param {name!r}, "
                                                  f"but this optimizer keeps no state for it")
                raise ValueError(f"param {name!r} has state keys {sorted(saved)} in the state_dict but {sorted(expected)} "
                                 "here: it was saved by a different algorithm")
            plan, kinds = lowbit.param_plan(g, p), lowbit.chain_kinds(tuple(g['cbs']))
            new_state[p] = lowbit.stored({key: lowbit.load_entry(
                saved[key], expected[key], p, plan, key, kinds,
                lambda v, key=key: _load_value(f"state {key!r} of param {name!r}", v, expected[key])) for key in expected}, p, plan)
            new_state[p].update((key, _carried(saved[key], p)) for key in carried)
    new_state.update(ck.others)
    groups = ck.groups if aligned else _regrouped_hypers(opt, ck, matched)
    hypers = [{key: _plain(v) for key, v in g.items() if key not in NOT_HYPERS and not is_model_entry(key)} for g in groups]
    for i, h in enumerate(hypers):  # a corrupt checkpoint must not load a NaN lr
        for key, v in h.items(): check_hyper(key, v, i)
        for key, v in h.items():  # a tensor hyper (lr) where the group steps: torch's kernels take it on their device
            if isinstance(v, torch.Tensor): h[key] = _hyper_tensor(v, opt.param_groups[i].get(key), opt.param_groups[i])
    if (names := adopted_names(opt, ck, matched)) is not None:
        for h, n in zip(hypers, names): h['param_names'] = n
    if ck.origin == 'cbopt' or any(model_entries(g) for g in ck.groups):  # torch's and fastai's have none: ours stay
        starts = [0]
        for g in opt.param_groups: starts.append(starts[-1] + len(g['params']))
        saved = [matched[a:b] for a, b in zip(starts, starts[1:])]  # the checkpoint's params of each of our groups
        if aligned:
            for i, (h, g, mine) in enumerate(zip(hypers, ck.groups, opt.param_groups)):
                loaded = _on_params_device(_model_entries(f"group {i}", model_entries(g), model_entries(mine)), mine)
                h.update(_in_our_order(f"group {i}", loaded, mine, saved[i], ck, dict.fromkeys(loaded, i)))
        else:
            ours = {key: v for g in opt.param_groups for key, v in model_entries(g).items()}
            pool, source = _pooled_model_entries(ck)
            loaded = _model_entries("any group", pool, ours)
            for i, (h, mine) in enumerate(zip(hypers, opt.param_groups)):
                entries = _on_params_device({key: loaded[key] for key in model_entries(mine)}, mine)
                h.update(_in_our_order(f"group {i}", entries, mine, saved[i], ck, source))
    return new_state, hypers


def _chain_keys(opt: Optimizer, p: torch.Tensor, g: Mapping) -> set:
    "The state entries `g`'s chain keeps for `p` (as declared, or as a first step creates them): its algorithm's."
    return set(initial_state(opt, p, g, template=True))


def _carried(value: Any, p: torch.Tensor) -> Any:
    """A framework's own state entry (`formats.foreign_state_keys`) as torch loads one: a copy, a floating-point tensor
    on the param's device in its dtype, any other tensor on its device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=p.device, dtype=p.dtype if value.is_floating_point() else value.dtype, copy=True)
    return _copied(value)


def _model_entries(where: str, theirs: Mapping, ours: Mapping) -> dict:
    """Whole-model callbacks' state from a checkpoint (`where`: 'group 0', or 'any group' when regrouped): exactly the
    entries this optimizer keeps (an unknown or missing one is an error naming it), each a value of the same kind."""
    for k in theirs:
        if k not in ours: raise KeyError(f"unknown whole-model callback state {k!r} in the state_dict's {where}: "
                                         f"this optimizer keeps {sorted(ours) or 'none'} there")
    for k in ours:
        if k not in theirs: raise KeyError(f"whole-model callback state {k!r} ({where}) is missing from the state_dict")
    return {k: None if theirs[k] is None else _load_value(f"whole-model callback state {k!r} ({where})", theirs[k], ours[k]) for k in ours}  # None: not yet


def _hyper_tensor(v: torch.Tensor, current: Any, group: Mapping) -> torch.Tensor:
    """A tensor hyper from a checkpoint (a tensor `lr`), copied to where the group keeps it: the device of its current
    value if a tensor, else of its params (torch's fused kernels take a tensor lr on the params' device: one left on
    the CPU by `torch.load(map_location='cpu')` would leave the kernel for a slower path). A copy, as torch's load
    deep-copies the groups: the checkpoint's tensor is never the group's."""
    where = current if isinstance(current, torch.Tensor) else next(iter(group['params']), None)
    device = where.device if where is not None else v.device
    return v.detach().to(device=device, copy=True)


def _on_params_device(entries: dict, group: Mapping) -> dict:
    """Whole-model state loaded into `group` with every tensor, in lists too (L-BFGS's `d`, `old_dirs`, `old_stps`,
    `prev_flat_grad`, `ro`, `H_diag`), on the group's params' device, floating ones in their dtype: torch's rule for the
    state it keeps under a param (`Optimizer._process_value_according_to_param_policy`), as the entry has no template
    here (None or [] before a first step; an entry this optimizer holds as a tensor loads as that tensor is, by
    `_load_value`). A checkpoint read with `torch.load(map_location='cpu')` then steps on
    CUDA params without a device mismatch."""
    p0 = next(iter(group['params']), None)
    if p0 is None: return entries
    dtype = p0.dtype if p0.is_floating_point() else None

    def moved(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if v.device == p0.device and (dtype is None or not v.is_floating_point() or v.dtype == dtype): return v
            return v.to(device=p0.device, dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
        if isinstance(v, (list, tuple)): return type(v)(moved(o) for o in v)
        return v
    return {k: v if isinstance(group.get(k), torch.Tensor) else moved(v) for k, v in entries.items()}  # (else: as `like`)
