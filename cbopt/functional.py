"""`cbopt.functional`: any chain as a pure `init(params)` and `update(params, grads, state, **hypers)` over dicts of
tensors, which pass through `torch.func` (`vmap`, `grad`) and `torch.compile(fullgraph=True)`.

The same callbacks run here as in `Optimizer.step`, through the same `run_param` (`cbopt.chain.run_chain`) as the
`loop` backend; only the stand-in for a param differs. A `Slot`'s `.data` is the live tensor, where a real param's
`.data` is a detached alias that hides every write from autograd, so gradients flow through `update`. Callbacks
write in place, which autograd differentiates only once the writes are made functional: eager `update` runs under
`torch.func.functionalize` (under `torch.compile`, AOTAutograd does the same). A grad's `.data` is the grad
itself (vmap refuses `.data`; under functionalize it cuts nothing anyway, as autograd works beneath the wrappers it
detaches), so meta-gradients flow through the grads too. `update` steps copies, so its inputs never change, and a
failing callback leaves nothing half-done.

State is `{fqn: {name: tensor}}` with the Optimizer's names and values. What the Optimizer keeps as a Python number
(a step count) is a 0-d float64 tensor here, so a new count neither retraces nor recompiles. The hypers named in
`dynamic` (`lr` by default) are 0-d tensors in the state too, under `'hypers'`: each update reads them there and
returns the values it used (optax's `inject_hyperparams`), so they can be read, scheduled, differentiated and set
per member under vmap. The other hypers are fixed numbers of the functional optimizer (`fopt.hypers`), because
callbacks may branch on them in Python (`if wd != 0`).
"""
from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Mapping
from numbers import Number
from typing import Any

import torch

from ._torch import data_getter, tree_leaves
from .core.chain import cb_name, chain_name, chain_reads, declared_state, init_chain_state, is_declared, is_model_cb, transient_keys, unwrap
from .engine.scalars import ScalarArgsAsTensors
from .engine.foreach import run_param
from .engine.traced import VALUE_READS as _VALUE_READS, number_tensor as _tensor
from .core.hypers import Hypers, check_hyper
from .optimizer import STANDARD_HYPERS, Optimizer, _check_read
from .core.initial import chain_initial_state

__all__ = ['functional', 'FunctionalOptimizer', 'FunctionalError', 'Slot', 'HYPERS']

HYPERS = 'hypers'
"""The functional state's entry for the dynamic hypers (`state[HYPERS]['lr']`), so no param may have this name."""
_DATA = data_getter()  # the `.data` getter, as a torch function mode sees it


_SYM = {torch.sym_max: torch.maximum, torch.sym_min: torch.minimum}


class FunctionalError(TypeError):
    "A callback that cannot run in the functional form: a whole-model callback, or an `if` on a tensor under vmap."


class Slot:
    """A param as callbacks see it in `update`: `.data` is the live tensor (not a detached alias), `.grad` its grad;
    any other attribute (`dtype`, `shape`, `new_ones`) is the tensor's."""
    def __init__(self, data: torch.Tensor, grad: torch.Tensor | None = None): self.data, self.grad = data, grad

    def __getattr__(self, name: str):
        if name.startswith('__') or name in ('data', 'grad'): raise AttributeError(name)  # (not set yet: no recursion)
        return getattr(self.data, name)


class _FunctionalMode(ScalarArgsAsTensors):
    """While a chain runs in `update`: `alpha=`/`value=` numbers become tensor ops (so a tensor lr flows through
    autograd and compile), a grad's `.data` is the grad itself (vmap refuses `.data`), and a callback that reads a
    Python value of a tensor under vmap is named in the error. `differentiable` (under functionalize, for autograd):
    `copy_` is `zero_().add_()`, as torch has no derivative for the functional copy (aten::copy) that functionalize
    makes of it; the same values (but -0.0 copies as 0.0)."""
    def __init__(self, cbs: Iterable[Callable], differentiable: bool = False):
        super().__init__()
        self.differentiable = differentiable
        self.codes = {unwrap(cb).__code__: cb_name(cb) for cb in cbs if hasattr(unwrap(cb), '__code__')}

    def _culprit(self) -> str:
        "The callback running now, found on the Python stack."
        f = sys._getframe(1)
        while f is not None and f.f_code not in self.codes: f = f.f_back
        return 'a callback' if f is None else f"callback {self.codes[f.f_code]!r}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, '__self__', None) is _DATA: return args[0]  # vmap refuses `.data`
        if self.differentiable and (func is torch.Tensor.copy_ or func in self.CLAMP_):
            src = args[1] if func is torch.Tensor.copy_ else \
                super().__torch_function__(torch.Tensor.clamp, types, args, kwargs)  # (ScalarArgsAsTensors copies it in)
            return args[0].zero_().add_(src)
        if func in _SYM and any(isinstance(a, torch.Tensor) for a in args):  # a number of the Optimizer is a tensor here
            a, b = (v if isinstance(v, torch.Tensor) else torch.full_like(o, v) for v, o in (args, args[::-1]))
            return _SYM[func](a, b)
        if func in _VALUE_READS:
            try: return func(*args, **(kwargs or {}))
            except RuntimeError as e:
                if 'vmap' not in str(e): raise
                raise FunctionalError(
                    f"{self._culprit()} reads a Python value of a tensor (an `if` on it, `.item()`, `float()`), which "
                    "vmap cannot batch. In the functional state the step count is a tensor, as is a hyper given as a "
                    "tensor: write the branch with torch.where, or run this chain without vmap") from e
        return super().__torch_function__(func, types, args, kwargs)


