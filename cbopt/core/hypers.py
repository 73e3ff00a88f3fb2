"""Param groups that are torch's `param_groups` and fastai's `hypers` at once.

torch code (LR schedulers, GradScaler, ZeRO) reads and writes `opt.param_groups[i]`; fastai code (ParamScheduler,
Recorder, ReduceLROnPlateau) reads and writes `opt.hypers[i]`. Both are views of the same `ParamGroup` dict, so
they can never drift apart. torch's names for fastai hypers (`momentum` for `mom`) are kept as true aliases.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from numbers import Integral, Number, Real
from typing import Any

import numpy as np
import torch
from fastcore.basics import even_mults
from fastcore.foundation import L

from .chain import cached, chain_defaults, chain_name, chain_reads
from .spec import spec

__all__ = ['ParamGroup', 'TorchParamGroup', 'TORCH_FLAGS', 'torch_hyper_names', 'GROUP_ALIASES', 'Hypers', 'expand_hyper', 'check_hyper', 'HYPER_RULES', 'FLAG_HYPERS', 'NOT_HYPERS',
           'ALIASES', 'TORCH_HYPER_NAMES', 'is_known_hyper', 'is_framework_key', 'TORCH_NAMES', 'from_torch_names', 'torch_keywords', 'is_model_entry', 'model_entries']

NOT_HYPERS = ('params', 'param_names', 'cbs', 'chain',  # group entries that are not hypers (a group's own chain, its
              'state_precision', 'min_quantize_size')   # params' names, how it stores its state: cbopt.state.lowbit)
ALIASES = {'momentum': 'mom'}           # torch name -> cbopt/fastai name, kept equal in every group
# torch.optim's group entries and the cbopt hypers they are (a tuple of names takes a sequence of as many values:
# `betas=(0.9, 0.99)` are `mom`, `sqr_mom`), the one table of torch's hyper names: a torch state_dict's groups are read
# with it and cbopt's written for a torch class (`cbopt.state.formats`; a callback whose torch algorithm names a hyper
# otherwise declares it, `cb.torch_names`: ASGD's `alpha` is not RMSprop's), and its `UNIVERSAL` names are accepted
# wherever hypers are given (keywords, group dicts), as they name one hyper in every algorithm
TORCH_HYPER_NAMES: dict[str, str | tuple[str, ...]] = {
    'weight_decay': 'wd', 'betas': ('mom', 'sqr_mom'), 'lr': 'lr', 'eps': 'eps', 'momentum': 'mom', 'alpha': 'sqr_mom',
    'dampening': 'dampening', 'initial_lr': 'initial_lr', 'lr_decay': 'lr_decay', 'rho': 'sqr_mom',
    'momentum_decay': 'momentum_decay', 'lambd': 'lambd', 't0': 't0',
    'initial_accumulator_value': 'initial_accumulator_value'}
# torch's switches in a torch group: algorithm flags (which choose a cbopt chain: `cb.torch_flag`) and implementation
# ones (which choose cbopt's backend); none is a hyper of cbopt's (Muon's `nesterov` is, declared by its callback)
TORCH_FLAGS = ('amsgrad', 'maximize', 'foreach', 'fused', 'capturable', 'differentiable', 'nesterov', 'centered',
               'decoupled_weight_decay')
UNIVERSAL = ('weight_decay', 'betas')  # (`momentum` is a true alias of `mom` in every group: ALIASES)
TORCH_NAMES = {k: TORCH_HYPER_NAMES[k] for k in UNIVERSAL}  # the torch names every optimizer takes as keywords


def torch_hyper_names(cbs) -> dict:
    "torch's group entries -> cbopt's hypers for the chain `cbs`: the common table, and what its callbacks declare."
    names = dict(TORCH_HYPER_NAMES)
    for cb in cbs: names.update(spec(cb).torch_names)
    return names


def from_torch_names(hypers: Mapping, names: Mapping[str, str | tuple[str, ...]] = TORCH_NAMES, where: str = '') -> dict:
    """`hypers` with torch's names (`names`, default `TORCH_NAMES`) replaced by cbopt's: `weight_decay` is `wd`, `betas`
    are `mom` and `sqr_mom`. Giving a hyper under both names with different values is an error (one would silently
    win); so is a `betas` that is not a pair. `where` (' (group 1)') is named in the message."""
    out = {k: v for k, v in hypers.items() if k not in names}
    for k, canon in names.items():
        if k not in hypers: continue
        v = hypers[k]
        if isinstance(canon, tuple):
            if isinstance(v, (str, bytes, Mapping)) or not hasattr(v, '__len__') or len(v) != len(canon):
                raise ValueError(f"{k}{where} must be a sequence of {len(canon)} values ({', '.join(canon)}), got {v!r}")
            pairs = list(zip(canon, v))
        else: pairs = [(canon, v)]
        for c, cv in pairs:
            if c in out and not same_value(out[c], cv):
                raise ValueError(f"{k}={v!r}{where} and {c}={out[c]!r} name one hyper: give one")
            out[c] = cv
    return out


def torch_keywords(**extra: str | tuple[str, ...]) -> Callable:
    """Decorate an optimizer factory with fastai's names so that it also takes torch's as keywords: `weight_decay`,
    `betas`, `momentum`, and `extra`, the factory's own (RMSProp: `alpha='sqr_mom'`). Its signature stays its own."""
    names = {**TORCH_NAMES, 'momentum': 'mom', **extra}
    def decorate(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def with_torch_names(*args, **kwargs): return factory(*args, **from_torch_names(kwargs, names))
        return with_torch_names
    return decorate


def same_value(a: Any, b: Any) -> bool:
    "Whether two hyper values are one: tensors by identity (their values change in place), others by `==`."
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor): return a is b
    return a == b


