"""The generic `Optimizer`: runs a list of step callbacks over (param, state, hypers), as fastai does,
while being a real `torch.optim.Optimizer` (schedulers, GradScaler, hooks, closures) with named state."""
from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from types import FrameType
from typing import Any

import torch
from fastcore.basics import merge
from fastcore.foundation import L

from . import state as named_state
from .state import FLAGS
from .hypers import ALIASES, Hypers, ParamGroup, expand_hyper
from .params import check_params, named_groups
from . import backends  # circular (backends runs `run_chain`): used at call time only

__all__ = ['Optimizer', 'cb_defaults', 'FLAGS']



def cb_defaults(cb: Callable) -> dict:
    "The hypers a callback asks for, with its defaults (`partial`s included; fastai's `_defaults` too)."
    while isinstance(cb, functools.partial): cb = cb.func
    return {**getattr(cb, '_defaults', {}), **getattr(cb, 'defaults', {})}


def cb_name(cb: Callable) -> str:
    while isinstance(cb, functools.partial): cb = cb.func
    return getattr(cb, '__name__', type(cb).__name__)


def run_chain(cbs: Iterable[Callable], p, state: dict, hyper: Mapping) -> None:
    "Run each callback on `p` with its state and hypers as keywords, merging the state it returns (fastai's step)."
    for cb in cbs:
        new = cb(p, **{**state, **hyper})
        if isinstance(new, dict): state.update(new)


def fastai_frame(fn: str, depth: int = 10) -> FrameType | None:
    """The frame of fastai.learner's `fn` (`create_opt`, `load_model`, ...) if it is among our `depth` callers.
    fastai calls an `opt_func` and `opt.load_state_dict` with no hint of who calls, so we look up the stack;
    this never imports fastai (no frame can be fastai's unless fastai.learner is already imported)."""
    mod = sys.modules.get('fastai.learner')
    if mod is None: return None
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None: return None
        if frame.f_code.co_name == fn and (frame.f_globals is vars(mod)
                                           or isinstance(frame.f_locals.get('self'), mod.Learner)): return frame
        frame = frame.f_back
    return None


def find_learner_model() -> torch.nn.Module | None:
    "The model of the fastai Learner whose `create_opt` is building this optimizer, if any (fastai is never imported)."
    frame = fastai_frame('create_opt')
    return getattr(frame.f_locals.get('self'), 'model', None) if frame else None


