"""The callback protocol: how a chain of step callbacks runs, what it reads and creates, and its identity.

What one callback is and what it may declare (`cb.defaults`, `cb.state`, `cb.scope`, `cb.transient`, ...) is the
contract in `cbopt.core.spec`, read there in one place (`spec(cb)`); this module answers the questions about a chain
those declarations decide: its hypers and their defaults (`chain_defaults`), the state it creates before its first
step (`init_chain_state`, `is_declared`), what lives one step only (`transient_keys`), its scope (`chain_scope`), its
whole-model callbacks and where they run (`split_chain`), and whether it is a valid chain (`check_chain`).

This module imports nothing from cbopt outside `core`: every other module may import it.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from numbers import Number

import torch

from .spec import SCOPES, cb_name, spec, unwrap

__all__ = ['run_chain', 'cb_name', 'cb_defaults', 'chain_defaults', 'chain_reads', 'chain_sig', 'chain_name', 'declared_state',
           'is_declared', 'is_cbopts', 'transient_keys', 'scope', 'chain_scope', 'init_chain_state', 'check_chain', 'check_returns',
           'zeros', 'copy_of_param', 'at_first_step', 'declared_for', 'per_tensor', 'SCOPES', 'is_model_cb', 'split_chain', 'param_chain',
           'model_param_state', 'model_key', 'around_params', 'chain_counters', 'cached', 'chain_group_hypers']

ENGINE_KEYS = ('skip', 'hypers', 'grad_scale', 'grad_scale_in_place')  # what a whole-model callback may return to the engine, beside its state


def cb_defaults(cb: Callable) -> dict:
    "The hypers a callback asks for, with its defaults (`partial`s included; fastai's `_defaults` too)."
    return dict(spec(cb).defaults)


def chain_defaults(cbs: Iterable[Callable]) -> dict:
    "The hypers of a chain with their defaults; a later callback's default wins, as in fastai."
    out = {}
    for cb in cbs: out.update(cb_defaults(cb))
    return out


def chain_group_hypers(cbs: Iterable[Callable]) -> dict:
    """The hypers a chain's callbacks ask each group to start with, as copies of another hyper (`cb.group_hypers`:
    `{'initial_lr': 'lr'}`), so that the optimizer fills them in once, when a group joins, and never per step."""
    out = {}
    for cb in cbs: out.update(spec(cb).group_hypers)
    return out


def cached(maxsize: int | None = None) -> Callable[[Callable], Callable]:
    """`functools.lru_cache` for functions of callbacks and groups, which calls the function uncached for an unhashable
    argument (an instance of a dataclass with `__call__` is a callback, and unhashable) and while torch.compile traces
    (dynamo warns at every `lru_cache` it meets, and traces through it anyway)."""
    def decorate(fn: Callable) -> Callable:
        kept = functools.lru_cache(maxsize)(fn)
        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling(): return fn(*args)
            try: hash(args)
            except TypeError: return fn(*args)
            return kept(*args)
        return call
    return decorate


@cached()
def _reads(cb: Callable) -> frozenset:
    try: sig = inspect.signature(cb)
    except (TypeError, ValueError): return frozenset()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(list(n for n, a in sig.parameters.items() if a.kind in kinds)[1:])  # all but the param


def chain_reads(cbs: Iterable[Callable]) -> frozenset:
    "The keywords a chain's callbacks name (hypers and state), and their declared defaults."
    out = set()
    for cb in cbs:
        out |= _reads(cb)
        out |= set(cb_defaults(cb))
    return frozenset(out)


def run_chain(cbs: Iterable[Callable], p, state: dict, hyper: Mapping) -> None:
    """Run each callback on `p` with its state and hypers as keywords, merging the state it returns (fastai's step).

    The grad contract: a callback that changes the grad the rest of the chain sees (L2, maximize) rebinds `p.grad`
    out of place instead of writing into it, and `p` gets its own grad back afterwards, so a step leaves the user's
    `p.grad` as it was, as torch.optim does."""
    grad = p.grad
    try:
        for cb in cbs:
            new = cb(p, **{**state, **hyper})
            if isinstance(new, dict): state.update(new)
    finally:
        if p.grad is not grad: p.grad = grad


# -- identity of a chain ---------------------------------------------------------------------------------------------
def _cb_sig(cb: Callable) -> tuple | Callable:
    """A callback by what it computes: `partial`s compare by function and arguments, not by identity; an unhashable
    one (an instance of a dataclass with `__call__`, a partial with a list argument) by identity."""
    sig = (_cb_sig(cb.func), cb.args, tuple(sorted(cb.keywords.items()))) if isinstance(cb, functools.partial) else cb
    try: hash(sig)
    except TypeError: return _Identity(cb)
    return sig


class _Identity:
    "A key for an unhashable callback: equal to one for the same object only (it holds it, so its id stays its own)."
    __slots__ = ('obj',)
    def __init__(self, obj): self.obj = obj
    def __hash__(self) -> int: return id(self.obj)
    def __eq__(self, other) -> bool: return isinstance(other, _Identity) and other.obj is self.obj


def chain_sig(cbs: Iterable[Callable]) -> tuple:
    "A hashable key for what a chain computes (compiled-chain caches and fused-kernel matching use it)."
    return tuple(_cb_sig(cb) for cb in cbs)


def chain_name(cbs: Iterable[Callable]) -> str:
    "A readable name of a chain, saved with each group so a load can tell another algorithm's state."
    return ','.join(cb_name(cb) for cb in cbs)


# -- declarations ----------------------------------------------------------------------------------------------------
def declared_state(cb: Callable) -> dict | None:
    """What `cb` declares it creates in each param's state (name -> initial value or initializer), or None for an
    undeclared callback. A whole-model callback's per-param state (`param_state`) is named `'<cb name>.<key>'`."""
    s = spec(cb)
    if s.scope == 'model': return model_param_state(cb)
    return None if s.state is None else dict(s.state)


# -- whole-model callbacks -------------------------------------------------------------------------------------------
def is_model_cb(cb: Callable) -> bool:
    "Whether `cb` is a whole-model callback (`scope = 'model'`)."
    return spec(cb).scope == 'model'


def model_key(cb: Callable, key: str) -> str:
    "Where a whole-model callback's entry `key` is kept (group entries, per-param state): `'<cb name>.<key>'`."
    return f'{cb_name(cb)}.{key}'


def flat_model_keys(cbs: Iterable[Callable]) -> frozenset:
    "The group entries of a chain's whole-model callbacks that are flat over the group's params (`cb.flat_state`)."
    return frozenset(model_key(cb, k) for cb in cbs if is_model_cb(cb) for k in spec(cb).flat_state)


def flat_size(p: torch.Tensor) -> int:
    "The elements `p` takes in a flat vector over params (`cb.flat_state`): its real view's (a complex param: 2 a number)."
    return p.numel() * (2 if p.is_complex() else 1)


def model_param_state(cb: Callable) -> dict:
    "The per-param state a whole-model callback declares, under its prefixed names."
    return {model_key(cb, k): v for k, v in spec(cb).param_state.items()}


def param_chain(cbs: Iterable[Callable]) -> list:
    "The per-param callbacks of a chain (its whole-model callbacks left out)."
    return [cb for cb in cbs if not is_model_cb(cb)]


def split_chain(cbs: Iterable[Callable]) -> tuple[list, list, list]:
    """A chain as (whole-model callbacks before, per-param callbacks, whole-model callbacks after). A whole-model
    callback between two per-param ones has no place in a step: an error naming it. Asked per group at every step
    (`engine.model_plan`), so kept per chain."""
    return tuple(map(list, _split_chain(tuple(cbs))))


@cached(maxsize=1024)
def _split_chain(cbs: tuple) -> tuple[tuple, tuple, tuple]:
    kinds = [is_model_cb(cb) for cb in cbs]
    i = 0
    while i < len(cbs) and kinds[i]: i += 1
    j = len(cbs)
    while j > i and kinds[j - 1]: j -= 1
    for cb, m in zip(cbs[i:j], kinds[i:j]):
        if m: raise ValueError(f"whole-model callback {cb_name(cb)!r} is in the middle of the chain [{chain_name(cbs)}]: "
                               "list it before every per-param callback (it runs before them) or after (it runs after)")
    return cbs[:i], cbs[i:j], cbs[j:]


def around_params(cbs: Iterable[Callable], transform: Callable[[list], list]) -> list:
    """`transform` applied to the per-param callbacks of a chain, its whole-model callbacks kept at the ends, so that
    wrappers compose in any order (`Lookahead` around a clipped chain keeps the clipping first). Whole-model callbacks
    that `transform` puts first run before the chain's own (the outermost wrapper first), those it puts last after."""
    pre, params, post = split_chain(cbs)
    new_pre, new_params, new_post = split_chain(transform(params))
    return [*new_pre, *pre, *new_params, *post, *new_post]


def is_declared(cbs: Iterable[Callable]) -> bool:
    "Whether every callback of the chain declares its state, so that its state can be created without a dry run."
    return all(declared_state(cb) is not None for cb in cbs)


def is_cbopts(cb: Callable) -> bool:
    """Whether `cb` is one of cbopt's own callbacks (defined in `cbopt`, under any partials; `kahan` of one is too).
    Each runs bucket-wise, its control flow on hypers and Python state only: the registry's conformance tests run
    every one of them in the foreach backend, where a callback breaking this raises `BucketError`."""
    return (getattr(unwrap(cb), '__module__', None) or '').startswith('cbopt.')


def transient_keys(cbs: Iterable[Callable]) -> frozenset:
    "The per-param state entries of a chain that live for one step only (whole-model callbacks' are their own)."
    return frozenset(k for cb in cbs if (s := spec(cb)).scope != 'model' for k in s.transient)


def scope(cb: Callable) -> str | None:
    "`'element'`, `'tensor'` or `'model'` (see `cbopt.core.spec`); None when the callback declares nothing."
    return spec(cb).scope


def chain_scope(cbs: Iterable[Callable]) -> str | None:
    """`'element'` if every per-param callback is elementwise, `'tensor'` if one reduces over a param, None if one is
    undeclared (whole-model callbacks are left out: see `split_chain`)."""
    scopes = [scope(cb) for cb in param_chain(cbs)]
    if None in scopes: return None
    return 'tensor' if 'tensor' in scopes else 'element'


def chain_counters(cbs: Iterable[Callable]) -> dict[str, type]:
    """The per-param state entries a chain declares as Python numbers (step counts: `step_stat.state = dict(step=0)`),
    with their types. Flags (bools) are not counters."""
    out: dict[str, type] = {}
    for cb in param_chain(cbs):
        for k, v in (declared_state(cb) or {}).items():
            if isinstance(v, Number) and not isinstance(v, bool): out.setdefault(k, type(v))
    return out


def zeros(p) -> torch.Tensor:
    "Initializer: zeros like the param (a moment buffer)."
    return torch.zeros_like(p.data)


def copy_of_param(p) -> torch.Tensor:
    "Initializer: a copy of the param as it is (Lookahead's slow weights)."
    return p.data.clone()


class at_first_step:
    """A declared state entry that a param's first step creates, absent before it: torch.optim.SGD's momentum buffer
    with dampening is a copy of the first grad (later steps weigh grads by `1 - dampening`), which no value set before
    that step can stand for, and torch's state has no entry saying whether it was set. So its callback tells its first
    step by the entry's absence (`grad_avg is None`), as torch's SGD does, and the entry needs no flag beside it (a
    checkpoint stays torch's: `momentum_buffer` alone). `init(p)` gives its template, the tensor a checkpoint holds
    for it (shape, dtype, kind: low-bit state stores it as any other entry): `init_chain_state(template=True)`."""
    def __init__(self, init: Callable):
        if not callable(init): raise TypeError(f"at_first_step takes an initializer (a function of the param), got {init!r}")
        self.init = init

    def __call__(self, p) -> torch.Tensor:
        "The entry's template for `p`."
        return self.init(p)

    def __repr__(self) -> str: return f"at_first_step({getattr(self.init, '__name__', self.init)!r})"


def init_chain_state(cbs: Iterable[Callable], p, template: bool = False) -> dict:
    """The state a declared chain holds for `p` before its first step. An initializer giving None keeps no such entry
    for `p` (state kept by rank: Adafactor's factored moments for matrices, a full one for vectors); an entry its first
    step creates (`at_first_step`) is absent, unless `template`: then it is its template, so that the result names
    every entry a stepped param holds, with its shape and dtype (what a checkpoint is loaded into: `init_state()`,
    loads, `check_callback`)."""
    out = {}
    for cb in cbs:
        for k, v in (declared_state(cb) or {}).items():
            if k in out or (isinstance(v, at_first_step) and not template): continue
            v = v(p) if callable(v) else v
            if v is not None: out[k] = v
    return out


def per_tensor(fn: Callable, *args):
    """`fn(*args)` for a param; for a bucket (lists of tensors, as the foreach backend passes them), once per param, the
    results in a list of the same type. For the part of a callback that depends on each param's shape (Muon's
    Newton-Schulz, which transposes tall matrices): the rest of the callback still runs bucket-wise."""
    lists = [a for a in args if isinstance(a, list)]
    if not lists: return fn(*args)
    return type(lists[0])([fn(*xs) for xs in zip(*args, strict=True)])


def declared_for(cb: Callable, p) -> dict:
    """`cb`'s declared state for `p`, created in its first step: for a bucket (a list of params, as the foreach backend
    passes them) one list of the same type per entry. A chain of `scope='tensor'` steps buckets of one rank, so state
    kept by rank has the same entries for every param of a bucket."""
    if not isinstance(p, list): return init_chain_state([cb], p)
    per_param = [init_chain_state([cb], q) for q in p]
    return {k: type(p)([s[k] for s in per_param]) for k in per_param[0]}


def _creators(cbs: Iterable[Callable]) -> dict[str, list]:
    out: dict[str, list] = {}
    for cb in cbs:
        st, s = declared_state(cb), spec(cb)
        transient = () if s.scope == 'model' else s.transient
        for k in [*(st or {}), *transient]: out.setdefault(k, []).append(cb)
    return out


def check_returns(creators: Mapping[str, list]) -> None:
    "Raise if two callbacks create the same state entry and do not both declare it `shared`."
    for k, cbs in creators.items():
        if len(cbs) > 1 and not all(k in spec(cb).shared for cb in cbs):
            names = ' and '.join(repr(cb_name(cb)) for cb in cbs)
            raise ValueError(f"callbacks {names} both create the state entry {k!r}, so they would update one buffer "
                             f"twice; rename one, or declare `shared = ({k!r},)` on each to share it on purpose")


def check_chain(cbs: Iterable[Callable]) -> None:
    """Check a chain: callables, each one's declarations (`spec`: a `CallbackSpecError` names the callback and the
    misspelt or mistyped attribute), whole-model callbacks at its ends and once each, no accidental shared state."""
    cbs = list(cbs)
    for cb in cbs:
        if not callable(cb): raise TypeError(f"callback {cb!r} is not callable")
        spec(cb)
    pre, _, post = split_chain(cbs)
    names = [cb_name(cb) for cb in pre + post]
    for n in names:
        if names.count(n) > 1:
            raise ValueError(f"the chain [{chain_name(cbs)}] lists the whole-model callback {n!r} twice: its state "
                             f"entries ('{n}.<key>') would collide")
    check_returns(_creators(cbs))

