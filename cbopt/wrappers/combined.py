"""`CombinedOptimizer`: several cbopt optimizers as one, torchrec's way (`torchrec.optim.CombinedOptimizer`).

torchrec combines `[("enc", opt1), ("head", opt2)]` (or bare optimizers, prefix `""`) into one optimizer whose
state_dict keys are the children's keys prefixed `f"{prefix}.{key}"` (a bare child's keys as they are), and refuses a
key that two children would share ("Duplicate param key"). cbopt keeps those names, that signature and that key rule,
but since every cbopt param group carries its own chain, the result is ONE `cbopt.Optimizer` whose groups are the
children's groups, in order, each with its own chain and hypers: a real `torch.optim.Optimizer`, so LR schedulers,
GradScaler, step hooks and fastai's hypers reach every group, and one `step()` runs every chain with one backend.

As a fastai `opt_func` (one child per splitter group), cbopt's fastai integration names the params by the Learner's
model FQNs, as it names every optimizer a Learner creates, so a Learner checkpoint is keyed like `model.state_dict()`.

The children are consumed: their state moves into the combined optimizer (the same dicts, as `Lookahead` does), while
their groups are copied, so step, schedule and checkpoint the combined one only.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastcore.foundation import L

from ..core.chain import chain_name, chain_reads
from ..engine import Backend
from ..core.hypers import ALIASES, Hypers
from ..optimizer import Optimizer
from ..core.runtime import param_states
from ..state.lowbit import group_settings

__all__ = ['CombinedOptimizer', 'prepend_opt_key']


def prepend_opt_key(name: str, prefix: str) -> str:
    "torchrec's key rule: `prefix.name`, or `name` alone for the empty prefix (a child given without one)."
    return prefix + ('.' if prefix else '') + name


def _as_pairs(optims: Sequence) -> list[tuple[str, Optimizer]]:
    "Each child as `(prefix, optimizer)`: a bare optimizer gets the prefix `''` (torchrec's rule); checked."
    if isinstance(optims, (Optimizer, torch.optim.Optimizer)) or not isinstance(optims, Sequence):
        raise TypeError("CombinedOptimizer takes a list of optimizers or (prefix, optimizer) pairs, "
                        f"got {type(optims).__name__}")
    pairs = []
    for i, item in enumerate(optims):
        prefix, opt = item if isinstance(item, tuple) and len(item) == 2 else ('', item)
        if not isinstance(prefix, str): raise TypeError(f"optimizer {i}'s prefix must be a str, got {prefix!r}")
        where = f"optimizer {i}" + (f" ({prefix!r})" if prefix else '')
        if not isinstance(opt, Optimizer):
            what = type(opt).__module__ + '.' + type(opt).__qualname__
            raise TypeError(f"{where} is a {what}, not a cbopt optimizer: CombinedOptimizer keeps each child's chain "
                            "and named state, so build it with cbopt (cbopt.SGD, cbopt.Adam, cbopt.Adagrad, ..., or "
                            "cbopt.Optimizer(params, callbacks))")
        if getattr(opt, 'in_backward', False):
            raise TypeError(f"{where} steps in backward (cbopt.InBackward): its hooks would keep stepping it alone; "
                            "combine the plain optimizers, then wrap the combined one: InBackward(CombinedOptimizer(...))")
        pairs.append((prefix, opt))
    if not pairs: raise ValueError("CombinedOptimizer got no optimizers")
    seen: dict[str, int] = {}
    for i, (prefix, _) in enumerate(pairs):
        if prefix and prefix in seen:
            raise ValueError(f"prefix {prefix!r} is given to optimizers {seen[prefix]} and {i}: prefixes name the children")
        seen.setdefault(prefix, i)
    return pairs


class CombinedOptimizer(Optimizer):
    """One optimizer over several: `CombinedOptimizer([("enc", opt1), ("head", opt2)])` (torchrec's signature; a bare
    optimizer in the list has the prefix `''`). Its groups are the children's, in order, each with its own chain and
    hypers, its params named `f"{prefix}.{name}"`; the children's state is carried over. `backend` defaults to the first
    child's. A name two children would share, a param in two children, or a repeated prefix is an error naming them."""

    def __init__(self, optims: Sequence[Optimizer | tuple[str, Optimizer]], backend: str | Backend | None = None):
        pairs = _as_pairs(optims)
        owner: dict[int, tuple[str, str]] = {}  # id(param) -> (prefix, name in its child)
        keys: dict[str, str] = {}               # combined name -> which child names it so
        groups, self.group_prefixes = [], []
        for i, (prefix, opt) in enumerate(pairs):
            child = f"optimizer {i}" + (f" ({prefix!r})" if prefix else ' (no prefix)')
            for g in opt.param_groups:
                keys_, params_ = [], []
                for name, p in zip(g['param_names'], g['params']):
                    if id(p) in owner:
                        other, oname = owner[id(p)]
                        raise ValueError(f"param {oname!r} of optimizer {other!r} is also param {name!r} of optimizer "
                                         f"{prefix!r}: a param steps in one optimizer only")
                    key = prepend_opt_key(name, prefix)
                    if key in keys:
                        raise ValueError(f"Duplicate param key {key!r}: {keys[key]} and {child} both name a param so; "
                                         "give them distinct prefixes")
                    owner[id(p)], keys[key] = (prefix, name), child
                    keys_.append(key), params_.append(p)
                hypers = Hypers(g).snapshot()  # (no torch aliases: `momentum` is `mom`)
                groups.append({'params': params_, 'param_names': keys_, **hypers, 'cbs': list(g['cbs']),
                               **group_settings(g)})  # (low-bit state: as the child stores it)
                self.group_prefixes.append(prefix)
        first = pairs[0][1]
        super().__init__(groups, [], backend=first.backend_options if backend is None else backend)
        defaults: dict = {}
        for _, opt in reversed(pairs): defaults.update(opt.defaults)  # the first child's win: schedulers read them
        self.defaults = defaults
        for _, opt in pairs:
            for p in opt.params:
                if p in param_states(opt): param_states(self)[p] = param_states(opt)[p]

    def add_param_group(self, param_group: dict) -> None:
        """A new group must bring its chain under `cbs` (a combined optimizer has no chain of its own); the hypers it
        does not give come from its chain's defaults, then from `defaults` (the first child's) for those it reads."""
        if not self._building:
            if not isinstance(param_group, dict) or param_group.get('cbs') is None:
                raise TypeError("a CombinedOptimizer has no chain of its own: give the new group its callbacks under "
                                "'cbs' ({'params': ..., 'cbs': [...]})")
            reads = chain_reads(L(param_group['cbs']))
            param_group = {**{k: v for k, v in self.defaults.items() if k in reads and k not in ALIASES}, **param_group}
        super().add_param_group(param_group)
        if not self._building: self.group_prefixes.append('')

    def __repr__(self) -> str:
        parts = [f"{pre or '<no prefix>'}: [{chain_name(g['cbs'])}]" for pre, g in zip(self.group_prefixes, self.param_groups)]
        return f"{type(self).__name__}({'; '.join(parts)}; {len(self.params)} params)"