class Optimizer(torch.optim.Optimizer):
    "An optimizer made of step callbacks `cbs`; `defaults` (merged over the callbacks' own) are the hypers."
    _keep_on_clear = FLAGS

    def __init__(self, params: Any, cbs: Callable | Iterable[Callable], backend: str = 'auto', **defaults):
        if backend not in backends.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: expected one of {backends.BACKENDS}")
        self.backend = backend  # how `step` runs the chain: see cbopt.backends
        if 'train_bn' in defaults:
            defaults.pop('train_bn')
            warnings.warn('Setting `train_bn` in `Optimizer` has no effect. Set `train_bn` on `Learner` init instead')
        self.cbs = L(cbs)
        for cb in self.cbs:
            if not callable(cb): raise TypeError(f"callback {cb!r} is not callable")
        groups = [ParamGroup(g) for g in named_groups(params)]
        if not any(g['params'] for g in groups): raise ValueError("optimizer got an empty parameter list")
        check_params(groups)
        defaults = merge(*[cb_defaults(cb) for cb in self.cbs], {ALIASES.get(k, k): v for k, v in defaults.items()})
        for k, v in defaults.items():  # group dicts win over defaults; slices and lists spread over the groups
            for g, v_ in zip(groups, expand_hyper(k, v, len(groups))): g.setdefault(k, v_)
        scalar_defaults = {k: expand_hyper(k, v, len(groups))[-1] for k, v in defaults.items()}
        for alias, canon in ALIASES.items():  # e.g. OneCycleLR looks for 'momentum' in defaults
            if canon in scalar_defaults: scalar_defaults[alias] = scalar_defaults[canon]
        self.frozen_idx = 0
        super().__init__(groups, scalar_defaults)
        if model := find_learner_model(): self.name_params(model)

    # -- params and groups ---------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        "Add a group (any accepted params form under `params`); missing hypers come from `defaults`."
        if not isinstance(param_group, Mapping): raise TypeError(f"param_group must be a dict, not {type(param_group).__name__}")
        if 'param_names' in param_group:  # already named (e.g. from our own __init__)
            g = dict(param_group)
            g['params'], g['param_names'] = list(g['params']), list(g['param_names'])
            if len(g['params']) != len(g['param_names']):
                raise ValueError("param_group has a different number of 'params' and 'param_names'")
            groups = [g]
        else: groups = named_groups([{**param_group}], start=sum(len(g['params']) for g in self.param_groups))
        check_params(groups, known=self.named_params())
        g = ParamGroup(groups[0])
        for k, v in self.defaults.items():
            if k not in ALIASES: g.setdefault(k, v)
        self.param_groups.append(g)

    @property
    def params(self) -> list[torch.Tensor]: return [p for g in self.param_groups for p in g['params']]

    @property
    def param_names(self) -> list[str]: return [n for g in self.param_groups for n in g['param_names']]

    @property
    def param_lists(self) -> L:
        "The params of each group, as fastai names them."
        return L(L(g['params']) for g in self.param_groups)

    def named_params(self) -> dict[str, torch.Tensor]: return dict(zip(self.param_names, self.params))

    def name_params(self, model: torch.nn.Module) -> None:
        "Rename positionally named params by their FQNs in `model`, so state_dicts are keyed like `model.state_dict()`."
        fqn = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        if not all(id(p) in fqn for p in self.params): return
        for g in self.param_groups: g['param_names'] = [fqn[id(p)] for p in g['params']]

    def all_params(self, n: slice | int = slice(None), with_grad: bool = False) -> L:
        "(param, group, state, hypers) tuples for the groups `n`, optionally only those with a grad (as fastai's)."
        groups = self.param_groups[n] if isinstance(n, slice) else [self.param_groups[n]]
        res = L((p, g, self.state[p], Hypers(g)) for g in groups for p in g['params'])
        return res.filter(lambda o: o[0].grad is not None) if with_grad else res

    # -- hypers --------------------------------------------------------------------------------------------------
    @property
    def hypers(self) -> L:
        "One live dict of hypers per group (fastai's view of `param_groups`): writes go to the groups."
        return L(Hypers(g) for g in self.param_groups)

    def set_hyper(self, k: str, v: Any) -> None:
        "Set hyper `k` in every group from a scalar, a list/tuple/array (one per group) or a slice (spread across)."
        for g, v_ in zip(self.param_groups, expand_hyper(k, v, len(self.param_groups))): g[k] = v_

    def set_hypers(self, **kwargs) -> None:
        for k, v in kwargs.items(): self.set_hyper(k, v)

    # -- freezing ------------------------------------------------------------------------------------------------
    def freeze_to(self, n: int) -> None:
        "Train only the groups from `n` on; earlier groups keep training only params flagged `force_train`."
        self.frozen_idx = n if n >= 0 else len(self.param_groups) + n
        if self.frozen_idx >= len(self.param_groups):
            warnings.warn(f"Freezing {self.frozen_idx} groups; model has {len(self.param_groups)}; whole model is frozen.")
        for p, _, state, _ in self.all_params(slice(n, None)): p.requires_grad_(True)
        for p, _, state, _ in self.all_params(slice(None, n)): p.requires_grad_(state.get('force_train', False))

    def freeze(self) -> None:
        if len(self.param_groups) < 2: raise ValueError("freeze() needs at least two param groups (use a splitter)")
        self.freeze_to(-1)

    def unfreeze(self) -> None: self.freeze_to(0)

    # -- state ---------------------------------------------------------------------------------------------------
    def clear_state(self) -> None:
        "Forget all algorithm state, keeping the per-param flags (`do_wd`, `force_train`)."
        for p in self.params:
            if p in self.state: self.state[p] = {k: v for k, v in self.state[p].items() if k in self._keep_on_clear}

    def init_state(self) -> None:
        """Create the state of every param that has none, as a first step with zero grads would, without changing
        any param (the chain runs on a copy). Step counters then read 1, as after torchrec's and DCP's init."""
        for g in self.param_groups:
            for p in g['params']:
                if not named_state.split_flags(self.state.get(p, {}))[0]:
                    self.state[p].update(named_state.first_step_state(self, p, g))

    # -- stepping ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        "Run the callbacks on every param with a grad, with `self.backend`; `closure` re-evaluates the model and returns the loss."
        loss = None
        if closure is not None:
            with torch.enable_grad(): loss = closure()
        backends.run_step(self, self.backend)
        return loss

    # -- named state_dict ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        "`{'state': {fqn: {...}}, 'param_groups': [{hypers, 'params': [fqn, ...]}]}`: loadable with weights_only."
        for hook in self._optimizer_state_dict_pre_hooks.values(): hook(self)
        sd = named_state.named_state_dict(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            res = hook(self, sd)
            if res is not None: sd = res
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a cbopt, torch.optim or fastai state_dict. Strict and atomic: any mismatch raises an error naming
        the param, and leaves this optimizer exactly as it was.
        One exception, for fastai: `lr_find` saves the optimizer before it runs (often still fresh, so with no
        state) and loads it back after, through `load_model`, which turns any error into a "Could not load the
        optimizer state" warning. So when fastai's `load_model` calls us, a checkpoint with no state at all
        restores the fresh state (as `clear_state()`, flags kept) instead of raising."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            res = hook(self, state_dict)
            if res is not None: state_dict = res
        new_state, new_hypers = named_state.prepare_load(self, state_dict, fresh_ok=fastai_frame('load_model') is not None)
        for p in self.params:  # commit: nothing below can fail
            self.state[p] = {**new_state[p], **named_state.split_flags(self.state.get(p, {}))[1]}
        for g, h in zip(self.param_groups, new_hypers): g.update(h)
        for hook in self._optimizer_load_state_dict_post_hooks.values(): hook(self)

    # -- pickling (torch's __getstate__ keeps only defaults, state and param_groups) -------------------------------
    def __getstate__(self) -> dict:
        """Everything but the hooks, which torch does not pickle either (they are often lambdas), and the `step` an LR
        scheduler patches onto the instance (bound to this optimizer: a copy would step the original)."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith('_optimizer_') and k != 'step'}

    def __repr__(self) -> str:
        cbs = ', '.join(cb_name(cb) for cb in self.cbs)
        return f"{type(self).__name__}([{cbs}], {len(self.param_groups)} groups, {len(self.params)} params)"