def is_model_entry(k: Any) -> bool:
    """Whether a group entry is a whole-model callback's state (`'skip_nonfinite.skipped_total'`: a name with a '.'):
    saved with the group and loaded strictly, but not a hyper (no scheduler, fastai or `opt.hypers` sees it)."""
    return isinstance(k, str) and '.' in k


def model_entries(g: Mapping) -> dict:
    "A group's whole-model callback state entries."
    return {k: v for k, v in g.items() if is_model_entry(k)}


def _plain(v: Any) -> Any:
    "numpy scalars (fastai's schedules produce them) become Python numbers, so checkpoints load with weights_only."
    if isinstance(v, np.generic): return v.item()
    if isinstance(v, np.ndarray) and v.ndim == 0: return v.item()
    return v


GROUP_ALIASES = {**ALIASES, 'cbs': 'chain'}  # keys a ParamGroup answers to but holds under another: torch's names of
# hypers, and `cbs`, the group's callbacks, held as `chain` (the entry by which a checkpoint names them)


def _swapped_params(group: dict, params: Any) -> list:
    """`params` written into a group that names its params (`group['params'] = ...`): one for one (accelerate's and
    XLA's swap of each param for its moved copy), each keeps its name; any other count (DeepSpeed-style
    `group['params'] = [flat]`, or ZeroRedundancyOptimizer's copy of a group for one rank) drops the names, which would
    name other params: an optimizer refuses to step or save such a group (`Optimizer._check_groups`), while a copy
    that becomes another optimizer's group is named there anew."""
    params = list(params)
    names = dict.get(group, 'param_names')
    if dict.__contains__(group, 'params') and names is not None and len(params) != len(names):
        dict.__delitem__(group, 'param_names')
    return params


