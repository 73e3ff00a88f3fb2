"""`cbopt.functional`: any chain as a pure `init(params)` and `update(params, grads, state, **hypers)` over pytrees of
tensors (flat `{fqn: tensor}` dicts, nested dicts, lists, tuples, namedtuples), which pass through `torch.func`
(`vmap`, `grad`) and `torch.compile(fullgraph=True)`; `partition` runs several of them on labelled subsets (optax's).

The same callbacks run here as in `Optimizer.step`, through the same `run_param` (`cbopt.chain.run_chain`) as the
`loop` backend; only the stand-in for a param differs. A `Slot`'s `.data` is the live tensor, where a real param's
`.data` is a detached alias that hides every write from autograd, so gradients flow through `update`. Callbacks
write in place, which autograd differentiates only once the writes are made functional: eager `update` runs under
`torch.func.functionalize` (under `torch.compile`, AOTAutograd does the same). A grad's `.data` is the grad
itself (vmap refuses `.data`; under functionalize it cuts nothing anyway, as autograd works beneath the wrappers it
detaches), so meta-gradients flow through the grads too. `update` steps copies, so its inputs never change, and a
failing callback leaves nothing half-done.

State mirrors the params: each param's `{name: tensor}` (the Optimizer's names and values) where the param is, in a
dict (a params dict's keys at its top level; other containers under `'params'`). What the Optimizer keeps as a Python
number (a step count) is a 0-d float64 tensor here, so a new count neither retraces nor recompiles. The hypers named
in `dynamic` (`lr` by default) are 0-d tensors in the state too, under `'hypers'`: each update reads them there and
returns the values it used (optax's `inject_hyperparams`), so they can be read, scheduled, differentiated and set
per member under vmap. The other hypers are fixed numbers of the functional optimizer (`fopt.hypers`), because
callbacks may branch on them in Python (`if wd != 0`). A param's FQN is its dotted path (`'encoder.0.weight'`), so a
nested and a flat form of the same params have the same state_dict.

Whole-model callbacks at the start of the chain (`clip_grad_norm`, `skip_nonfinite`, `accumulate_grads`...) run in
their pure forms (`cbopt.callbacks.whole_model.PURE`), on every grad at once, their own state in the state under
their name (`state['skip_nonfinite']['skipped_total']`), their per-param state in each param's (as the Optimizer's,
`'accumulate_grads.grad_sum'`). A skipped step is data, not control flow: the chain runs, and `torch.where` keeps the
old params and state, so it batches and compiles.
"""
from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Mapping
from numbers import Number
from typing import Any

import torch

from ._torch import data_getter, tree_get, tree_leaves, tree_paths
from .callbacks.whole_model import PURE
from .core.chain import (cb_name, chain_name, chain_reads, declared_state, init_chain_state, is_declared, model_key,
                         param_chain, split_chain, transient_keys, unwrap)
from .core.runtime import param_states
from .engine.dispatch import check_grads
from .engine.model_stage import model_plan
from .core.spec import spec
from .engine.scalars import ScalarArgsAsTensors
from .engine.foreach import run_param
from .engine.traced import VALUE_READS as _VALUE_READS, number_tensor as _tensor
from .core.hypers import Hypers, check_hyper
from .optimizer import STANDARD_HYPERS, Optimizer, _check_read
from .core.initial import chain_initial_state

__all__ = ['functional', 'FunctionalOptimizer', 'FunctionalError', 'Slot', 'HYPERS', 'PARAMS', 'partition', 'Partition',
           'differentiable_step']

HYPERS = 'hypers'
"""The functional state's entry for the dynamic hypers (`state[HYPERS]['lr']`), so no param may have this name."""
PARAMS = 'params'
"""The state's entry for the params' states where the params are not a dict (a list, a tuple): `state['params']`."""
_DATA = data_getter()  # the `.data` getter, as a torch function mode sees it


_SYM = {torch.sym_max: torch.maximum, torch.sym_min: torch.minimum}


class FunctionalError(TypeError):
    """A callback that cannot run in the functional form: a whole-model callback with no pure form (or listed after the
    chain), or an `if` on a tensor under vmap."""


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


def _run_copies(cbs: list, transient: frozenset, params: list, grads: list, states: list, hyper: Mapping,
               differentiable: bool) -> tuple[list, list]:
    """The chain on a copy of each param, its grad and its state (callbacks write in place, into the copies): the new
    params and state dicts, the inputs unchanged. `differentiable`: run under `torch.func.functionalize` (see
    `_FunctionalMode`). What `update` and the Optimizer's differentiable step (`differentiable_step`) both run."""
    new_params, new_states = [], []
    with _FunctionalMode(cbs, differentiable):
        for p, g, st in zip(params, grads, states):
            slot = Slot(p.clone(), g.clone())
            st = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
            run_param(cbs, slot, st, hyper, transient)
            new_params.append(slot.data)
            new_states.append(st)
    return new_params, new_states


def _real(t: Any) -> Any:
    "A complex tensor as a real view of its (real, imaginary) pairs, in autograd's graph (writes reach it); else `t`."
    return torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() else t


