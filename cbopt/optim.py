"""`cbopt.optim`: torch.optim's classes with torch's signatures and defaults, built from cbopt's callbacks.

Change `torch.optim.AdamW(...)` to `cbopt.optim.AdamW(...)`: the same arguments give the same numbers (within float
rounding), and the optimizer is a full cbopt `Optimizer` (named state, `backend`, callbacks, wrappers). Each class
maps torch's arguments onto a cbopt chain and fastai's hyper names (`betas` are `mom`/`sqr_mom`, `weight_decay` is
`wd`, RMSprop's `alpha` is `sqr_mom`...), in keywords and in group dicts alike. torch's implementation switches choose
cbopt's backend: `foreach=True` is `'foreach'`, `foreach=False` is `'loop'`, `fused=True` is `'fused'`, neither is
`'auto'`. `capturable=True` is accepted on the CPU, where it changes nothing (torch's capturable path computes the
same numbers there), and refused for params on a GPU: cbopt's step counts and hypers are Python numbers, which a CUDA
graph's replay would reuse unchanged (no eager cbopt step can be captured: `cbopt.engine.step`).
`differentiable=True` records the step in autograd's graph, as torch's differentiable optimizers do
(`cbopt.functional.differentiable_step`: the chain run as `cbopt.functional`'s update, out of place, each param and
state tensor then updated in place in the graph), so `torch.autograd.grad` of a loss after the step reaches the
params, grads, state and tensor hypers before it; params may then be non-leaf tensors, and torch's refusals hold
(`fused` with it; `foreach=True` with it, at the step, but in SGD).
`opt.state` shows each param's state as the torch class keeps it (`cbopt.state.torch_view`), `opt.param_groups` hold
the torch class's entries (`TorchParamGroup`), and a group dict's algorithm flags choose that group's own chain.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .recipes.lbfgs import LBFGS as _lbfgs_recipe
from .recipes import fastai as _fastai
from .recipes import torch_optim as _torch
from .callbacks.fastai import average_sqr_grad, step_stat
from .core.chain import chain_name
from .core.params import non_leaf_params
from .functional import differentiable_step
from .core.names import is_positional
from .core.runtime import user_stacklevel
from .core.hypers import (HYPER_RULES, TORCH_FLAGS, TORCH_NAMES, Hypers, ParamGroup, TorchParamGroup, check_hyper,
                          from_torch_names, model_entries, same_value)
from . import engine
from ._torch import GradReader
from .optimizer import Optimizer, complex_refused_at_step, takes_state_precision, unsupported_complex
from .state.lowbit import group_settings
from .state.formats import TORCH_CHAIN_FLAGS
from .state.torch_format import torch_group_entries
from .state.torch_view import TorchState
from .recipes.fastai import _decay, maximizing
from .callbacks.torch_optim import (centered_grad_avg, sparse_adam_step, torch_rmsprop_momentum_step,
                                    torch_rmsprop_step)

__all__ = ['SGD', 'Adam', 'AdamW', 'RMSprop', 'RAdam', 'NAdam', 'Adagrad', 'Adadelta', 'Adamax', 'ASGD', 'Rprop',
           'Adafactor', 'Muon', 'LBFGS', 'SparseAdam']

Params = Any
_IMPL_FLAGS = ('foreach', 'fused', 'capturable', 'differentiable')  # torch's implementation switches
_RECIPE_FLAGS = {'decoupled_weight_decay': 'decouple_wd'}  # a recipe's keyword for a torch flag, where not the flag's name


def _backend(cls: str, foreach: bool | None, fused: bool | None, differentiable: bool) -> str:
    """cbopt's backend for torch's `foreach` / `fused`, refusing what torch refuses with its words. `differentiable`
    runs the loop (torch's single-tensor code): its step is `cbopt.functional.differentiable_step`, whatever the
    backend; `foreach=True` with it is kept, and the step refuses it as torch's does."""
    if fused and differentiable: raise RuntimeError("`fused` does not support `differentiable`")
    if fused and foreach: raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if differentiable and not foreach: return 'loop'
    return 'fused' if fused else 'foreach' if foreach else 'loop' if foreach is False else 'auto'


def _refuse_capturable(cls: str, i: int, g: Mapping) -> None:
    """`capturable=True` over params on a GPU is refused rather than ignored: torch's capturable optimizers keep every
    count on the device so that a CUDA graph can replay the step, but cbopt's step counts and hypers are Python numbers,
    which a replay would reuse unchanged (silently wrong bias corrections and schedules). On the CPU it changes nothing
    (no graphs there), as in torch's numbers."""
    if not g.get('capturable'): return
    on_gpu = next((p for p in g['params'] if isinstance(p, torch.Tensor) and p.device.type not in ('cpu', 'meta')), None)
    if on_gpu is not None:
        raise ValueError(f"cbopt.optim.{cls}(capturable=True) (param group {i}): its params are on {on_gpu.device}, and "
                         "cbopt's steps cannot be captured in a CUDA graph (their step counts and hypers are Python "
                         "numbers, which a replay would reuse unchanged); drop capturable, or use torch.optim's class")


def _torch_groups(cls: str, params: Params, names: Mapping) -> tuple[Params, list[dict]]:
    """`params` with torch's names in its group dicts made cbopt's (`names`: this class's own, as RMSprop's `alpha`),
    and each group dict's torch switches (`TORCH_FLAGS`) taken out, returned beside (one dict per group dict)."""
    if params is None or isinstance(params, (torch.Tensor, Mapping)): return params, []  # (the recipe names what is wrong)
    params = list(params)
    if not params or not all(isinstance(g, Mapping) and 'params' in g for g in params): return params, []
    out, switches = [], []
    for i, g in enumerate(params):
        g = dict(g)  # (a live TorchParamGroup's copy holds its entries, not its chain: chosen again here)
        own = {f: g.pop(f) for f in TORCH_FLAGS if f in g and f not in names}  # (Muon's nesterov is a hyper)
        _backend(f"{cls} (param group {i})", own.get('foreach'), own.get('fused'), bool(own.get('differentiable')))
        out.append(from_torch_names(g, names, where=f' (group {i})') if names else g)
        switches.append(own)
    return out, switches


REPEAT_MSG = ("optimizer contains a parameter group with duplicate parameters; in future, this will cause an error; "
              "see github.com/pytorch/pytorch/issues/40967 for more information")  # torch's words (its test matches)


def _is_pair(o: Any) -> bool: return isinstance(o, tuple) and len(o) == 2


def _once(params: Any, where: str) -> Any:
    """One group's `params` (tensors, or torch's (name, tensor) pairs) as torch takes them: names on all of them or on
    none (torch's error otherwise), and a tensor listed again dropped, warning torch's words. torch warns and keeps the
    copy (so its loop steps that param twice, an accident it means to make an error); cbopt.optim warns as torch does
    and steps the param once (cbopt's own classes refuse the repeat: the engine keys state by name, one name per
    tensor). Any other form is returned as it is."""
    if isinstance(params, (torch.Tensor, Mapping, str, bytes)) or not hasattr(params, '__iter__'): return params
    params = list(params)
    if len({_is_pair(o) for o in params}) > 1:  # torch's words (its test matches them)
        raise ValueError("all optimizer params should be with/without names. Some param names are missing "
                         f"(in {where})")
    seen, out = {}, []
    for i, o in enumerate(params):
        t = o[1] if _is_pair(o) else o
        if isinstance(t, torch.Tensor) and id(t) in seen:
            warnings.warn(f"{REPEAT_MSG} (cbopt.optim steps it once: {where}'s param {i} is the same tensor as its "
                          f"param {seen[id(t)]}, dropped)", UserWarning, stacklevel=user_stacklevel())
            continue
        if isinstance(t, torch.Tensor): seen[id(t)] = i
        out.append(o)
    return out


def _named(params: Any) -> bool | None:
    "Whether a group's `params` (torch's forms) are named: (name, tensor) pairs; None where it cannot say."
    if isinstance(params, torch.Tensor): return False
    if isinstance(params, list) and params: return _is_pair(params[0])
    return None


def _torch_params(params: Params) -> Params:
    """`params` (torch's forms: params, or group dicts) as torch takes them: each group through `_once`, and the groups
    all named or none (torch's error otherwise)."""
    if params is None or isinstance(params, (torch.Tensor, Mapping)): return params
    params = list(params)
    if not (params and all(isinstance(g, Mapping) and 'params' in g for g in params)):
        return _once(params, 'the param group')
    params = [{**g, 'params': _once(g['params'], f'param group {i}')} for i, g in enumerate(params)]
    named = [_named(g['params']) for g in params]
    if True in named and False in named:
        i = next(i for i, n in enumerate(named) if n != named[0])
        raise ValueError("all optimizer param groups should be with/without names. cannot add param group "
                         f"{'with' if named[i] else 'without'} names to the optimizer (param group {i})")
    return params


def _torch_checks(cls: type, kw: Mapping, switches: Mapping) -> None:
    """torch's constructor checks that cbopt's hyper rules word otherwise, in torch's words and order (its tests match
    them): a `betas` entry outside [0, 1); and, for the classes whose foreach kernels take no tensor hypers (Adam,
    AdamW: `cls.tensor_hypers_need_capturable`), a tensor `lr` or `betas` entry with `foreach=True` but not `capturable`
    (cbopt's own classes run them in every backend)."""
    betas = kw.get('betas')
    betas = tuple(betas) if isinstance(betas, (tuple, list)) and len(betas) == 2 else ()
    no_tensors = cls.tensor_hypers_need_capturable and switches.get('foreach') and not switches.get('capturable')
    if no_tensors and isinstance(kw.get('lr'), torch.Tensor):
        raise ValueError("lr as a Tensor is not supported for capturable=False and foreach=True")
    for i, b in enumerate(betas):
        if isinstance(b, (int, float, torch.Tensor)) and not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    for i, b in enumerate(betas):
        if no_tensors and isinstance(b, torch.Tensor):
            raise ValueError(f"betas[{i}] as a Tensor is not supported for capturable=False and foreach=True")


def _switches(args: Mapping) -> dict:
    "The implementation switches among a constructor's arguments (`locals()`), as torch keeps them in every group."
    return {k: args[k] for k in _IMPL_FLAGS if k in args}


def _chain_key(cls: type, recipe: tuple, own: Mapping, g: Mapping) -> dict:
    """What makes a group's algorithm another than the optimizer's: its algorithm flags (`TORCH_CHAIN_FLAGS`) where
    they differ from the constructor's, and the hypers that choose callbacks (`cls.chain_hypers`: SGD's momentum and
    dampening) where they are zero and the constructor's not, or the reverse. Empty: the optimizer's chain."""
    _, kw, flags = recipe
    key = {f: bool(v) for f, v in own.items() if f in TORCH_CHAIN_FLAGS and f in flags and bool(v) != bool(flags[f])}
    for h in cls.chain_hypers:
        if h in g and (g[h] != 0) != (kw.get(h, 0) != 0): key[h] = g[h]
    return key


def _chain_for(recipe: tuple, key: Mapping) -> list:
    "The chain the recipe builds with `key` (see `_chain_key`) over its constructor's arguments, on a stand-in param."
    make, kw, _ = recipe
    over = {_RECIPE_FLAGS.get(k, k): v for k, v in key.items()}
    return make([torch.zeros(2, 2, requires_grad=True)], **{**kw, **over}).param_groups[0]['cbs']


def _differentiable_run(opt: TorchOptimizer, closure: Callable | None = None, loss: Any = None) -> None:
    """The step of a `differentiable=True` optimizer (its `_run_step`): `cbopt.functional.differentiable_step`, after
    refusing a group with `foreach=True`, as torch's foreach code refuses autograd (all but SGD's), in its words."""
    if not opt.foreach_records:
        for g in opt.param_groups:
            if g.get('foreach') and g.get('differentiable') and any(p.grad is not None for p in g['params']):
                raise AssertionError("_foreach ops don't support autograd")
    differentiable_step(opt, closure, loss)


def _complex_refusing_run(opt: TorchOptimizer, closure: Callable | None = None, loss: Any = None) -> None:
    """The step of a `cbopt.optim` optimizer holding complex params its chain does not support: torch's RuntimeError
    (its words: torch's Adafactor and Muon refuse them at the step) where one has a grad, else the engine's step."""
    for g in opt.param_groups:
        if unsupported_complex(g) is not None and any(p.is_complex() and p.grad is not None for p in g['params']):
            raise RuntimeError(f"{type(opt).__name__} does not support complex parameters")
    engine.run_step(opt, closure, loss)


class TorchOptimizer(Optimizer):
    """The base of `cbopt.optim`'s classes: a cbopt `Optimizer` built by a cbopt recipe from torch's arguments.
    `_build` adopts the optimizer the recipe returns, so the class is a thin layer: no math of its own. Its
    `state_dict()` is what its torch class saves (torch's state and hyper names), so torch.optim loads it;
    `state_dict(format='cbopt')` has cbopt's names. Both load back."""
    torch_group_names: dict = {}  # this class's torch names for hypers in group dicts (beyond weight_decay and betas)
    chain_hypers: tuple = ()  # cbopt hypers whose being zero or not chooses the chain (SGD's `mom`, `dampening`)
    tensor_hypers_need_capturable = False  # torch refuses a tensor lr or betas with foreach=True unless capturable
    state_dict_format = 'torch'
    foreach_records = False  # whether torch's foreach code of this class runs with differentiable=True (SGD's does)

    @property
    def state(self) -> TorchState:
        """Each param's state as the torch class keeps it (`exp_avg`, `step` a 0-d float tensor...): a view over the
        engine's own state dicts, which keep cbopt's names (`cbopt.state.torch_view`)."""
        return TorchState(self)

    @state.setter
    def state(self, state: dict) -> None: self.__dict__['state'] = state  # (the engine's: `core.runtime.param_states`)

    @property
    def torch_class(self) -> type:
        "The torch.optim class of the same name (of the first cbopt.optim class in a subclass's bases)."
        return next(getattr(torch.optim, c.__name__) for c in type(self).__mro__ if c.__module__ == __name__)

    def _build(self, make: Callable[..., Optimizer], params: Params, flags: Mapping, switches: Mapping | None = None,
               **kw) -> None:
        """Build with the recipe `make` from torch's arguments (`flags`: the algorithm flags, `switches`: the
        implementation ones, `kw`: the recipe's keywords), adopting the optimizer it returns; then each group holds
        torch's entries (`TorchParamGroup`)."""
        _torch_checks(type(self), kw, switches or {})
        for k, v in from_torch_names(kw, {**TORCH_NAMES, **self.torch_group_names}).items():  # before the params, as torch
            if k in HYPER_RULES: check_hyper(k, v)
        betas = kw.get('betas')
        if betas is not None and len({isinstance(b, torch.Tensor) for b in betas}) > 1:
            raise ValueError("betas must be either both floats or both Tensors")  # torch's rule and wording
        if isinstance(params, torch.Tensor):  # torch's rule and wording (cbopt.Optimizer takes a bare tensor)
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but "
                            f"got {torch.typename(params)}")
        params = _torch_params(params)
        groups, own = _torch_groups(type(self).__name__, params, self.torch_group_names)
        recipe = (make, kw, {**flags, **(switches or {})})
        for g, o in zip(groups if own else (), own):  # flags (or momentum) choosing another algorithm: its own chain
            if key := _chain_key(type(self), recipe, o, g): g['cbs'] = _chain_for(recipe, key)
        differentiable = bool((switches or {}).get('differentiable'))
        with non_leaf_params() if differentiable else contextlib.nullcontext(), complex_refused_at_step():
            built = make(groups, **kw)
        self.__dict__.update(built.__dict__)
        self.__dict__['_optimizer_grads'] = GradReader(self)  # (built's reads built's groups: this one reads these)
        self._recipe = recipe
        if differentiable:  # torch's differentiable=True: the step is recorded by autograd
            self.defaults['differentiable'] = True
            self._run_step = _differentiable_run
        self._refuse_complex_at_step()
        self.param_groups = [self._as_torch_group(i, g, own[i] if i < len(own) else {})
                             for i, g in enumerate(self.param_groups)]
        for i, g in enumerate(self.param_groups): _refuse_capturable(type(self).__name__, i, g)

    def _as_torch_group(self, i: int, g: ParamGroup, own: Mapping) -> ParamGroup:
        """Group `i` (built by the recipe, by cbopt's names) as its torch class's groups hold it: `TorchParamGroup`,
        with the entries `torch_class_state_dict` writes (its chain's flags) and the switches the optimizer or the group
        dict gave (`own`: torch keeps a group's own `foreach`, `fused`..., and so does cbopt; where they differ from the
        constructor's they choose the group's runner: `group_backends`). LBFGS keeps cbopt's group (its history is whole-model state, in the group)."""
        if not self._torch_groups_live: return g
        cbs, hyper = g['cbs'], dict(Hypers(g))
        entries = torch_group_entries(f"param group {i} (chain [{chain_name(cbs)}])", self.torch_class, cbs, hyper,
                                      self.backend, own_class=True)
        switches = {k: v for k, v in {**self._recipe[2], **own}.items() if k in _IMPL_FLAGS or k not in entries}
        out = TorchParamGroup({'params': g['params'], **entries, **switches, 'param_names': g['param_names'],
                               **model_entries(g), **group_settings(g)})  # (its algorithm flags
        # are its chain's: `entries`; low-bit state's settings are kept as they are)
        out['cbs'] = cbs
        for k, v in hyper.items():  # a hyper with no torch entry (a user's) is kept by cbopt's name, but at its
            if k not in out or not same_value(out[k], v): out[k] = v  # callback's default (the group answers it then)
        return out

    _torch_groups_live = True  # (LBFGS: False)

    def _refuse_complex_at_step(self) -> None:
        """Where a group holds complex params its chain does not support (Adafactor's, Muon's), the step refuses them
        as torch's does, in its words, before anything changes (`_complex_refusing_run`): set only then, so that
        no other step does more."""
        if any(unsupported_complex(g) is not None and any(p.is_complex() for p in g['params'])
               for g in self.param_groups):
            self._run_step = _complex_refusing_run

    def __init_subclass__(cls, **kwargs):
        "Each class's `__init__` also takes `state_precision=` and `min_quantize_size=` (`takes_state_precision`)."
        super().__init_subclass__(**kwargs)
        if '__init__' in cls.__dict__: cls.__init__ = takes_state_precision(cls.__init__)

    def group_backends(self) -> dict | None:
        """The groups whose own `foreach`/`fused` entries (a group dict's, torchtitan's in every group, or written
        later, as torch reads them at each step) differ from the constructor's: each steps with the runner they name
        (`foreach=True` foreach, `False` the loop, `fused=True` fused, neither `auto`) where it is not the optimizer's
        backend. None where there is none: every group steps with `backend` (which `opt.backend = ...` sets)."""
        recipe = self.__dict__.get('_recipe')  # (none: an optimizer pickled before there were recipes)
        if recipe is None: return None
        base = recipe[2]
        f0, u0, kind, out = base.get('foreach'), base.get('fused'), self.backend_options.kind, None
        for g in self.param_groups:
            f, u = g.get('foreach', f0), g.get('fused', u0)
            if f == f0 and u == u0: continue
            own = 'fused' if u else 'foreach' if f else 'loop' if f is False else 'auto'
            if own != kind:
                if out is None: out = {}
                out[id(g)] = own
        return out

    def add_param_group(self, param_group: dict) -> None:
        """torch's `add_param_group`: torch's names and switches in the group dict, its algorithm flags choosing the
        group's own chain (as in the constructor); the group then holds torch's entries."""
        if not isinstance(param_group, Mapping) or '_recipe' not in self.__dict__:
            return super().add_param_group(param_group)
        if 'params' in param_group:
            param_group = {**param_group, 'params': _once(param_group['params'], 'the added param group')}
            if (named := _named(param_group['params'])) is not None and named == is_positional(self.param_names):
                raise ValueError("all optimizer param groups should be with/without names. cannot add param group "
                                 f"{'with' if named else 'without'} names to the optimizer")  # torch's words
        (g,), (own,) = _torch_groups(type(self).__name__, [param_group], self.torch_group_names)
        if key := _chain_key(type(self), self._recipe, own, g): g['cbs'] = _chain_for(self._recipe, key)
        with non_leaf_params() if self.defaults.get('differentiable') else contextlib.nullcontext(), \
                complex_refused_at_step():
            super().add_param_group(g)
        self.param_groups[-1] = self._as_torch_group(len(self.param_groups) - 1, self.param_groups[-1], own)
        self._refuse_complex_at_step()
        try: _refuse_capturable(type(self).__name__, len(self.param_groups) - 1, self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()  # (all or nothing: the group is not added)
            raise

    def __repr__(self) -> str:
        "As torch's: the class and each group's hypers (cbopt's names; `momentum` is `mom`)."
        lines = [f"{type(self).__name__} ("]
        for i, h in enumerate(self.hypers):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(h.items())]
        return '\n'.join(lines + [f"backend: {self.backend}", ")"])