class ParamGroup(dict):
    """A torch param group whose aliased keys (`GROUP_ALIASES`: `momentum` for `mom`, `cbs` for `chain`, the group's
    callbacks) are names of one entry: reading, writing, `in`, `get`, `pop` and `del` of an alias go to the entry it
    names, and the group holds, iterates and copies that entry alone. So a live group has the entries its checkpoint
    keeps (`chain` there is the chain's name), which is how torch's DCP rebuilds a group to load
    (`flatten_optimizer_state_dict`: from the live group's entries).
    Writes are not validated (`check_hyper` runs where hypers are given: construction, `set_hyper`, new groups):
    LR schedulers write `group['lr']` directly every step, as torch's do (torch never validates those writes), and
    `load_state_dict` commits through here after checking everything, at a point where nothing may fail."""
    def __setitem__(self, k, v):
        if k == 'params': v = _swapped_params(self, v)
        if k == 'param_names' and 'params' in self and len(v) != len(self['params']):
            return  # names of other params: ZeroRedundancyOptimizer copies rank 0's group entries into every rank's
        v = _plain(v)
        canon = GROUP_ALIASES.get(k, k)
        if k in ALIASES and v and 'chain' in self and canon not in chain_reads(self['chain']):
            raise ValueError(f"{k}={v} set on a param group whose chain [{chain_name(self['chain'])}] has no {canon!r} "
                             f"(e.g. cbopt.SGD(mom=0) keeps no momentum buffer): it would be ignored. Build the optimizer "
                             f"with a nonzero {canon!r}, or do not schedule it (OneCycleLR(cycle_momentum=False))")
        super().__setitem__(canon, v)

    def __getitem__(self, k): return super().__getitem__(GROUP_ALIASES.get(k, k))
    def __contains__(self, k) -> bool: return super().__contains__(GROUP_ALIASES.get(k, k))
    def get(self, k, default=None): return super().get(GROUP_ALIASES.get(k, k), default)
    def __delitem__(self, k): super().__delitem__(GROUP_ALIASES.get(k, k))
    def pop(self, k, *default): return super().pop(GROUP_ALIASES.get(k, k), *default)

    def update(self, *args, **kw):
        for k, v in dict(*args, **kw).items(): self[k] = v

    def setdefault(self, k, v=None):
        if k not in self: self[k] = v
        return self[k]

    def __reduce__(self): return (ParamGroup, (dict(self),))

    def __copy__(self): return ParamGroup(self)

    def __deepcopy__(self, memo):
        from copy import deepcopy
        return ParamGroup({k: deepcopy(v, memo) for k, v in self.items()})

    def __init__(self, *args, **kw):
        super().__init__()
        self.update(*args, **kw)


_CHAIN_KEYS = ('cbs', 'chain')
_ALGORITHM_FLAGS = ('amsgrad', 'maximize', 'nesterov', 'centered', 'decoupled_weight_decay', 'differentiable')