def differentiable_step(opt: Optimizer, closure: Callable | None = None, loss: Any = None) -> None:
    """`opt.step()` recorded by autograd: torch.optim's `differentiable=True` (cbopt.optim's classes run their step
    with this). Each group's chain runs as `update` runs it, out of place on copies under functionalize
    (`_run_copies`), with grad mode on; then each param and state tensor takes its new value in place (`copy_`,
    recorded), so the tensors the user holds are the same objects, now with the step in their history:
    `torch.autograd.grad` of a loss after the step reaches the params, grads, state and tensor hypers (a tensor lr,
    betas) before it. Python numbers (the step count) stay numbers; complex params step on real views, as in every
    backend (`engine.buckets.as_real`, whose views are detached: here they are not). All or nothing: every group is
    computed, and every tensor to be written checked, before any is written; a param or state tensor that is a leaf
    requiring grad cannot be written in place under autograd (torch's rule and words: step a clone of it, as torch's
    differentiable optimizers want)."""
    plan = model_plan(opt.param_groups)
    if plan[0] or plan[1]:
        raise NotImplementedError(f"a differentiable step of a chain with whole-model callbacks "
                                  f"({', '.join(cb_name(cb) for cb, _ in [*plan[0], *plan[1]])}) is not supported")
    check_grads(opt)
    for g in opt.param_groups:
        for name, p in zip(g['param_names'], g['params']):
            if p.grad is not None and p.grad.is_sparse:  # (functionalize cannot run sparse ops: torch asserts inside)
                raise RuntimeError(f"param {name!r} has a sparse gradient, which a differentiable step does not support "
                                   "(torch.func.functionalize cannot trace sparse ops): densify it with grad.to_dense(), "
                                   "or step with differentiable=False")
    states = param_states(opt)
    writes = []  # (param name, 'param' or state key, tensor written in place or state dict, new value)
    with torch.enable_grad():
        for g in opt.param_groups:
            named = [(n, p) for n, p in zip(g['param_names'], g['params']) if p.grad is not None]
            if not named: continue
            hyper, cbs, transient = Hypers(g).snapshot(), param_chain(g['cbs']), transient_keys(g['cbs'])
            qs = [_real(p) for _, p in named]
            sts = [{k: _real(v) for k, v in states[p].items()} for _, p in named]
            run = lambda params, grads, sts, hyper: _run_copies(cbs, transient, params, grads, sts, hyper, True)
            new_params, new_states = torch.func.functionalize(run)(qs, [_real(p.grad) for _, p in named], sts, hyper)
            for (name, p), q, st, new_q, new_st in zip(named, qs, sts, new_params, new_states):
                writes.append((name, 'param', q, new_q))
                for k, v in new_st.items():
                    old = st.get(k)
                    if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape \
                            and old.dtype == v.dtype and old.device == v.device: writes.append((name, k, old, v))
                    else:  # (a new entry: complex where the param is, as in every backend)
                        as_complex = q is not p and isinstance(v, torch.Tensor) and v.shape == q.shape and v.dtype == q.dtype
                        writes.append((name, k, states[p], torch.view_as_complex(v) if as_complex else v))
                writes += [(name, k, states[p], None) for k in st if k not in new_st]  # (transient entries: dropped)
        for name, what, target, _ in writes:
            base = target._base if isinstance(target, torch.Tensor) and target._base is not None else target
            if isinstance(base, torch.Tensor) and base.is_leaf and base.requires_grad:  # (a complex one's real view too)
                raise RuntimeError(f"a leaf Variable that requires grad is being used in an in-place operation: "
                                   f"{'param' if what == 'param' else f'state {what!r} of param'} {name!r} is one (a "
                                   "differentiable step writes into it: give the optimizer a clone, p.clone())")
        for name, what, target, v in writes:
            if isinstance(target, torch.Tensor): target.copy_(v)
            elif v is None: target.pop(what, None)
            else: target[what] = v
    opt.step_stats = {'lr': [Hypers(g).snapshot().get('lr') for g in opt.param_groups], 'skipped': False}


