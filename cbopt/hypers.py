"""Param groups that are torch's `param_groups` and fastai's `hypers` at once.

torch code (LR schedulers, GradScaler, ZeRO) reads and writes `opt.param_groups[i]`; fastai code (ParamScheduler,
Recorder, ReduceLROnPlateau) reads and writes `opt.hypers[i]`. Both are views of the same `ParamGroup` dict, so
they can never drift apart. torch's names for fastai hypers (`momentum` for `mom`) are kept as true aliases.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from numbers import Number
from typing import Any

import numpy as np
import torch
from fastcore.basics import even_mults
from fastcore.foundation import L

__all__ = ['ParamGroup', 'Hypers', 'expand_hyper', 'NOT_HYPERS', 'ALIASES']

NOT_HYPERS = ('params', 'param_names')  # group entries that are not hypers
ALIASES = {'momentum': 'mom'}           # torch name -> cbopt/fastai name, kept equal in every group


def _plain(v: Any) -> Any:
    "numpy scalars (fastai's schedules produce them) become Python numbers, so checkpoints load with weights_only."
    if isinstance(v, np.generic): return v.item()
    if isinstance(v, np.ndarray) and v.ndim == 0: return v.item()
    return v


class ParamGroup(dict):
    "A torch param group whose aliased keys (`momentum` and `mom`) always hold the same value."
    def __setitem__(self, k, v):
        v = _plain(v)
        canon = ALIASES.get(k, k)
        super().__setitem__(canon, v)
        for alias, c in ALIASES.items():
            if c == canon: super().__setitem__(alias, v)

    def update(self, *args, **kw):
        for k, v in dict(*args, **kw).items(): self[k] = v

    def setdefault(self, k, v=None):
        if ALIASES.get(k, k) not in self: self[k] = v
        return self[k]

    def __reduce__(self): return (ParamGroup, (dict(self),))

    def __copy__(self): return ParamGroup(self)

    def __deepcopy__(self, memo):
        from copy import deepcopy
        return ParamGroup({k: deepcopy(v, memo) for k, v in self.items()})

    def __init__(self, *args, **kw):
        super().__init__()
        self.update(*args, **kw)


class Hypers(MutableMapping):
    "fastai's view of a param group: every entry but the params, names and torch aliases. Reads and writes go through."
    def __init__(self, group: ParamGroup): self.group = group
    def _is_hyper(self, k) -> bool: return k not in NOT_HYPERS and k not in ALIASES
    def __getitem__(self, k):
        if not self._is_hyper(k): raise KeyError(k)
        return self.group[k]
    def __setitem__(self, k, v):
        if k in NOT_HYPERS: raise KeyError(f"{k!r} is not a hyper")
        self.group[k] = v
    def __delitem__(self, k): del self.group[k]
    def __iter__(self) -> Iterator: return (k for k in self.group if self._is_hyper(k))
    def __len__(self) -> int: return sum(1 for _ in self)
    def __repr__(self) -> str: return repr(dict(self))
    def __eq__(self, o) -> bool: return dict(self) == (dict(o) if isinstance(o, Mapping) else o)

    def snapshot(self) -> dict:
        "The hypers as a plain dict, for one step: callbacks get them as keywords, merged per param and callback."
        return {k: v for k, v in self.group.items() if self._is_hyper(k)}


def expand_hyper(k: str, v: Any, n: int) -> list:
    """One value of hyper `k` per group, as fastai's `set_hyper` does: a scalar is repeated, a list/tuple/array
    gives one value per group, `slice(a, b)` is log-spaced from a to b, and `slice(None, b)` is `[b/10]*(n-1) + [b]`."""
    if isinstance(v, slice):
        if v.start: v = even_mults(v.start, v.stop, n)
        else: v = [v.stop / 10] * (n - 1) + [v.stop]
    v = _plain(v)  # numpy scalars (fastai's schedules) have no len(): make them plain numbers first
    if isinstance(v, torch.Tensor) and v.ndim == 0: v = [v]
    v = L(v, use_list=None)
    if len(v) == 1: v = v * n
    if len(v) != n: raise ValueError(f"Trying to set {len(v)} values for {k!r} but there are {n} parameter groups.")
    vals = [_plain(o) for o in v]
    for o in vals:
        if not isinstance(o, (Number, torch.Tensor, str, type(None))):
            raise TypeError(f"hyper {k!r} got a {type(o).__name__}: hypers are numbers (or 0-d tensors)")
    return vals