class TorchParamGroup(ParamGroup):
    """A param group of a `cbopt.optim` class: it holds the entries its torch class's groups hold (`betas`,
    `weight_decay`, its flags), which torch code sees (DCP rebuilds a group to load from the live one's entries; LR
    schedulers write `betas`), and answers to cbopt's hyper names, which the engine and fastai read and write: `mom`
    is `betas[0]`, `wd` is `weight_decay` (`torch_hyper_names` of its chain: the table torch's state_dicts are read
    with), resolved once per chain and set of entries (`_torch_plan`). Its chain (`g['cbs']`) is held beside the
    entries, not as one: torch's groups have none. A hyper with no torch entry is held by cbopt's name (a user's), or
    at its callback's default not held at all (RAdam's `beta`, SAdam's: 0), as torch's groups do not have it."""
    def __init__(self, *args, **kw):
        self.chain_cbs, self._planned = None, None
        super().__init__(*args, **kw)

    def _plan(self) -> tuple[dict, tuple]:
        "`_torch_plan` of this group, kept until an entry is added or removed or the chain changes."
        planned = self._planned
        if planned is None or planned[0] is not self.chain_cbs:
            planned = self._planned = (self.chain_cbs, _torch_plan(tuple(self.chain_cbs or ()), tuple(dict.keys(self))))
        return planned[1]

    def _where(self, k) -> tuple | None:
        "(the held entry, its index or None) that cbopt's hyper `k` is, or None."
        plan = self._plan()[0]
        return plan.get(k) or plan.get(ALIASES.get(k))

    def __getitem__(self, k):
        if k in _CHAIN_KEYS and self.chain_cbs is not None: return self.chain_cbs
        try: return dict.__getitem__(self, k)
        except KeyError: pass
        where = self._where(k)
        if where is None: raise KeyError(k)
        if where[0] is _DEFAULT: return where[1]
        v = dict.__getitem__(self, where[0])
        return v if where[1] is None else v[where[1]]

    def __setitem__(self, k, v):
        if k in _CHAIN_KEYS:
            self.chain_cbs = v
            return
        if k == 'params': v = _swapped_params(self, v)
        if k == 'param_names' and 'params' in self and len(v) != len(self['params']): return  # (see ParamGroup)
        v = _plain(v)
        if v and k in ('mom', 'momentum') and self.chain_cbs is not None and 'mom' not in chain_reads(self.chain_cbs):
            raise ValueError(f"{k}={v} set on a param group whose chain [{chain_name(self.chain_cbs)}] has no momentum: "
                             f"it would be ignored. Build the optimizer with a nonzero momentum, or do not schedule it "
                             f"(OneCycleLR(cycle_momentum=False))")
        if (self.chain_cbs is not None and k in _ALGORITHM_FLAGS and dict.__contains__(self, k) and bool(v) != bool(self[k])
                and k not in torch_hyper_names(self.chain_cbs)):  # (Muon's nesterov is a hyper)
            raise ValueError(f"{k}={v!r} set on a param group that runs {k}={self[k]!r}: a group's algorithm flags choose its "
                             f"chain when it is built; give {k}={v!r} in the group dict (or the constructor)")
        where = None if dict.__contains__(self, k) else self._where(k)
        if where is None or where[0] is _DEFAULT:
            if not dict.__contains__(self, k): self._planned = None  # (a new entry: the plan changes)
            return dict.__setitem__(self, k, v)
        key, i = where
        if i is None: return dict.__setitem__(self, key, v)
        parts = list(dict.__getitem__(self, key))
        parts[i] = v
        dict.__setitem__(self, key, tuple(parts))

    def __contains__(self, k) -> bool:
        if k in _CHAIN_KEYS: return self.chain_cbs is not None
        return dict.__contains__(self, k) or self._where(k) is not None

    def get(self, k, default=None):
        try: return self[k]
        except KeyError: return default

    def __delitem__(self, k):
        if k in _CHAIN_KEYS: self.chain_cbs = None
        else: dict.__delitem__(self, k)
        self._planned = None

    def pop(self, k, *default):
        if dict.__contains__(self, k) or k in _CHAIN_KEYS or not default:
            v = self[k]
            del self[k]
            return v
        return default[0]

    def hyper_keys(self) -> tuple:
        "cbopt's names of the group's hypers (what `Hypers` lists): its torch entries' and the entries with no torch name."
        return self._plan()[1]

    def hyper_snapshot(self) -> dict:
        "The hypers by cbopt's names (`Hypers.snapshot`, once per group and step): the names resolved once for all."
        plan, keys = self._plan()
        out, get = {}, dict.__getitem__
        for k in keys:
            where = plan.get(k)
            if where is None: out[k] = get(self, k)
            elif where[0] is _DEFAULT: out[k] = where[1]
            else: out[k] = get(self, where[0]) if where[1] is None else get(self, where[0])[where[1]]
        return out

    def __reduce__(self): return (_torch_param_group, (dict(self), self.chain_cbs))

    def __copy__(self): return _torch_param_group(dict(self), self.chain_cbs)

    def __deepcopy__(self, memo):
        from copy import deepcopy
        return _torch_param_group({k: deepcopy(v, memo) for k, v in self.items()}, deepcopy(self.chain_cbs, memo))


def _torch_param_group(entries: dict, cbs) -> TorchParamGroup:
    "A `TorchParamGroup` holding `entries`, running `cbs` (for pickling and copies)."
    g = TorchParamGroup(entries)
    g.chain_cbs = cbs
    return g


@cached(maxsize=1024)
def _torch_plan(cbs: tuple, keys: tuple) -> tuple[dict, tuple]:
    """For a torch group holding the entries `keys` with the chain `cbs`: cbopt's hyper name -> (the entry, its index
    in a tuple entry such as `betas`, or None), and cbopt's names of its hypers (for `Hypers`), in order."""
    names, plan, hypers = torch_hyper_names(cbs), {}, []
    for k in keys:
        canon = names.get(k)
        if canon is None:
            if _is_hyper(k) and k not in TORCH_FLAGS: hypers.append(k)
            continue
        for i, c in enumerate(canon) if isinstance(canon, tuple) else [(None, canon)]:
            plan.setdefault(c, (k, i))
            hypers.append(c)
    for k, v in chain_defaults(cbs).items():  # a hyper torch has no entry for, at its callback's default (RAdam's beta)
        if k not in plan and k not in keys: plan[k] = (_DEFAULT, v)
    return plan, tuple(dict.fromkeys([*hypers, *(k for k, w in plan.items() if w[0] is _DEFAULT)]))


_DEFAULT = object()  # (in a `_torch_plan`: a hyper held nowhere, at its callback's default)