def _records(tree: Any) -> bool:
    """Whether autograd records this update (eagerly, with a tensor that needs a grad, under torch.func.grad too):
    then its in-place writes are made functional, which autograd needs and costs a few times the update's time. Under
    torch.compile, AOTAutograd makes them functional itself."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled(): return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(tree))


class FunctionalOptimizer:
    """A chain as a pure pair, `init(params) -> state` and `update(params, grads, state, **hypers) -> (params,
    state)` (see the module docstring), with converters from and to an Optimizer's state_dict. Made by
    `cbopt.functional`."""

    def __init__(self, cbs: list, hypers: Mapping[str, Any], dynamic: Iterable[str] | None = None):
        for cb in cbs:
            if is_model_cb(cb):
                raise FunctionalError(f"whole-model callback {cb_name(cb)!r} steps every param at once and keeps its "
                                      "state in the optimizer's param groups, while the functional update runs param "
                                      "by param: apply it to the grads before `update` instead")
        self.cbs, self.transient = list(cbs), transient_keys(cbs)
        dynamic = tuple(('lr',) if dynamic is None and 'lr' in hypers else dynamic or ())
        for k in dynamic:
            if k not in hypers: raise KeyError(f"dynamic hyper {k!r} is not a hyper of [{chain_name(cbs)}]: {sorted(hypers)}")
        self.dynamic = dynamic
        self.hypers = {k: v for k, v in hypers.items() if k not in dynamic}  # fixed: callbacks may branch on them
        self.defaults = dict(hypers)
        self._regroup: Callable | None = None  # set by `functional` for a factory: see `init`
        self._reads = chain_reads(cbs) | set(STANDARD_HYPERS)
        # what the Optimizer keeps as Python numbers (step counts), by type, to convert back
        self._numbers = {k: type(v) for k, v in chain_initial_state(cbs, torch.zeros(1), hypers).items()
                         if isinstance(v, Number)}

    def __repr__(self) -> str:
        return f"FunctionalOptimizer([{chain_name(self.cbs)}], dynamic={self.dynamic}, hypers={self.hypers})"

    # -- pure init and update ------------------------------------------------------------------------------------
    def init(self, params: Mapping[str, torch.Tensor]) -> dict:
        """Each param's state before its first step (as the Optimizer's state after `init_state()`), and the dynamic
        hypers under `'hypers'`. A chain with an undeclared (fastai-style) callback starts empty, as an Optimizer does:
        its first update creates the state (under torch.compile, that is one more trace)."""
        self._check_params(params)
        if self._regroup is not None:  # a factory may group params by shape (Muon): the real ones must be one group
            cbs, hypers = _one_group(self._regroup([(n, torch.empty(p.shape, dtype=p.dtype, device='meta'))
                                                    for n, p in params.items()]))
            if chain_name(cbs) != chain_name(self.cbs) or hypers != self.defaults:
                raise ValueError(f"the factory gives these params the chain [{chain_name(cbs)}] with {hypers}, not "
                                 f"[{chain_name(self.cbs)}] with {self.defaults} as it gave one param: make the "
                                 "functional optimizer from a list of callbacks")
        declared = is_declared(self.cbs)
        state = {name: {k: _tensor(v, p) for k, v in init_chain_state(self.cbs, Slot(p)).items()} if declared else {}
                 for name, p in params.items()}
        state[HYPERS] = {k: _tensor(self.defaults[k], next(iter(params.values()))) for k in self.dynamic}
        return state

    def update(self, params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor | None], state: Mapping,
               **hypers) -> tuple[dict, dict]:
        """One step of every param with a grad: `(new params, new state)`, the inputs left unchanged. `hypers`
        (numbers or 0-d tensors) apply to this call; the dynamic ones are also kept in the returned state."""
        self._check(params, grads, state, hypers)
        hyper = {**self.hypers, **state[HYPERS], **hypers}
        args = (dict(params), {k: grads.get(k) for k in params}, {k: state[k] for k in params}, hyper)
        differentiable = _records(args)
        run = torch.func.functionalize(self._run) if differentiable else self._run
        new_params, new_state = run(*args, differentiable)
        new_state[HYPERS] = {k: _tensor(hyper[k], next(iter(params.values()))) for k in self.dynamic}
        return new_params, new_state

    def _run(self, params: dict, grads: dict, states: dict, hyper: dict, differentiable: bool) -> tuple[dict, dict]:
        "The chain on a copy of each param with a grad, its grad and its state (callbacks write in place)."
        new_params, new_state = {}, {}
        with _FunctionalMode(self.cbs, differentiable):
            for name, p in params.items():
                if grads[name] is None:
                    new_params[name], new_state[name] = p, states[name]
                    continue
                slot = Slot(p.clone(), grads[name].clone())
                st = {k: v.clone() for k, v in states[name].items()}
                run_param(self.cbs, slot, st, hyper, self.transient)
                new_params[name] = slot.data
                new_state[name] = {k: _tensor(v, slot.data) for k, v in st.items()}
        return new_params, new_state

    # -- converters ----------------------------------------------------------------------------------------------
    def to_state_dict(self, state: Mapping) -> dict:
        """`state` as a cbopt state_dict, `{'state': {fqn: {...}}, 'param_groups': [{hypers, 'chain', 'params'}]}`,
        with the Optimizer's Python numbers (step counts): `load_state_dict` of an Optimizer over the same params
        and chain (one group) reads it."""
        names = [n for n in state if n != HYPERS]
        as_saved = lambda k, v: self._numbers[k](v.item()) if k in self._numbers else v.detach().clone()
        group = {**self.hypers, **{k: v.item() for k, v in state[HYPERS].items()}, 'chain': chain_name(self.cbs),
                 'params': names}
        return {'state': {n: {k: as_saved(k, v) for k, v in state[n].items()} for n in names if state[n]},
                'param_groups': [group]}

    def from_state_dict(self, state_dict: Mapping, params: Mapping[str, torch.Tensor]) -> dict:
        """The state of `params` from an Optimizer's state_dict (cbopt's, torch.optim's or fastai's: read as
        `Optimizer.load_state_dict` reads it, as strictly), with its dynamic hypers; a fixed hyper it sets to
        another value than this optimizer's is an error naming it."""
        self._check_params(params)
        opt = Optimizer([(n, p.detach()) for n, p in params.items()], self.cbs, **self.defaults)
        opt.load_state_dict(state_dict)
        saved = opt.named_state_dict()
        group = saved['param_groups'][0]
        for k, v in self.hypers.items():
            if k in group and group[k] != v:
                raise ValueError(f"the state_dict sets {k}={group[k]!r}, but {k} is fixed at {v!r} here: build the "
                                 f"functional optimizer with {k}={group[k]!r}, or make {k!r} dynamic")
        state = self.init(params)
        for n, st in saved['state'].items(): state[n] = {k: _tensor(v, params[n]) for k, v in st.items()}
        state[HYPERS] = {k: _tensor(group[k], next(iter(params.values()))) for k in self.dynamic}
        return state

    # -- checks --------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_params(params: Any) -> None:
        if not isinstance(params, Mapping) or not params:
            raise TypeError(f"params must be a non-empty dict of tensors by name (dict(model.named_parameters())), "
                            f"got {type(params).__name__}")
        if HYPERS in params: raise ValueError(f"a param is named {HYPERS!r}, the state's entry for the hypers: rename it")
        for k, v in params.items():
            if not isinstance(v, torch.Tensor): raise TypeError(f"params[{k!r}] is a {type(v).__name__}, not a tensor")

    def _check(self, params: Mapping, grads: Any, state: Any, hypers: Mapping) -> None:
        "Everything `update` refuses, before anything runs: each error names the culprit."
        self._check_params(params)
        if not isinstance(grads, Mapping): raise TypeError(f"grads must be a dict of tensors by name, got {type(grads).__name__}")
        for k, g in grads.items():
            if k not in params: raise KeyError(f"grads has {k!r}, which is not in params")
            if g is not None and (not isinstance(g, torch.Tensor) or g.shape != params[k].shape):
                raise ValueError(f"grad {k!r} is {type(g).__name__} {tuple(getattr(g, 'shape', ()))}, "
                                 f"param {k!r} has shape {tuple(params[k].shape)}")
        if not isinstance(state, Mapping) or HYPERS not in state:
            raise TypeError(f"state must be the dict init(params) makes, with its {HYPERS!r} entry")
        for k in params:
            if k not in state: raise KeyError(f"param {k!r} has no state: make the state with init(params)")
            for key, v in state[k].items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"state {key!r} of param {k!r} is a {type(v).__name__}: the functional state holds "
                                    "tensors (from_state_dict converts an Optimizer's)")
        if any(k not in self._reads for k in hypers): _check_read(hypers, [self.cbs], ' (given to update)')  # raises
        for k, v in hypers.items():
            if not isinstance(v, torch.Tensor): check_hyper(k, v)  # a tensor's value is not read: it may be traced
            elif v.dim() != 0 or not v.is_floating_point():
                raise TypeError(f"hyper {k!r} given to update is a tensor of shape {tuple(v.shape)} and dtype {v.dtype}: "
                                "expected a number or a 0-d floating-point tensor")