class SGD(TorchOptimizer):
    "torch.optim.SGD: L2 `weight_decay` (as torch), momentum in state `grad_avg` (torch's `momentum_buffer`)."
    torch_group_names = dict(momentum='mom')
    chain_hypers = ('mom', 'dampening')  # (a group with momentum keeps a buffer, one without does not)
    foreach_records = True
    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float | torch.Tensor = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None) -> None:
        self._build(_fastai.SGD, params, dict(nesterov=nesterov, maximize=maximize), _switches(locals()), lr=lr, mom=momentum,
                    dampening=dampening, wd=weight_decay, decouple_wd=False, nesterov=nesterov, maximize=maximize,
                    backend=_backend('SGD', foreach, fused, differentiable))


class Adam(TorchOptimizer):
    "torch.optim.Adam: L2 `weight_decay` unless `decoupled_weight_decay=True` (then AdamW)."
    tensor_hypers_need_capturable = True
    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False) -> None:
        self._build(_fastai.Adam, params, dict(amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled_weight_decay), _switches(locals()),
                    lr=lr, betas=betas, eps=eps, wd=weight_decay, decouple_wd=decoupled_weight_decay, amsgrad=amsgrad,
                    maximize=maximize, backend=_backend('Adam', foreach, fused, differentiable))