class Hypers(MutableMapping):
    "fastai's view of a param group: every entry but the params, names and torch aliases. Reads and writes go through."
    def __init__(self, group: ParamGroup): self.group = group
    def __getitem__(self, k):
        if not _is_hyper(k) or isinstance(self.group, TorchParamGroup) and k not in self.group.hyper_keys(): raise KeyError(k)
        return self.group[k]
    def __setitem__(self, k, v):
        if k in NOT_HYPERS or is_model_entry(k): raise KeyError(f"{k!r} is not a hyper")
        self.group[k] = v
    def __delitem__(self, k): del self.group[k]
    def __iter__(self) -> Iterator: return iter(self._keys())
    def __len__(self) -> int: return len(self._keys())
    def __repr__(self) -> str: return repr(dict(self))

    def _keys(self) -> tuple:
        "The group's hyper names (cbopt's: those of a torch group's entries, `TorchParamGroup.hyper_keys`)."
        g = self.group
        return g.hyper_keys() if isinstance(g, TorchParamGroup) else tuple(k for k in g if _is_hyper(k))

    def snapshot(self) -> dict:
        """The hypers as a plain dict, for one step: callbacks get them as keywords, merged per param and callback.
        A 1-element tensor hyper of any shape (a tensor lr of shape [1] or [1, 1]) is given as a 0-d view of itself,
        which torch's ops take wherever they take a number."""
        g = self.group
        if isinstance(g, TorchParamGroup): out = g.hyper_snapshot()
        else:
            keys = tuple(g)
            if torch.compiler.is_compiling(): hypers = _hyper_keys(keys)  # (not `_KEYS`: dynamo would guard on its
            elif (hypers := _KEYS.get(keys)) is None:                     # contents, and recompile once it changed)
                hypers = _hyper_keys(keys)
                if len(_KEYS) < 256: _KEYS[keys] = hypers
            out = {k: v for k, v in (dict.items(g) if isinstance(g, dict) else g.items()) if k in hypers}  # (held entries)
        if not _PLAIN.issuperset(map(type, out.values())):  # (one C-level test per group and step where none is a tensor)
            for k, v in out.items():
                if isinstance(v, torch.Tensor) and v.ndim: out[k] = v.view(())
        return out


_KEYS: dict = {}  # a group's keys -> its hypers' (`_hyper_keys`), read at every step and group without a call
_PLAIN = frozenset({int, float, bool, str, type(None), tuple})  # hyper values a snapshot gives as they are


@cached(maxsize=256)
def _hyper_keys(keys: tuple) -> frozenset:
    """Which of a group's entries `keys` are hypers (`_is_hyper`), kept per set of keys: a snapshot is taken
    per group at every step, and its groups' keys are almost always the same."""
    return frozenset(filter(_is_hyper, keys))


def _is_hyper(k: Any) -> bool:
    "Whether a group entry is a hyper: not the params, names or chain, not a torch alias, not a whole-model entry."
    return k not in NOT_HYPERS and k not in ALIASES and not is_model_entry(k)


def _is_in(lo: float, hi: float | None = None, hi_open: bool = True) -> Callable[[Any], bool]:
    "`lo <= v` and `v < hi` (or `v <= hi`), false for NaN (every comparison with NaN is)."
    if hi is None: return lambda v: lo <= v
    return (lambda v: lo <= v < hi) if hi_open else (lambda v: lo <= v <= hi)


