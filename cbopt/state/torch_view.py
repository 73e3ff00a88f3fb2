"""A live optimizer's state by torch's names: what `opt.state` shows for `cbopt.optim`'s classes.

The engine keeps each param's state by cbopt's names (`grad_avg`, `step` a Python number), which its buckets, kernels
and compiled chains read at every step. torch code (DCP's flattened state_dicts, torch's own optimizer tests, a user's
`opt.state[p]['exp_avg']`) reads a torch class's names (`exp_avg`, `step` a 0-d float tensor). `TorchState` is that
view over the engine's own dicts (`cbopt.core.runtime.param_states`): the names come from what the group's callbacks
declare (`cb.torch_state`, `cb.torch_extra_state`: `formats.torch_state_names`, as a torch state_dict is read and
written with), resolved once per chain, so the renaming costs a step nothing: only a read or a write through the view
pays for it. A chain's whole-model state that torch keeps under a group's first param (L-BFGS's history, kept by
cbopt in the group's entries `'lbfgs.*'`) is shown there by torch's names once the group has stepped, and written back
to the group. Tensors are the engine's own (an in-place change through the view reaches the step); `step` (and ASGD's
`eta`, `mu`, which cbopt computes from it) are made as torch keeps them when read, and written back as the engine's
numbers.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

import torch

from ..core.chain import cached, chain_counters, is_model_cb, model_key, param_chain
from ..core.hypers import Hypers
from ..core.runtime import param_states
from ..core.spec import spec
from .formats import torch_state_names
from .lowbit import stored_base, stored_part

__all__ = ['TorchState', 'TorchParamState', 'StateNames', 'state_names', 'torch_scalar', 'PYTHON_STEPS']


class StateNames(NamedTuple):
    "One chain's state names: torch's -> cbopt's, cbopt's -> torch's, its counters (with their types), its extra state."
    from_torch: dict
    to_torch: dict
    counters: dict
    extras: tuple  # functions of the state and hypers giving entries torch keeps and cbopt computes (ASGD's eta, mu)
    # torch's name -> (the group entry, its initial value) of whole-model state torch keeps under a group's first param
    # (`cb.torch_model_state`: L-BFGS's history)
    model: dict = {}


@cached(maxsize=256)
def state_names(cbs: tuple) -> StateNames:
    "The torch names of the chain `cbs`' state, as its callbacks declare them: resolved once per chain."
    from_torch = torch_state_names(cbs)
    extras = tuple(f for cb in cbs if (f := spec(cb).torch_extra_state) is not None)
    model = {theirs: (model_key(cb, ours), spec(cb).state.get(ours)) for cb in cbs if is_model_cb(cb)
             for theirs, ours in spec(cb).torch_model_state.items() if ours is not None}
    return StateNames(from_torch, {ours: theirs for theirs, ours in from_torch.items()}, chain_counters(param_chain(cbs)),
                      extras, model)


def _model_view(names: StateNames, group: Mapping) -> dict:
    """The whole-model state torch keeps under the group's first param, by torch's names (L-BFGS's `func_evals`, `d`,
    `old_dirs`...), once the group has stepped (an entry off its initial value: before, torch's state is empty too);
    entries not made yet (None) are left out, as torch has not made them."""
    values = {theirs: group.get(key, first) for theirs, (key, first) in names.model.items()}
    if all(v is first or (type(v) in (int, float) and v == first) or (isinstance(v, (list, tuple)) and not v and not first)
           for v, (_, first) in zip(values.values(), names.model.values())): return {}
    return {k: v for k, v in values.items() if v is not None}


PYTHON_STEPS = frozenset({'SparseAdam'})  # torch classes that keep their step count a Python int


def torch_scalar(v: Any, p: torch.Tensor, group: Mapping) -> torch.Tensor:
    """A number of a param's state (its step count, ASGD's `eta`) as torch's optimizers keep it: a 0-d tensor of torch's
    scalar dtype (float32; float64 when that is the default dtype, as torch's `_get_scalar_dtype`; float32 with
    `fused`), on the param's device with `capturable` or `fused`, on the CPU otherwise. A new tensor (a copy)."""
    fused, on_param = bool(group.get('fused')), bool(group.get('capturable')) or bool(group.get('fused'))
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 and not fused else torch.float32
    device = p.device if on_param else torch.device('cpu')
    if isinstance(v, torch.Tensor): return v.detach().to(dtype=dtype, device=device, copy=True)
    return torch.tensor(float(v), dtype=dtype, device=device)