class AdamW(TorchOptimizer):
    "torch.optim.AdamW: decoupled `weight_decay` (default 1e-2); torch's fused kernel runs it when it can."
    tensor_hypers_need_capturable = True
    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None) -> None:
        self._build(_fastai.Adam, params, dict(amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=True),
                    _switches(locals()), lr=lr, betas=betas, eps=eps,
                    wd=weight_decay, decouple_wd=True, amsgrad=amsgrad, maximize=maximize,
                    backend=_backend('AdamW', foreach, fused, differentiable))


def _rmsprop(params: Params, lr, sqr_mom, eps, wd, mom, centered: bool, maximize: bool, backend: str) -> Optimizer:
    """torch's RMSprop as a chain: L2, the squared-grad average, the centered mean, the step count (torch keeps one,
    which its state_dicts must hold), then the step (with momentum or not)."""
    cbs = _decay(False) + [average_sqr_grad] + ([centered_grad_avg] if centered else []) + [step_stat]
    cbs.append(torch_rmsprop_momentum_step if mom != 0 else torch_rmsprop_step)
    return Optimizer(params, maximizing(cbs, maximize), lr=lr, sqr_mom=sqr_mom, eps=eps, wd=wd, mom=mom, backend=backend)


class RMSprop(TorchOptimizer):
    """torch.optim.RMSprop, torch's formula: momentum on `grad / rms` (not fastai's `RMSProp`, which divides the
    average grad), `centered`. State: `sqr_avg` (torch's `square_avg`), `grad_avg`, `mom_buf` (`momentum_buffer`)."""
    torch_group_names = dict(alpha='sqr_mom', momentum='mom')
    chain_hypers = ('mom',)

    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-2, alpha: float = 0.99, eps: float = 1e-8,
                 weight_decay: float = 0, momentum: float = 0, centered: bool = False, capturable: bool = False,
                 foreach: bool | None = None, maximize: bool = False, differentiable: bool = False) -> None:
        if not 0.0 <= momentum: raise ValueError(f"Invalid momentum value: {momentum}")
        if not 0.0 <= alpha: raise ValueError(f"Invalid alpha value: {alpha}")
        self._build(_rmsprop, params, dict(centered=centered, maximize=maximize), _switches(locals()), lr=lr, sqr_mom=alpha, eps=eps,
                    wd=weight_decay, mom=momentum, centered=centered, maximize=maximize,
                    backend=_backend('RMSprop', foreach, None, differentiable))