# name: (the message's start: torch's wording where torch has one; the valid values; a note; their test)
HYPER_RULES: dict[str, tuple[str, str, str, Callable[[Any], bool]]] = {
    'lr':          ('Invalid learning rate', 'lr >= 0', '', _is_in(0)),
    'eps':         ('Invalid epsilon value', 'eps >= 0', '', _is_in(0)),
    'wd':          ('Invalid weight_decay value', 'wd >= 0', "wd is torch's weight_decay", _is_in(0)),
    'mom':         ('Invalid momentum value', '0 <= mom < 1', "mom is torch's momentum, and betas[0] in Adam", _is_in(0, 1)),
    'sqr_mom':     ('Invalid beta parameter at index 1', '0 <= sqr_mom < 1',
                    "sqr_mom is torch's betas[1] in Adam, alpha in RMSprop", _is_in(0, 1)),
    'dampening':   ('Invalid dampening value', '0 <= dampening <= 1', '', _is_in(0, 1, hi_open=False)),
    'beta':        ('Invalid beta value', 'beta >= 0', "SAdam's softplus beta; 0 turns it off", _is_in(0)),
    'nu_1':        ('Invalid nu_1 value', 'a number', '', _is_in(-math.inf)),
    'nu_2':        ('Invalid nu_2 value', 'a number', '', _is_in(-math.inf)),
    'trust_coeff': ('Invalid trust_coeff value', 'trust_coeff >= 0', '', _is_in(0)),
    'alpha':       ('Invalid alpha value', 'a number', "Lookahead's step (Lookahead checks 0..1), ASGD's power",
                    _is_in(-math.inf)),
    'k':           ('Invalid k value', 'an int >= 1', "Lookahead's steps between syncs", _is_in(1)),
    'max_norm':    ('Invalid max_norm value', 'max_norm >= 0', "clip_grad_norm's bound on the total grad norm", _is_in(0)),
    'clip_value':  ('Invalid clip_value value', 'clip_value >= 0', "clip_grad_value's bound on each grad element",
                    _is_in(0)),
    'every':       ('Invalid every value', 'an int >= 1', "accumulate_grads' micro-steps per step", _is_in(1)),
    'max_iter':    ('Invalid max_iter value', 'an int >= 0', "LBFGS's iterations per step", _is_in(0)),
    'history_size': ('Invalid history_size value', 'an int >= 1', "LBFGS's curvature pairs kept", _is_in(1)),
    'tolerance_grad': ('Invalid tolerance_grad value', 'a number', "LBFGS's: inf stops at once, -inf never", _is_in(-math.inf)),
    'tolerance_change': ('Invalid tolerance_change value', 'a number', "LBFGS's: as torch's, any number", _is_in(-math.inf)),
}
INF_OK = ('tolerance_grad', 'tolerance_change')  # thresholds torch's LBFGS compares with: an infinite one is meaningful
INT_HYPERS = ('k', 'every', 'max_iter', 'history_size')
FLAG_HYPERS = ('nesterov', 'clip', 'train_mode', 'in_place')  # on/off switches: bools only
BOOL_OK = ('dampening',)            # a number in torch's SGD, a flag in fastai's `average_grad`: both


def is_framework_key(k: Any, cbs: Any) -> bool:
    """Whether group entry `k` is a framework's own (timm's `lr_scale`, Lookahead's `lookahead_step`), not a hyper of
    the chain `cbs`: no callback of it reads `k` and `k` names no hyper cbopt or torch.optim knows (`is_known_hyper`).
    Such entries are carried as torch carries them: kept in the group, saved in every format, loaded untouched."""
    return (isinstance(k, str) and k not in NOT_HYPERS and not is_model_entry(k) and k not in chain_reads(cbs)
            and not is_known_hyper(k))


def is_known_hyper(k: Any) -> bool:
    """Whether `k` names a hyper somewhere in cbopt or torch.optim (`weight_decay`, `amsgrad`, `mom`, `k`...): a group
    dict's key that no callback of its chain reads is refused if so (it would change the math in another optimizer and
    be silently ignored here), and carried as the caller's own entry otherwise (timm's `lr_scale`)."""
    return k in TORCH_HYPER_NAMES or k in TORCH_FLAGS or k in HYPER_RULES or k in FLAG_HYPERS or k in BOOL_OK or k in ALIASES


def _finite(v: Any) -> bool:
    return bool(torch.isfinite(v).all()) if isinstance(v, torch.Tensor) else math.isfinite(v)