# -- params as pytrees ----------------------------------------------------------------------------------------------
class _Tree:
    """Params (or grads) of any pytree form, flat: `fqns` (dotted paths), `leaves`, and `nest` to mirror the structure
    with a state per param. A flat `{str: tensor}` dict is read as it is (no pytree walk)."""
    def __init__(self, tree: Any, what: str = 'params'):
        if isinstance(tree, Mapping) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tree.items()):
            self.paths, self.leaves = [(k,) for k in tree], list(tree.values())
            keys = list(tree)
            self.rebuild = lambda leaves: dict(zip(keys, leaves))
        elif isinstance(tree, (Mapping, list, tuple)): self.paths, self.leaves, self.rebuild = tree_paths(tree)
        else: raise TypeError(f"{what} must be a dict of tensors by name (dict(model.named_parameters())), or nested "
                              f"dicts, lists or tuples of them, got {type(tree).__name__}")
        self.mapping = isinstance(tree, Mapping)
        self.fqns = ['.'.join(map(str, p)) for p in self.paths]
        if len(set(self.fqns)) != len(self.fqns):
            dup = next(f for i, f in enumerate(self.fqns) if f in self.fqns[:i])
            raise ValueError(f"two {what} have the FQN {dup!r} (a key with dots and a nested dict?): FQNs must be unique")

    def flat(self) -> dict: return dict(zip(self.fqns, self.leaves))

    def part(self, state: Mapping) -> Any:
        "The part of `state` that mirrors the params."
        return state if self.mapping else state[PARAMS]

    def nest(self, per_param: Mapping, extra: Mapping) -> dict:
        "The state: `per_param` (by FQN) where the params are, and `extra` (hypers, whole-model state) beside them."
        mirror = self.rebuild([per_param[f] for f in self.fqns])
        return {**mirror, **extra} if self.mapping else {PARAMS: mirror, **extra}

    def unnest(self, state: Mapping) -> dict:
        "Each param's state from a state `nest` made: `{fqn: {name: tensor}}`."
        part, out = self.part(state), {}
        for f, path in zip(self.fqns, self.paths):
            try: out[f] = tree_get(part, path)
            except (KeyError, IndexError, AttributeError, TypeError):
                raise KeyError(f"param {f!r} has no state: make the state with init(params)") from None
        return out


def _flat_grads(grads: Any, params: Mapping) -> dict:
    "The grads by FQN, any pytree form (None, or a missing entry: no grad, that param is not stepped)."
    if not isinstance(grads, (Mapping, list, tuple)):
        raise TypeError(f"grads must be a dict of tensors by name (or the params' pytree form), got {type(grads).__name__}")
    if isinstance(grads, Mapping) and all(isinstance(k, str) and (g is None or isinstance(g, torch.Tensor))
                                          for k, g in grads.items()):
        flat = dict(grads)
    else:
        paths, leaves, _ = tree_paths(grads)
        flat = {'.'.join(map(str, p)): g for p, g in zip(paths, leaves)}
    for k, g in flat.items():
        if k not in params: raise KeyError(f"grads has {k!r}, which is not in params")
        if g is not None and (not isinstance(g, torch.Tensor) or g.shape != params[k].shape):
            raise ValueError(f"grad {k!r} is {type(g).__name__} {tuple(getattr(g, 'shape', ()))}, "
                             f"param {k!r} has shape {tuple(params[k].shape)}")
    return {k: flat.get(k) for k in params}


def _param_states(part: Any, prefix: str = '') -> dict:
    """`{fqn: {name: tensor}}` from the params' part of a state, without the params: a dict of tensors (or an empty
    one) is a param's state, any other dict, list or tuple is the params' nesting."""
    if isinstance(part, Mapping) and all(isinstance(v, torch.Tensor) for v in part.values()) and prefix:
        return {prefix[:-1]: part}
    if isinstance(part, Mapping): items = part.items()
    elif isinstance(part, (list, tuple)): items = zip(part._fields if hasattr(part, '_fields') else range(len(part)), part)
    else: raise TypeError(f"the state at {prefix[:-1]!r} is a {type(part).__name__}: not a state init(params) made")
    return {f: st for k, v in items for f, st in _param_states(v, f'{prefix}{k}.').items()}


# -- the step's whole-model stage, as data: a skip is a bool tensor (or False) --------------------------------------
def _any(flags: Iterable) -> Any:
    out: Any = False
    for f in flags:
        if f is not None and f is not False: out = f if out is False else out | f
    return out


def _not(x: Any) -> Any: return (not x) if isinstance(x, bool) else ~x


def _and(a: Any, b: Any) -> Any:
    if a is False or b is False: return False
    return b if a is True else a if b is True else a & b


def _or(a: Any, b: Any) -> Any:
    if a is True or b is True: return True
    return b if a is False else a if b is False else a | b