class RAdam(TorchOptimizer):
    "torch.optim.RAdam: L2 `weight_decay` unless `decoupled_weight_decay=True`."
    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, decoupled_weight_decay: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False) -> None:
        self._build(_fastai.RAdam, params, dict(maximize=maximize, decoupled_weight_decay=decoupled_weight_decay), _switches(locals()),
                    lr=lr, betas=betas, eps=eps, wd=weight_decay, decouple_wd=decoupled_weight_decay, maximize=maximize,
                    torch_eps=True, backend=_backend('RAdam', foreach, None, differentiable))


class NAdam(TorchOptimizer):
    "torch.optim.NAdam (NAdamW with `decoupled_weight_decay=True`)."
    def __init__(self, params: Params, lr: float | torch.Tensor = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, momentum_decay: float = 4e-3,
                 decoupled_weight_decay: bool = False, *, foreach: bool | None = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False) -> None:
        self._build(_torch.NAdam, params, dict(maximize=maximize, decoupled_weight_decay=decoupled_weight_decay), _switches(locals()),
                    lr=lr, betas=betas, eps=eps, wd=weight_decay, momentum_decay=momentum_decay,
                    decouple_wd=decoupled_weight_decay, maximize=maximize,
                    backend=_backend('NAdam', foreach, None, differentiable))