def _chain_and_hypers(factory_or_cbs: Any, hypers: Mapping) -> tuple[list, dict]:
    "The chain and hypers of a prebuilt optimizer's factory (`cbopt.Adam`), an Optimizer, or a list of callbacks."
    one = [('param', torch.zeros(1))]
    if isinstance(factory_or_cbs, Optimizer):
        if hypers: raise TypeError("functional(opt) takes the optimizer's own hypers: set them on the optimizer first")
        opt = factory_or_cbs
    elif isinstance(factory_or_cbs, (list, tuple)): opt = Optimizer(one, list(factory_or_cbs), **hypers)
    elif callable(factory_or_cbs):
        if declared_state(factory_or_cbs) is not None:
            raise TypeError(f"functional({cb_name(factory_or_cbs)}): a callback, not a factory: give a chain as a list, "
                            f"[{cb_name(factory_or_cbs)}]")
        opt = factory_or_cbs(one, **hypers)
        if not isinstance(opt, Optimizer):
            raise TypeError(f"functional({getattr(factory_or_cbs, '__name__', factory_or_cbs)}) expected a factory "
                            f"returning a cbopt.Optimizer (such as cbopt.Adam), got a {type(opt).__name__}; give a chain "
                            "as a list of callbacks")
    else: raise TypeError(f"functional() takes a factory (cbopt.Adam), an Optimizer or a list of callbacks, not "
                          f"{type(factory_or_cbs).__name__}")
    return _one_group(opt)