class TorchParamState(MutableMapping):
    """One param's state by torch's names (see the module docstring), over the engine's dict `raw`. cbopt's names
    are read and written too (as aliases), but never listed."""
    __slots__ = ('raw', 'names', 'p', 'group', 'numbers', 'first')

    def __init__(self, raw: dict, names: StateNames, p: torch.Tensor, group: Mapping, numbers: bool = False):
        self.raw, self.names, self.p, self.group, self.numbers = raw, names, p, group, numbers  # numbers: PYTHON_STEPS
        self.first = bool(names.model) and group['params'][0] is p  # (it shows the group's whole-model state)

    def _extras(self) -> dict:
        if self.first: return _model_view(self.names, self.group)
        if not self.names.extras or 'step' not in self.raw: return {}
        values = {**Hypers(self.group).snapshot(), **self.raw}
        return {k: v for f in self.names.extras for k, v in f(**values).items()}

    def __getitem__(self, k: str) -> Any:
        ours = _renamed(k, self.names.from_torch)
        if ours not in self.raw:
            extra = self._extras()
            if k in extra: return extra[k] if self.first else torch_scalar(extra[k], self.p, self.group)
            raise KeyError(k)
        v = self.raw[ours]
        return torch_scalar(v, self.p, self.group) if ours in self.names.counters and not self.numbers else v

    def __setitem__(self, k: str, v: Any) -> None:
        ours = _renamed(k, self.names.from_torch)
        if ours in self.names.counters:  # the engine's counter: a number of its declared type (a tensor, if traced)
            n = v.item() if isinstance(v, torch.Tensor) else v
            # (a traced step's count is a new tensor, not written into: its storage may be its bucket's, see
            # `engine.traced._share_counts`; a new tensor fails the compiled step's guards, which traces again)
            if isinstance(cur := self.raw.get(ours), torch.Tensor):
                self.raw[ours] = torch.tensor(float(n), dtype=cur.dtype, device=cur.device)
            else: self.raw[ours] = self.names.counters[ours](n)
        elif self.first and k in self.names.model: self.group[self.names.model[k][0]] = v  # (the group's entry)
        elif k in self._extras(): return  # (computed from the step count and hypers: nothing to keep)
        else: self.raw[ours] = v

    def __delitem__(self, k: str) -> None: del self.raw[_renamed(k, self.names.from_torch)]

    def __iter__(self) -> Iterator[str]:
        to_torch = self.names.to_torch
        yield from (_renamed(k, to_torch) for k in self.raw)
        yield from self._extras()

    def __len__(self) -> int: return len(self.raw) + len(self._extras())

    def __contains__(self, k: object) -> bool:
        return _renamed(k, self.names.from_torch) in self.raw or ((bool(self.names.extras) or self.first) and
                                                              k in self._extras())

    def __repr__(self) -> str: return repr(dict(self.items()))


def _renamed(k: Any, names: Mapping) -> Any:
    "A state key by the other side's names (`names`), a low-bit entry's parts too: `'exp_avg.codes'` <-> `'grad_avg.codes'`."
    part = stored_part(k) if isinstance(k, str) else None
    if part is None: return names.get(k, k)
    base = stored_base(k)
    return f'{names.get(base, base)}.{part}'


_WHERE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # opt -> (its groups' layout, {id(param): group})


def _group_of(opt, p: torch.Tensor) -> Mapping | None:
    "The param group holding `p` (kept per optimizer while its groups hold the same params)."
    groups = opt.param_groups
    key = tuple((id(g), len(g['params'])) for g in groups)
    known = _WHERE.get(opt)
    if known is None or known[0] != key:
        known = _WHERE[opt] = (key, {id(q): g for g in groups for q in g['params']})
    return known[1].get(id(p))


def _listed(k: Any, st: Any) -> bool:
    "Whether `opt.state` lists the entry: a param with state, or an entry that is no param's (a state_dict hook's)."
    return bool(st) or not isinstance(k, torch.Tensor)


def _holding_model_state(opt) -> set:
    "The ids of the first params of groups whose whole-model state torch keeps under them and that have stepped."
    return {id(g['params'][0]) for g in opt.param_groups
            if g['params'] and (names := state_names(tuple(g['cbs']))).model and _model_view(names, g)}


class TorchState(MutableMapping):
    """`opt.state` of a `cbopt.optim` optimizer: param -> its state by its torch class's names (`TorchParamState`),
    over the engine's dicts. As torch's `defaultdict(dict)`, reading a param with no state gives an empty one; the
    params listed (iterating, `len`, `in`) are those with state, as torch's (the engine keeps an empty dict for a
    param whose chain keeps nothing: SGD without momentum)."""
    __slots__ = ('opt',)

    def __init__(self, opt): self.opt = opt

    def _view(self, p: torch.Tensor, raw: Any) -> Any:
        g = _group_of(self.opt, p) if isinstance(p, torch.Tensor) else None
        if g is None: return raw  # (not a param of the optimizer, or an entry that is no param's: as it is)
        return TorchParamState(raw, state_names(tuple(g['cbs'])), p, g, type(self.opt).__name__ in PYTHON_STEPS)

    def __getitem__(self, p: torch.Tensor) -> Mapping: return self._view(p, param_states(self.opt)[p])

    def get(self, p: torch.Tensor, default: Any = None) -> Any:
        return self[p] if p in self else default

    def __setitem__(self, p: torch.Tensor, state: Mapping) -> None:
        raw = param_states(self.opt)
        if not isinstance(p, torch.Tensor):  # an entry that is no param's (a state_dict hook's): kept as it is
            raw[p] = state
            return
        new = {}
        view = self._view(p, new)
        counters = getattr(view, 'names', None)
        counters = () if counters is None else [k for k, ours in counters.from_torch.items() if ours in counters.counters]
        for k, v in sorted(state.items(), key=lambda kv: kv[0] not in counters): view[k] = v  # (the step first: the
        # entries computed from it are then known, and not kept)
        raw[p] = new

    def __delitem__(self, p: torch.Tensor) -> None: del param_states(self.opt)[p]
    def __iter__(self) -> Iterator[torch.Tensor]:
        firsts = _holding_model_state(self.opt)
        return (p for p, st in param_states(self.opt).items() if _listed(p, st) or id(p) in firsts)

    def __len__(self) -> int: return sum(1 for _ in self)

    def __contains__(self, p: object) -> bool:
        raw = param_states(self.opt)
        return p in raw and (_listed(p, raw[p]) or id(p) in _holding_model_state(self.opt))
    def __repr__(self) -> str: return repr({p: self[p] for p in self})