class Adagrad(TorchOptimizer):
    "torch.optim.Adagrad."
    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-10, foreach: bool | None = None, *,
                 maximize: bool = False, differentiable: bool = False, fused: bool | None = None) -> None:
        self._build(_torch.Adagrad, params, dict(maximize=maximize), _switches(locals()), lr=lr, lr_decay=lr_decay, wd=weight_decay,
                    initial_accumulator_value=initial_accumulator_value, eps=eps, maximize=maximize,
                    backend=_backend('Adagrad', foreach, fused, differentiable))


class Adadelta(TorchOptimizer):
    "torch.optim.Adadelta (`rho` is `sqr_mom`)."
    torch_group_names = dict(rho='sqr_mom')

    def __init__(self, params: Params, lr: float | torch.Tensor = 1.0, rho: float = 0.9, eps: float = 1e-6,
                 weight_decay: float = 0, foreach: bool | None = None, *, capturable: bool = False,
                 maximize: bool = False, differentiable: bool = False) -> None:
        if not 0.0 <= rho <= 1.0: raise ValueError(f"Invalid rho value: {rho}")
        self._build(_torch.Adadelta, params, dict(maximize=maximize), _switches(locals()), lr=lr, sqr_mom=rho, eps=eps, wd=weight_decay,
                    maximize=maximize, backend=_backend('Adadelta', foreach, None, differentiable))