def check_hyper(k: str, v: Any, group: int | None = None) -> None:
    """Raise a clear error if `v` is not a valid value of hyper `k` (`momentum` is checked as `mom`).

    The rules, by name (`HYPER_RULES`), so construction, `set_hyper`/`set_hypers` and new param groups share them:
    - a known numeric hyper (`lr`, `eps`, `wd`, `mom`, `sqr_mom`, `dampening`, `beta`, `nu_1`, `nu_2`, `trust_coeff`,
      `alpha`, `k`) is a real number (numpy scalars are made plain first) or a real 1-element tensor (a tensor lr),
      never a string or None, nor a bool (but `dampening`, a flag in fastai's `average_grad`): else a TypeError
      naming the hyper. It must be finite (NaN and inf are refused)
      and in its range, else a ValueError worded as torch's (`Invalid learning rate: -0.001`) followed by the range.
      The ranges are torch's (`lr`, `eps`, `wd` >= 0; `mom` and `sqr_mom` are Adam's betas: 0 <= beta < 1; torch's
      SGD has no upper bound on momentum, but cbopt's `mom` also weighs moving averages, which a mom >= 1 makes
      diverge), and for hypers torch does not have, the ones that keep the step meaningful. `k` is an int.
    - a flag (`nesterov`, `clip`) is a bool.
    - any other name (a user callback's own hyper) is only type-checked: a number, a tensor, a string or None.
    - entries that are not hypers (`params`, `param_names`, a group's chain) cannot be set as hypers.
    `group` (the group's index) is named in the message when given."""
    if not isinstance(k, str): raise TypeError(f"hyper names are strings, got {k!r} ({type(k).__name__})")
    if k in NOT_HYPERS or is_model_entry(k): raise KeyError(f"{k!r} is not a hyper")
    k = ALIASES.get(k, k)
    where = '' if group is None else f' (group {group})'
    if k in FLAG_HYPERS:
        if not isinstance(v, bool): raise TypeError(f"hyper {k!r}{where} is a flag: True or False, got {v!r} ({type(v).__name__})")
        return
    if k not in HYPER_RULES:
        if not isinstance(v, (Number, torch.Tensor, str, type(None))):
            raise TypeError(f"hyper {k!r}{where} got a {type(v).__name__}: hypers are numbers (or 0-d tensors)")
        return
    start, rule, note, ok = HYPER_RULES[k]
    if isinstance(v, torch.Tensor):
        if v.numel() != 1: raise ValueError(f"Tensor {k} must be 1-element{where}, got shape {tuple(v.shape)}")
        if v.dtype == torch.bool or v.is_complex() or (k in INT_HYPERS and v.is_floating_point()):
            raise TypeError(f"hyper {k!r}{where} got a tensor of dtype {v.dtype}: expected a real number")
    elif (isinstance(v, bool) and k not in BOOL_OK) or not isinstance(v, Integral if k in INT_HYPERS else Real):
        kind = 'an int' if k in INT_HYPERS else 'a number (or a 1-element tensor)'
        raise TypeError(f"hyper {k!r}{where} got a {type(v).__name__} ({v!r}): expected {kind}")
    if not ((_finite(v) or k in INF_OK) and ok(v)): raise ValueError(f"{start}: {v}{where} (expected {rule}, finite{'; ' + note if note else ''})")


def expand_hyper(k: str, v: Any, n: int) -> list:
    """One value of hyper `k` per group, as fastai's `set_hyper` does: a scalar is repeated, a list/tuple/array
    gives one value per group, `slice(a, b)` is log-spaced from a to b, and `slice(None, b)` is `[b/10]*(n-1) + [b]`.
    Every value is checked (`check_hyper`) before any is returned, so a caller that writes the result writes all or
    nothing."""
    if isinstance(k, str) and (k in NOT_HYPERS or is_model_entry(k)): raise KeyError(f"{k!r} is not a hyper")
    if isinstance(v, (set, frozenset)):
        raise TypeError(f"hyper {k!r} got a {type(v).__name__}: a set has no order, give a list (one value per group)")
    if isinstance(v, slice):
        for end in (v.start, v.stop):
            if end is not None: check_hyper(k, _plain(end))
        if v.stop is None or v.step is not None:
            raise ValueError(f"hyper {k!r} got {v!r}: use slice(start, stop) or slice(stop) (fastai's discriminative values)")
        if v.start: v = even_mults(v.start, v.stop, n)
        else: v = [v.stop / 10] * (n - 1) + [v.stop]
    v = _plain(v)  # numpy scalars (fastai's schedules) have no len(): make them plain numbers first
    if v is None or isinstance(v, (str, bytes)) or (isinstance(v, torch.Tensor) and (v.ndim == 0 or v.numel() == 1)):
        v = [v]  # one value: a 1-element tensor of any shape (a tensor lr) is kept as it is, so in-place changes reach the step
    v = L(v, use_list=None)
    per_group = len(v) > 1  # then an error names the group of the bad value
    if len(v) == 1: v = v * n
    if len(v) != n: raise ValueError(f"Trying to set {len(v)} values for {k!r} but there are {n} parameter groups.")
    vals = [_plain(o) for o in v]
    for i, o in enumerate(vals): check_hyper(k, o, i if per_group else None)
    return vals