def _one_group(opt: Optimizer) -> tuple[list, dict]:
    "The chain and hypers of an Optimizer whose param groups all run one chain with one set of hypers."
    chains = {chain_name(g['cbs']) for g in opt.param_groups}
    hs = [Hypers(g).snapshot() for g in opt.param_groups]
    if len(chains) > 1 or any(h != hs[0] for h in hs):
        raise ValueError(f"functional() runs one chain with one set of hypers, but this optimizer's {len(hs)} param "
                         f"groups differ ({' and '.join(sorted(chains))}; e.g. Muon's matrices and the rest): make one "
                         "functional optimizer per group")
    return list(opt.param_groups[0]['cbs']), hs[0]


def functional(factory_or_cbs: Callable | Iterable[Callable] | Optimizer, dynamic: Iterable[str] | None = None,
               **hypers) -> FunctionalOptimizer:
    """The pure form of an optimizer: `cbopt.functional(cbopt.Adam, lr=1e-3, wd=0.01)`, or of a chain:
    `cbopt.functional([cbopt.weight_decay, ...], lr=...)`, with the same hyper defaults and checks as the Optimizer.
    `dynamic` names the hypers kept as tensors in the state (default: `lr`; see the module docstring).

    ```python
    import torch, cbopt
    params = {'w': torch.randn(3)}
    fopt = cbopt.functional(cbopt.Adam, lr=1e-2)
    state = fopt.init(params)
    new_params, state = fopt.update(params, {'w': torch.ones(3)}, state)   # pure: `params` is unchanged
    assert not torch.equal(new_params['w'], params['w'])
    ```
    """
    fopt = FunctionalOptimizer(*_chain_and_hypers(factory_or_cbs, hypers), dynamic)
    if callable(factory_or_cbs) and not isinstance(factory_or_cbs, (Optimizer, list, tuple)):
        fopt._regroup = lambda params: factory_or_cbs(params, **hypers)  # init checks how it groups the real params
    return fopt


class _CallableModule(types.ModuleType):
    """`cbopt.functional` is this module and its main function at once: `cbopt.functional(cbopt.Adam, lr=...)` builds
    a `FunctionalOptimizer`, while `cbopt.functional.FunctionalOptimizer` (and the rest of the module) stays reachable
    under the same name, as optax keeps its transforms beside its `chain`."""
    def __call__(self, *args, **kwargs) -> FunctionalOptimizer: return functional(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