class Adamax(TorchOptimizer):
    "torch.optim.Adamax."
    def __init__(self, params: Params, lr: float | torch.Tensor = 2e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0, foreach: bool | None = None, *, maximize: bool = False,
                 differentiable: bool = False, capturable: bool = False) -> None:
        self._build(_torch.Adamax, params, dict(maximize=maximize), _switches(locals()), lr=lr, betas=betas, eps=eps, wd=weight_decay,
                    maximize=maximize, backend=_backend('Adamax', foreach, None, differentiable))


class ASGD(TorchOptimizer):
    "torch.optim.ASGD (averaged params in state `param_avg`, torch's `ax`)."
    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-2, lambd: float = 1e-4, alpha: float = 0.75,
                 t0: float = 1e6, weight_decay: float = 0, foreach: bool | None = None, maximize: bool = False,
                 differentiable: bool = False, capturable: bool = False) -> None:
        self._build(_torch.ASGD, params, dict(maximize=maximize), _switches(locals()), lr=lr, lambd=lambd, alpha=alpha, t0=t0,
                    wd=weight_decay, maximize=maximize, backend=_backend('ASGD', foreach, None, differentiable))


class Rprop(TorchOptimizer):
    "torch.optim.Rprop (`etas`, `step_sizes` become the hypers `etaminus`/`etaplus`, `step_size_min`/`step_size_max`)."
    torch_group_names = dict(etas=('etaminus', 'etaplus'), step_sizes=('step_size_min', 'step_size_max'))

    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-2, etas: tuple[float, float] = (0.5, 1.2),
                 step_sizes: tuple[float, float] = (1e-6, 50), *, capturable: bool = False,
                 foreach: bool | None = None, maximize: bool = False, differentiable: bool = False) -> None:
        self._build(_torch.Rprop, params, dict(maximize=maximize), _switches(locals()), lr=lr, etas=etas, step_sizes=step_sizes,
                    maximize=maximize, backend=_backend('Rprop', foreach, None, differentiable))