def _where(cond: Any, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    "`new` where `cond` (True, False, or a 0-d bool tensor), else `old`."
    if cond is True: return new
    if cond is False: return old
    return torch.where(cond, new, old)


class FunctionalOptimizer:
    """A chain as a pure pair, `init(params) -> state` and `update(params, grads, state, **hypers) -> (params,
    state)` (see the module docstring), with converters from and to an Optimizer's state_dict. Made by
    `cbopt.functional`."""

    def __init__(self, cbs: list, hypers: Mapping[str, Any], dynamic: Iterable[str] | None = None):
        pre, chain, post = split_chain(cbs)
        for cb in post:
            raise FunctionalError(f"whole-model callback {cb_name(cb)!r} runs after the per-param chain, which the "
                                  "functional update does not: apply it to the new params after `update` instead")
        for cb in pre:
            if cb not in PURE:
                raise FunctionalError(f"whole-model callback {cb_name(cb)!r} steps every param at once and has no pure "
                                      "form (cbopt.callbacks.whole_model.PURE lists those that have one): apply it to "
                                      "the grads before `update` instead")
        if pre and not is_declared(chain):
            raise FunctionalError(f"whole-model callbacks ({chain_name(pre)}) may skip a step, which the functional "
                                  f"update undoes with torch.where on the chain's state: the chain [{chain_name(chain)}] "
                                  "must declare its state (`cb.state`)")
        if any(cb_name(cb) == 'skip_nonfinite' for cb in pre) and hypers.get('max_consecutive') is not None:
            raise FunctionalError("whole-model callback 'skip_nonfinite' with max_consecutive raises once training "
                                  "diverges, which a pure update cannot (under vmap or torch.compile): set "
                                  "max_consecutive=None and read state['skip_nonfinite']['skipped_consecutive']")
        self.cbs, self.chain, self.model_cbs = list(cbs), chain, pre
        self.transient = transient_keys(chain)
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
        self._model = {cb_name(cb): cb for cb in pre}  # whole-model callbacks by name: their state's entries
        self._model_keys = {model_key(cb, k) for cb in pre for k in spec(cb).param_state}
        self.reserved = frozenset({HYPERS, *self._model})

    def __repr__(self) -> str:
        return f"FunctionalOptimizer([{chain_name(self.cbs)}], dynamic={self.dynamic}, hypers={self.hypers})"

    # -- pure init and update ------------------------------------------------------------------------------------
    def init(self, params: Any) -> dict:
        """Each param's state before its first step (as the Optimizer's state after `init_state()`), mirroring the
        params' nesting, beside the dynamic hypers (`'hypers'`) and each whole-model callback's state (under its
        name). A chain with an undeclared (fastai-style) callback starts empty, as an Optimizer does: its first update
        creates the state (under torch.compile, that is one more trace)."""
        tree = _Tree(params)
        flat = self._check_params(tree)
        if self._regroup is not None:  # a factory may group params by shape (Muon): the real ones must be one group
            cbs, hypers = _one_group(self._regroup([(n, torch.empty(p.shape, dtype=p.dtype, device='meta'))
                                                    for n, p in flat.items()]))
            if chain_name(cbs) != chain_name(self.cbs) or hypers != self.defaults:
                raise ValueError(f"the factory gives these params the chain [{chain_name(cbs)}] with {hypers}, not "
                                 f"[{chain_name(self.cbs)}] with {self.defaults} as it gave one param: make the "
                                 "functional optimizer from a list of callbacks, or a partition")
        return tree.nest(*self._init_flat(flat))

    def _init_flat(self, params: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        "`(each param's state by FQN, the other entries)` for `init`."
        declared = is_declared(self.cbs)
        state = {name: {k: _tensor(v, p) for k, v in init_chain_state(self.cbs, Slot(p)).items()} if declared else {}
                 for name, p in params.items()}
        like = next(iter(params.values()))
        extra = {HYPERS: {k: _tensor(self.defaults[k], like) for k in self.dynamic},
                 **{name: {k: _tensor(v, like) for k, v in (spec(cb).state or {}).items()}
                    for name, cb in self._model.items()}}
        return state, extra

    def update(self, params: Any, grads: Any, state: Mapping, **hypers) -> tuple[Any, dict]:
        """One step of every param with a grad: `(new params, new state)` in the params' form, the inputs left
        unchanged. `grads` is in the params' form or by FQN; a missing or None grad leaves its param as it is.
        `hypers` (numbers or 0-d tensors) apply to this call; the dynamic ones are also kept in the returned state."""
        tree = _Tree(params)
        flat = self._check_params(tree)
        new_params, per_param, extra = self._update_flat(flat, _flat_grads(grads, flat), tree.unnest(state), state, hypers)
        return tree.rebuild([new_params[f] for f in tree.fqns]), tree.nest(per_param, extra)

    def _update_flat(self, params: dict, grads: dict, states: dict, state: Mapping, hypers: Mapping) -> tuple:
        "`update` by FQN: `(new params, each param's new state, the other entries)`."
        self._check(params, states, state, hypers)
        hyper = {**self.hypers, **state[HYPERS], **hypers}
        args = (params, grads, states, {n: state[n] for n in self._model}, hyper)
        differentiable = _records(args)
        run = torch.func.functionalize(self._run) if differentiable else self._run
        new_params, new_state, new_model = run(*args, differentiable)
        like = next(iter(params.values()))
        return new_params, new_state, {HYPERS: {k: _tensor(hyper[k], like) for k in self.dynamic}, **new_model}

    def _model_stage(self, grads: dict, states: dict, model: dict, hyper: dict) -> tuple[dict, dict, dict, Any]:
        """The whole-model callbacks' pure forms over the grads, as `run_model_step` runs them: `(the grads the chain
        sees, each param's state with the callbacks' per-param entries, their own state, skip)`. A callback's own
        state is kept when no earlier one skips and either it skips or no later one does (the Optimizer commits the
        state of the callbacks before a skip only if none skips); its per-param entries whenever it runs."""
        names = list(grads)
        outs, cur = [], list(grads.values())
        for cb in self.model_cbs:
            name, s = cb_name(cb), spec(cb)
            per_param = {k: [states[n][model_key(cb, k)] for n in names] for k in s.param_state}
            out = PURE[cb](cur, **{**per_param, **model[name], **hyper})
            outs.append((cb, out, per_param))
            cur = out.get('grads', cur)
        flags = [out.get('skip', False) for _, out, _ in outs]
        new_model, new_states = {}, {n: dict(states[n]) for n in states}
        for i, (cb, out, per_param) in enumerate(outs):
            name, ran = cb_name(cb), _not(_any(flags[:i]))
            keep = _and(ran, _or(flags[i], _not(_any(flags[i + 1:]))))
            new_model[name] = {k: _where(keep, out.get(k, v), v) for k, v in model[name].items()}
            for k, olds in per_param.items():
                for n, new, old in zip(names, out.get(k, olds), olds): new_states[n][model_key(cb, k)] = _where(ran, new, old)
        return dict(zip(names, cur)), new_states, new_model, _any(flags)

    def _run(self, params: dict, grads: dict, states: dict, model: dict, hyper: dict,
             differentiable: bool) -> tuple[dict, dict, dict]:
        "The whole-model stage, then the chain on a copy of each param with a grad, its grad and its state."
        stepped = {n: g for n, g in grads.items() if g is not None}
        skip: Any = False
        if self.model_cbs and stepped:
            stepped, states, model, skip = self._model_stage(stepped, states, model, hyper)
        names = [n for n in params if n in stepped]
        copies = _run_copies(self.chain, self.transient, [params[n] for n in names], [stepped[n] for n in names],
                             [states[n] for n in names], hyper, differentiable)
        ran = dict(zip(names, zip(*copies)))
        new_params, new_state = {}, {}
        for name, p in params.items():
            if name not in ran:
                new_params[name], new_state[name] = p, states[name]
                continue
            q, st = ran[name]
            new_params[name] = _where(_not(skip), q, p)
            new_state[name] = {k: states[name][k] if k in self._model_keys else
                               _where(_not(skip), _tensor(v, q), states[name][k]) if k in states[name] else
                               _tensor(v, q) for k, v in st.items()}
        return new_params, new_state, dict(model)

    # -- converters ----------------------------------------------------------------------------------------------
    def to_state_dict(self, state: Mapping) -> dict:
        """`state` as a cbopt state_dict, `{'state': {fqn: {...}}, 'param_groups': [{hypers, 'chain', 'params'}]}`,
        with the Optimizer's Python numbers (step counts, the whole-model callbacks' counts in the group): an
        Optimizer over the same params and chain (one group) loads it. A nested state gives what its flat form does."""
        pstates = _param_states(_params_part(state, self.reserved))
        as_saved = lambda k, v: self._numbers[k](v.item()) if k in self._numbers else v.detach().clone()
        model = {model_key(cb, k): type(v)(state[name][k].item())
                 for name, cb in self._model.items() for k, v in (spec(cb).state or {}).items()}
        group = {**self.hypers, **{k: v.item() for k, v in state[HYPERS].items()}, **model,
                 'chain': chain_name(self.cbs), 'params': list(pstates)}
        return {'state': {n: {k: as_saved(k, v) for k, v in st.items()} for n, st in pstates.items() if st},
                'param_groups': [group]}

    def from_state_dict(self, state_dict: Mapping, params: Any) -> dict:
        """The state of `params` (any pytree form) from an Optimizer's state_dict (cbopt's, torch.optim's or
        fastai's: read as `Optimizer.load_state_dict` reads it, as strictly), with its dynamic hypers and whole-model
        state; a fixed hyper it sets to another value than this optimizer's is an error naming it."""
        tree = _Tree(params)
        flat = self._check_params(tree)
        opt = Optimizer([(n, p.detach()) for n, p in flat.items()], self.cbs, **self.defaults)
        opt.load_state_dict(state_dict)
        saved = opt.named_state_dict()
        return tree.nest(*self._from_saved(saved['state'], saved['param_groups'][0], flat))

    def _from_saved(self, saved: Mapping, group: Mapping, params: Mapping) -> tuple[dict, dict]:
        "`from_state_dict` from an Optimizer's `named_state_dict()` state and this chain's group in it."
        for k, v in self.hypers.items():
            if k in group and group[k] != v:
                raise ValueError(f"the state_dict sets {k}={group[k]!r}, but {k} is fixed at {v!r} here: build the "
                                 f"functional optimizer with {k}={group[k]!r}, or make {k!r} dynamic")
        state, extra = self._init_flat(params)
        for n in params:
            if n in saved: state[n] = {k: _tensor(v, params[n]) for k, v in saved[n].items()}
        like = next(iter(params.values()))
        extra[HYPERS] = {k: _tensor(group[k], like) for k in self.dynamic}
        for name, cb in self._model.items():
            extra[name] = {k: _tensor(group.get(model_key(cb, k), v), like) for k, v in (spec(cb).state or {}).items()}
        return state, extra

    # -- checks --------------------------------------------------------------------------------------------------
    def _check_params(self, tree: _Tree) -> dict:
        "The params by FQN, checked."
        if not tree.fqns:
            raise TypeError("params must be a non-empty dict of tensors by name (dict(model.named_parameters())), "
                            "or nested dicts, lists or tuples of them")
        if tree.mapping and {p[0] for p in tree.paths} == {PARAMS} and tree.paths[0][1:2] and isinstance(tree.paths[0][1], int):
            raise ValueError(f"the params are a dict whose only entry {PARAMS!r} is a list or tuple, which their state "
                             "could not tell from that list's own: give the list itself, or another name")
        for path, f in zip(tree.paths, tree.fqns):
            if tree.mapping and path[0] in self.reserved:
                raise ValueError(f"a param is named {path[0]!r}, the state's entry for "
                                 f"{'the hypers' if path[0] == HYPERS else 'that whole-model callback'}: rename it")
        for f, v in zip(tree.fqns, tree.leaves):
            if not isinstance(v, torch.Tensor): raise TypeError(f"params[{f!r}] is a {type(v).__name__}, not a tensor")
        return tree.flat()

    def _check(self, params: Mapping, states: Mapping, state: Any, hypers: Mapping) -> None:
        "Everything `update` refuses, before anything runs: each error names the culprit."
        if not isinstance(state, Mapping) or HYPERS not in state or any(n not in state for n in self._model):
            raise TypeError(f"state must be the dict init(params) makes, with its {HYPERS!r} entry"
                            + ''.join(f" and its {n!r} entry" for n in self._model))
        for k, st in states.items():
            if not isinstance(st, Mapping):
                raise TypeError(f"the state of param {k!r} is a {type(st).__name__}: make the state with init(params)")
            for key, v in st.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"state {key!r} of param {k!r} is a {type(v).__name__}: the functional state holds "
                                    "tensors (from_state_dict converts an Optimizer's)")
        if any(k not in self._reads for k in hypers): _check_read(hypers, [self.cbs], ' (given to update)')  # raises
        for k, v in hypers.items():
            if not isinstance(v, torch.Tensor): check_hyper(k, v)  # a tensor's value is not read: it may be traced
            elif v.dim() != 0 or not v.is_floating_point():
                raise TypeError(f"hyper {k!r} given to update is a tensor of shape {tuple(v.shape)} and dtype {v.dtype}: "
                                "expected a number or a 0-d floating-point tensor")


def _params_part(state: Mapping, reserved: Iterable[str]) -> Any:
    "The part of a state that mirrors the params: a list or tuple under `'params'`, else the state less `reserved`."
    rest = {k: v for k, v in state.items() if k not in reserved}
    return rest[PARAMS] if rest.keys() == {PARAMS} and isinstance(rest[PARAMS], (list, tuple)) else rest


class Partition:
    """optax's `partition` (`multi_transform`): each param is stepped by the functional optimizer of its label, as an
    Optimizer steps each param group with its own chain and hypers. Made by `cbopt.functional.partition`, or by
    `cbopt.functional(factory)` for a factory that splits the params into groups (`cbopt.Muon`: its matrices and the
    rest). The state is `{label: that optimizer's state over its params, by FQN}` (labels without params left out)."""

    def __init__(self, transforms: Mapping[Any, FunctionalOptimizer], labels: Mapping | Callable | None):
        for label, t in transforms.items():
            if not isinstance(t, FunctionalOptimizer):
                raise TypeError(f"transforms[{label!r}] is a {type(t).__name__}, not a functional optimizer "
                                "(cbopt.functional(...))")
        if labels is not None and not callable(labels) and not isinstance(labels, Mapping):
            raise TypeError(f"labels must be a dict fqn -> label (or the params' nesting of labels), or a function "
                            f"(fqn, param) -> label, got {type(labels).__name__}")
        self.transforms, self.labels = dict(transforms), labels

    def __repr__(self) -> str:
        return f"Partition({', '.join(f'{k!r}: {t!r}' for k, t in self.transforms.items())})"

    def _parts(self, flat: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        "`(transforms by label, label by FQN)` for the params `flat`."
        if callable(self.labels): labels = {f: self.labels(f, p) for f, p in flat.items()}
        else:
            tree = self.labels if all(isinstance(k, str) and not isinstance(v, (Mapping, list, tuple))
                                      for k, v in self.labels.items()) else None
            if tree is None:
                paths, leaves, _ = tree_paths(self.labels)
                tree = {'.'.join(map(str, p)): v for p, v in zip(paths, leaves)}
            for f in flat:
                if f not in tree: raise KeyError(f"labels has no label for param {f!r}")
            labels = {f: tree[f] for f in flat}
        for f, label in labels.items():
            if label not in self.transforms:
                raise ValueError(f"param {f!r} has the label {label!r}, which has no transform: the transforms are "
                                 f"{list(self.transforms)}")
        return self.transforms, labels

    @staticmethod
    def _split(transforms: Mapping, labels: Mapping, flat: Mapping) -> dict:
        "`{label: {fqn: value}}` of the labels with params, in the transforms' order."
        out = {label: {f: v for f, v in flat.items() if labels[f] == label} for label in transforms}
        return {label: sub for label, sub in out.items() if sub}

    def init(self, params: Any) -> dict:
        "Each label's state over its params (`FunctionalOptimizer.init` of its subset, by FQN)."
        flat = _checked(_Tree(params))
        transforms, labels = self._parts(flat)
        return {label: transforms[label].init(sub) for label, sub in self._split(transforms, labels, flat).items()}

    def update(self, params: Any, grads: Any, state: Mapping, **hypers) -> tuple[Any, dict]:
        """One step of each label's params by its optimizer: `(new params in the params' form, new state)`. A hyper
        given here goes to every optimizer whose chain reads it (one that none reads is an error naming it)."""
        tree = _Tree(params)
        flat = _checked(tree)
        transforms, labels = self._parts(flat)
        unread = [k for k in hypers if not any(k in t._reads for t in transforms.values())]
        if unread: _check_read(unread, [t.cbs for t in transforms.values()], ' (given to update)')  # raises
        g = _flat_grads(grads, flat)
        new, new_state = dict(flat), {}
        for label, sub in self._split(transforms, labels, flat).items():
            if not isinstance(state, Mapping) or label not in state:
                raise KeyError(f"the state has no entry for label {label!r}: make the state with init(params)")
            t = transforms[label]
            ps, new_state[label] = t.update(sub, {f: g[f] for f in sub}, state[label],
                                            **{k: v for k, v in hypers.items() if k in t._reads})
            new.update(ps)
        return tree.rebuild([new[f] for f in tree.fqns]), new_state

    def to_state_dict(self, state: Mapping) -> dict:
        """`state` as a cbopt state_dict with one param group per label (in the transforms' order): an Optimizer
        grouping the same params so (the same chains and hypers) loads it."""
        out: dict = {'state': {}, 'param_groups': []}
        for label, t in self.transforms.items():
            if label not in state: continue
            sd = t.to_state_dict(state[label])
            out['state'].update(sd['state'])
            out['param_groups'] += sd['param_groups']
        return out

    def from_state_dict(self, state_dict: Mapping, params: Any) -> dict:
        """The state of `params` from an Optimizer's state_dict whose groups hold each label's params (matched by
        name, as `Optimizer.load_state_dict` matches them, as strictly)."""
        flat = _checked(_Tree(params))
        transforms, labels = self._parts(flat)
        split = self._split(transforms, labels, flat)
        groups = [{'params': [p.detach() for p in sub.values()], 'param_names': list(sub), 'cbs': transforms[label].cbs,
                   **transforms[label].defaults} for label, sub in split.items()]
        opt = Optimizer(groups, groups[0]['cbs'])
        opt.load_state_dict(state_dict)
        saved = opt.named_state_dict()
        return {label: _Tree(sub).nest(*transforms[label]._from_saved(saved['state'], group, sub))
                for (label, sub), group in zip(split.items(), saved['param_groups'])}


def _checked(tree: _Tree) -> dict:
    "The params by FQN, each a tensor."
    if not tree.fqns: raise TypeError("params must be a non-empty dict of tensors by name, or a nesting of them")
    for f, v in zip(tree.fqns, tree.leaves):
        if not isinstance(v, torch.Tensor): raise TypeError(f"params[{f!r}] is a {type(v).__name__}, not a tensor")
    return tree.flat()


def partition(transforms: Mapping[Any, FunctionalOptimizer], labels: Mapping | Callable) -> Partition:
    """optax's `partition`: `transforms` maps each label to a functional optimizer, `labels` each param to its label
    (a dict fqn -> label, the params' own nesting of labels, or a function `(fqn, param) -> label`), so that, as an
    Optimizer's param groups, different params get different chains and hypers (no decay on biases; Muon on the
    matrices, AdamW on the rest).

    ```python
    import torch, cbopt
    params = {'w': torch.randn(3, 3), 'b': torch.zeros(3)}
    fopt = cbopt.functional.partition({'decay': cbopt.functional(cbopt.Adam, lr=1e-2, wd=0.1),
                                       'no_decay': cbopt.functional(cbopt.Adam, lr=1e-2)},
                                      lambda fqn, p: 'decay' if p.ndim > 1 else 'no_decay')
    state = fopt.init(params)            # {'decay': {'w': ..., 'hypers': ...}, 'no_decay': {'b': ..., 'hypers': ...}}
    params, state = fopt.update(params, {'w': torch.ones(3, 3), 'b': torch.ones(3)}, state)
    ```
    """
    return Partition(transforms, labels)


class _FactoryPartition(Partition):
    """The partition a factory makes by grouping the params (`cbopt.Muon`): labels `'group0'`, `'group1'`... in the
    order of its param groups, each with the group's chain and hypers, found on meta copies of the params (once per
    set of FQNs and shapes)."""

    def __init__(self, factory: Callable, hypers: Mapping, dynamic: Iterable[str] | None):
        super().__init__({}, None)
        self.factory, self.factory_hypers, self.dynamic = factory, dict(hypers), dynamic
        self._built: dict = {}

    def __repr__(self) -> str: return f"Partition({getattr(self.factory, '__name__', self.factory)}, {self.factory_hypers})"

    def _parts(self, flat: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        key = tuple((f, tuple(p.shape), p.dtype) for f, p in flat.items())
        if key not in self._built:
            metas = {f: torch.empty(p.shape, dtype=p.dtype, device='meta') for f, p in flat.items()}
            opt = self.factory(list(metas.items()), **self.factory_hypers)
            by_id = {id(t): f for f, t in metas.items()}
            transforms, labels = {}, {}
            for i, g in enumerate(opt.param_groups):
                transforms[f'group{i}'] = FunctionalOptimizer(list(g['cbs']), Hypers(g).snapshot(), self.dynamic)
                for t in g['params']: labels[by_id[id(t)]] = f'group{i}'
            self._built[key] = transforms, labels
        transforms, labels = self._built[key]
        self.transforms = transforms  # (for to_state_dict: those of the last params seen)
        return transforms, labels


def _chain_and_hypers(factory_or_cbs: Any, hypers: Mapping) -> tuple[list, dict]:
    "The chain and hypers of a prebuilt optimizer's factory (`cbopt.Adam`), an Optimizer, or a list of callbacks."
    one = [('param', torch.zeros(1))]
    if isinstance(factory_or_cbs, Optimizer):
        if hypers: raise TypeError("functional(opt) takes the optimizer's own hypers: set them on the optimizer first")
        opt = factory_or_cbs
    elif isinstance(factory_or_cbs, (list, tuple)): opt = Optimizer(one, list(factory_or_cbs), **hypers)
    elif callable(factory_or_cbs):
        if not isinstance(factory_or_cbs, type) and declared_state(factory_or_cbs) is not None:
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


_PROBE = (('weight', (2, 2)), ('bias', (2,)))  # a matrix and a vector: what factories group apart (Muon)


def _splits(factory: Callable, hypers: Mapping) -> bool:
    "Whether `factory` gives a matrix and a vector param groups of different chains or hypers (Muon does)."
    try: opt = factory([(n, torch.zeros(s)) for n, s in _PROBE], **hypers)
    except Exception: return False  # (a factory for some params only: `init` checks the real ones)
    if not isinstance(opt, Optimizer): return False
    groups = {(chain_name(g['cbs']), repr(sorted(Hypers(g).snapshot().items()))) for g in opt.param_groups}
    return len(groups) > 1


def functional(factory_or_cbs: Callable | Iterable[Callable] | Optimizer, dynamic: Iterable[str] | None = None,
               **hypers) -> FunctionalOptimizer | Partition:
    """The pure form of an optimizer: `cbopt.functional(cbopt.Adam, lr=1e-3, wd=0.01)`, or of a chain:
    `cbopt.functional([cbopt.weight_decay, ...], lr=...)`, with the same hyper defaults and checks as the Optimizer.
    `dynamic` names the hypers kept as tensors in the state (default: `lr`; see the module docstring). A factory
    that groups the params apart (`cbopt.Muon`: matrices and the rest) gives a `Partition`, one label per group, as
    does an Optimizer whose groups differ (its params by name, `'group0'`, `'group1'`... as its groups).

    ```python
    import torch, cbopt
    params = {'w': torch.randn(3)}
    fopt = cbopt.functional(cbopt.Adam, lr=1e-2)
    state = fopt.init(params)
    new_params, state = fopt.update(params, {'w': torch.ones(3)}, state)   # pure: `params` is unchanged
    assert not torch.equal(new_params['w'], params['w'])
    ```
    """
    factory = callable(factory_or_cbs) and not isinstance(factory_or_cbs, (Optimizer, list, tuple)) \
        and (isinstance(factory_or_cbs, type) or declared_state(factory_or_cbs) is None)  # (a class: cbopt.optim's)
    if factory and _splits(factory_or_cbs, hypers): return _FactoryPartition(factory_or_cbs, hypers, dynamic)
    if isinstance(factory_or_cbs, Optimizer) and not hypers and len(factory_or_cbs.param_groups) > 1:
        groups = factory_or_cbs.param_groups
        if len({(chain_name(g['cbs']), repr(sorted(Hypers(g).snapshot().items()))) for g in groups}) > 1:
            return Partition({f'group{i}': FunctionalOptimizer(list(g['cbs']), Hypers(g).snapshot(), dynamic)
                              for i, g in enumerate(groups)},
                             {n: f'group{i}' for i, g in enumerate(groups) for n in g['param_names']})
    fopt = FunctionalOptimizer(*_chain_and_hypers(factory_or_cbs, hypers), dynamic)
    if factory:
        fopt._regroup = lambda params: factory_or_cbs(params, **hypers)  # init checks how it groups the real params
    return fopt


class _CallableModule(types.ModuleType):
    """`cbopt.functional` is this module and its main function at once: `cbopt.functional(cbopt.Adam, lr=...)` builds
    a `FunctionalOptimizer`, while `cbopt.functional.FunctionalOptimizer` (and the rest of the module) stays reachable
    under the same name, as optax keeps its transforms beside its `chain`."""
    def __call__(self, *args, **kwargs) -> FunctionalOptimizer | Partition: return functional(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