class Adafactor(TorchOptimizer):
    "torch.optim.Adafactor (`eps` becomes the hypers `eps1`, `eps2`)."
    torch_group_names = dict(eps=('eps1', 'eps2'))

    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0, *,
                 foreach: bool | None = None, maximize: bool = False) -> None:
        self._build(_torch.Adafactor, params, dict(maximize=maximize), _switches(locals()), lr=lr, beta2_decay=beta2_decay, eps=eps, d=d,
                    wd=weight_decay, maximize=maximize, backend=_backend('Adafactor', foreach, None, False))


def _every_param(name: str, p: torch.Tensor) -> bool:
    "torch's Muon steps every param it is given with Muon (and refuses any that is not 2-D)."
    return True


class Muon(TorchOptimizer):
    """torch.optim.Muon: every param is Muon's, and must be 2-D, as in torch (`cbopt.Muon` splits a whole model between
    Muon and AdamW). `momentum` is `mom`, `ns_coefficients` the hypers `ns_a`, `ns_b`, `ns_c`; state `grad_avg`
    (torch's `momentum_buffer`)."""
    torch_group_names = dict(momentum='mom', ns_coefficients=('ns_a', 'ns_b', 'ns_c'), nesterov='nesterov')  # (a hyper)

    def __init__(self, params: Params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
                 eps: float = 1e-7, ns_steps: int = 5, adjust_lr_fn: str | None = None) -> None:
        self._build(_torch.Muon, params, dict(nesterov=nesterov), lr=lr, wd=weight_decay, mom=momentum,
                    nesterov=nesterov, ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                    adjust_lr_fn=adjust_lr_fn, muon_params=_every_param)


class LBFGS(TorchOptimizer):
    """torch.optim.LBFGS (`cbopt.LBFGS`: the whole-model callback `cbopt.lbfgs`): `step(closure)` only, one param group;
    its history is the group entries `'lbfgs.*'` (torch keeps it under its first param: its state_dict loads)."""
    _torch_groups_live = False  # (its group keeps cbopt's entries: its history is whole-model state, held there)
    def __init__(self, params: Params, lr: float | torch.Tensor = 1, max_iter: int = 20, max_eval: int | None = None,
                 tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9, history_size: int = 100,
                 line_search_fn: str | None = None) -> None:
        self._build(_lbfgs_recipe, params, {}, lr=lr, max_iter=max_iter, max_eval=max_eval, tolerance_grad=tolerance_grad,
                    tolerance_change=tolerance_change, history_size=history_size, line_search_fn=line_search_fn)


def _sparse_adam(params: Params, lr, betas, eps, maximize: bool, backend: str) -> Optimizer:
    "torch's SparseAdam as a chain: `sparse_adam_step` (after `negate_grad` with `maximize`), in the loop runner."
    return Optimizer(params, maximizing([sparse_adam_step], maximize), lr=lr, betas=betas, eps=eps, backend=backend)


class SparseAdam(TorchOptimizer):
    """torch.optim.SparseAdam: Adam masked to the indices of sparse grads (`nn.Embedding(sparse=True)`), torch's
    numerics (`sparse_adam_step`); dense grads, sparse params and complex params are refused as torch refuses them.
    It steps in the `loop` runner, as torch's steps one param at a time. State: `grad_avg`, `sqr_avg` (torch's
    `exp_avg`, `exp_avg_sq`), `step`."""
    def __init__(self, params: Params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, maximize: bool = False) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1: raise ValueError("Tensor lr must be 1-element")
        if not 0.0 < lr: raise ValueError(f"Invalid learning rate: {lr}")  # (torch's words: 0 is refused too)
        if not 0.0 < eps: raise ValueError(f"Invalid epsilon value: {eps}")
        if params is not None and not isinstance(params, (torch.Tensor, Mapping)): params = list(params)
        self._refuse_params(params, betas)
        self._build(_sparse_adam, params, dict(maximize=maximize), lr=lr, betas=betas, eps=eps, maximize=maximize,
                    backend='loop')

    @staticmethod
    def _refuse_params(params: Params, betas) -> None:
        "torch's refusals of sparse and complex params, in its words, with the indices (group, param) it gives."
        _torch_checks(SparseAdam, dict(betas=betas), {})
        if params is None or isinstance(params, Mapping): return
        groups = [params] if isinstance(params, torch.Tensor) else params
        groups = groups if groups and all(isinstance(g, Mapping) for g in groups) else [{'params': groups}]
        where = {'sparse': [], 'complex': []}
        for i, g in enumerate(groups):
            ps = g.get('params', ())
            for j, p in enumerate([ps] if isinstance(ps, torch.Tensor) else ps):
                p = p[1] if _is_pair(p) else p
                if isinstance(p, torch.Tensor) and p.is_sparse: where['sparse'].append([i, j])
                if isinstance(p, torch.Tensor) and p.is_complex(): where['complex'].append([i, j])
        if where['sparse']:
            raise ValueError(f"Sparse params at indices {where['sparse']}: SparseAdam requires dense parameter tensors")
        if where['complex']:
            raise ValueError(f"Complex params at indices {where['complex']}: SparseAdam does not support complex "
                             "parameters")
