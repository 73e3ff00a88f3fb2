"""What a callback declares: the contract between a step callback and cbopt, read in one place.

A callback is a plain function `cb(p, **{**state, **hypers}) -> dict | None` (fastai's contract): it reads the param
`p` (`p.data`, `p.grad`), its state and its group's hypers by keyword, updates tensors in place, and returns the state
entries it created. Alongside the function, as fastai attaches `defaults`, a callback may declare (the attribute
style is how users declare; `spec(cb)` is how cbopt reads it, checked, into a `CallbackSpec`):

- `cb.defaults = dict(mom=0.9)`: the hypers it reads, with their defaults (fastai's `cb._defaults` too);
- `cb.state = dict(grad_avg=zeros, step=0)`: the state it creates, each entry's value before the first step (a
  number, or a function of the param giving a tensor, or None where a param keeps no such entry; or
  `chain.at_first_step(init)` for an entry that the param's first step creates, absent before it: torch SGD's
  dampened momentum buffer, a copy of the first grad). A callback that creates nothing declares `cb.state = {}`. Declared state is created by `init_chain_state` with no dry run (what
  `Optimizer.init_state`, the functional `init` and distributed checkpoints need). A chain with an undeclared callback
  (fastai's style: no `state`) falls back to a dry run on a copy;
- `cb.state_kinds = dict(grad_avg='signed', step='exact')`: what each state entry is (`STATE_KINDS`), so that low-bit
  state (`state_precision=`, `cbopt.state.lowbit`) knows how to store it: `'signed'` a moving average of any sign
  (momentum, Adan's `prev_grad`: the signed 8/4-bit map), `'nonnegative'` a non-negative moving average (second
  moments: the unsigned map), `'accumulator'` a running sum (Adagrad's: bf16 with stochastic rounding), `'exact'` never
  quantized (step counts, masks, Lookahead's slow weights, Kahan buffers, iterates). An entry without a kind is kept
  in fp32 (with a warning once when low precision was asked for);
- `cb.transient = ('local_lr',)`: state entries that live for one step: removed after the chain, never saved;
- `cb.scope = 'tensor'`: it reduces over a whole param (a norm, an orthogonalisation), so it is not safe to run on a
  shard of one; the default for a declared callback is `'element'`; `'model'`: a whole-model callback (below);
- `cb.shared = ('grad_avg',)`: entries it creates that another callback of the chain also creates, on purpose.
  Two callbacks creating one entry without both declaring it is an error naming both (`chain.check_chain`);
- `cb.additive = True`: its only effect on the param is `p.data += update`, computed without reading `p.data`, so
  `cbopt.kahan` can compensate it (it runs it on a stand-in whose `data` is the compensation buffer);
- `cb.on_train`, `cb.on_eval`: functions `(p, **{**state, **hypers})` that `opt.train()` / `opt.eval()` run on each
  param with state, for a chain that trains at one point and is evaluated at another (schedule-free's `y` and `x`;
  the group's mode is its `train_mode` hyper);
- `cb.supports_complex = False`: its math is not elementwise on a complex param's (real, imaginary) pairs, which is
  how every backend steps complex params (`engine.buckets.as_real`): an optimizer listing it refuses complex params;
- `cb.sparse_grads = True`: it steps a param whose grad is sparse (`nn.Embedding(sparse=True)`), as torch's
  single-tensor code does; `'only'`: it steps only such params (torch's SparseAdam); a function of the hypers giving
  the reason it cannot with these hypers, or None (L2 decay at a nonzero `wd`). A sparse grad steps in the `loop`
  runner, and only where every per-param callback of the chain takes it (`engine.dispatch.check_grads`);
- `cb.torch_names = dict(etas=('etaminus', 'etaplus'))`: torch.optim's group entries for the hypers it reads, where
  they are not the common ones (`core.hypers.TORCH_HYPER_NAMES`), so that torch's state_dict loads them;
- `cb.torch_state = dict(momentum_buffer='grad_avg')`: torch.optim's names for the state it creates or reads (torch
  name -> cbopt name), in the algorithm it belongs to (`grad_avg` is Adam's `exp_avg` but SGD's `momentum_buffer`: the
  step callbacks say which), so a torch state_dict loads into the chain and the chain's state_dict can be written in
  torch's names (`opt.state_dict(format=torch.optim.SGD)`); `cb.torch_extra_state`, a function of the state and
  hypers, gives the entries torch keeps that cbopt computes (ASGD's `eta` and `mu`);
- `cb.torch_flag = 'amsgrad'`: it is in the chain exactly when torch's group has that flag set (a torch state_dict
  with another value is refused; one of cbopt's state_dicts written for torch sets it);
- `cb.group_hypers = dict(initial_lr='lr')`: hypers it reads that each group gets when it joins the optimizer (at
  construction or `add_param_group`) where the group has none: a copy of another of its hypers then (Composer's
  `initial_lr`, the group's lr at its start; a tensor is cloned, so a schedule writing the lr in place leaves it).

A **whole-model callback** declares `cb.scope = 'model'`. It runs once per step over every param with a grad of the
groups whose chain lists it: `cb(params, groups=..., **{**param_state, **model_state, **hypers}) -> dict | None`, where
`params` is a list of `TensorList`s (one per device and dtype, each with `.grad`), so it computes with foreach kernels
and never loops over params. Listed at the start of a chain it runs before the per-param callbacks, at the end after
them (`chain.split_chain`). Its declarations:

- `cb.state = dict(skipped_total=0)`: its own state (Python numbers), kept in the param group entries of the first
  group listing it as `'<name>.<key>'` (`'skip_nonfinite.skipped_total'`), so state_dicts and DCP carry it;
- `cb.param_state = dict(grad_sum=zeros)`: per-param tensors it keeps, in each param's state as `'<name>.<key>'`,
  passed to it as lists of TensorLists aligned with `params`;
- `cb.flat_state = ('d', 'old_dirs')`: entries of its state that are flat vectors over the params of the group keeping
  them (each param's real view flattened, `flat_size` elements, one after the other in the group's order; or lists of
  such vectors: L-BFGS's history), so a checkpoint whose params come in another order loads them in this order;
  such a callback is listed by one group only (`engine.model_plan` refuses it in several: whose params would it span?);
- `cb.uses_closure = True`: it re-evaluates the model (L-BFGS): it gets the step's `closure` and the first `loss`;
- `cb.torch_model_state = dict(d='d', al=None)`: the entries of its state that torch.optim keeps in the state of a
  group's first param (torch's name -> its own, None for torch's scratch), so torch's LBFGS state_dict loads;
- `cb.transient`: entries it returns for this step only (the engine's `skip` and `hypers`, a norm to report);
- returning `skip=True` (a pre-chain callback) ends the step: nothing else runs and no other state changes;
  returning `hypers=[{...} per group]` overrides those groups' hypers for this step (warmup's lr);
  returning `grad_scale=t` (a 0-d tensor) multiplies every grad the rest of the step sees by `t`, never writing the
  user's grads: under torch's fused kernel each cache-sized run of grads is scaled into a buffer just before the
  kernel reads it, other runners get scaled copies (clip_grad_norm's coefficient); with `grad_scale_in_place=True`
  too (`clip_grad_norm(in_place=True)`), `t` is written into the grads instead, when the step runs (torch's kernel
  divides them by `1 / t` in its own pass; other runners multiply them in place first).

Declarations live on the function under any `functools.partial`s (`unwrap`); `kahan(step)` copies its step's. An
attribute of the callback whose name is close to a declaration's (`cb.trasient`), or a declaration of the wrong type
(a `scope` not in `SCOPES`, a `transient` that is a string), is a `CallbackSpecError` naming the callback and the
attribute, raised when an optimizer is built (`chain.check_chain`) and reported by `cbopt.testing.check_callback`.
`spec(cb)` is kept per callback and read again when one of its attributes is set to another object; set them before
the callback first runs rather than changing a declared dict in place.

Imports nothing from cbopt: every other module may import it.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ['CallbackSpec', 'CallbackSpecError', 'spec', 'DECLARATIONS', 'SCOPES', 'STATE_KINDS', 'unwrap', 'cb_name']

SCOPES = ('element', 'tensor', 'model')
STATE_KINDS = ('signed', 'nonnegative', 'accumulator', 'exact')
"""What a state entry is (`cb.state_kinds`), which decides how low-bit state stores it (`cbopt.state.lowbit`)."""


def unwrap(cb: Callable) -> Callable:
    "The function under any `functools.partial`s: declarations live on it."
    while isinstance(cb, functools.partial): cb = cb.func
    return cb


def cb_name(cb: Callable) -> str:
    "A callback's name, for messages and checkpoints (`partial(average_grad, ...)` is `average_grad`)."
    cb = unwrap(cb)
    return getattr(cb, '__name__', type(cb).__name__)


class CallbackSpecError(TypeError, ValueError):
    """A callback's declaration cbopt cannot read: a misspelt attribute name or a value of the wrong type. Both a
    TypeError and a ValueError, so code catching either (as it did before there was one spec) still catches it."""


@dataclass(frozen=True)
class CallbackSpec:
    """Everything a callback declares (see the module docstring), read and checked by `spec(cb)`. A fastai-style
    callback that declares nothing has every field at its default: `declared` is False and its scope None. Its dicts
    are its own copies of the callback's, shared by every reader: read them, never write them (plain dicts, not
    read-only proxies, because torch.compile traces through the spec and breaks its graph at a `mappingproxy`)."""
    name: str
    "`cb_name(cb)`: its function's name, for messages and checkpoints."
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """`cb._defaults` then `cb.defaults` (fastai's names), hyper -> default: merged into the optimizer's hypers
    (`chain.cb_defaults`, `chain.chain_defaults`: the optimizer, torch-format export, loads). Default: none."""
    state: Mapping[str, Any] | None = None
    """`cb.state`, entry -> value before the first step (a number, or a function of the param; None from it: no such
    entry for that param). A whole-model callback's own state, kept in its first group's entries (`engine.model_stage`,
    `state.formats`). None (the default): undeclared, its state is found by a dry run (`chain.declared_state`)."""
    scope: str | None = None
    """`cb.scope`, one of `SCOPES`: `'element'` (the default for a declared callback), `'tensor'` (it reduces over a
    param: `chain.chain_scope`, the engine's buckets, flat packing, DTensor gathering) or `'model'` (a whole-model
    callback: `chain.split_chain`, `engine.model_stage`, `InBackward` refuses it). None for an undeclared callback."""
    state_kinds: Mapping[str, str] = field(default_factory=dict)
    """`cb.state_kinds`, state entry -> one of `STATE_KINDS` (for a whole-model callback: its `param_state` entries),
    read by low-bit state (`cbopt.state.lowbit`). Default: none (fp32)."""
    transient: tuple[str, ...] = ()
    """`cb.transient`: entries that live for one step only, never saved (`chain.transient_keys`, the engine, loads;
    a whole-model callback: the entries it may return beside its state). Default: none."""
    shared: tuple[str, ...] = ()
    "`cb.shared`: entries it creates on purpose with another callback of the chain (`chain.check_returns`). Default: none."
    additive: bool = False
    "`cb.additive`: its only effect on the param is `p.data += update` (`callbacks.compensated.kahan`). Default: False."
    on_train: Callable | None = None
    "`cb.on_train`: run on each param with state by `opt.train()` (`Optimizer.train`; schedule-free). Default: None."
    on_eval: Callable | None = None
    "`cb.on_eval`: run on each param with state by `opt.eval()` (`Optimizer.train`; schedule-free). Default: None."
    supports_complex: bool = True
    "`cb.supports_complex`: False refuses complex params (`optimizer._check_complex`). Default: True."
    sparse_grads: bool | str | Callable = False
    """`cb.sparse_grads`: True (it steps a param with a sparse grad), 'only' (only such params), or a function of the
    hypers giving why it cannot with them (or None) (`engine.dispatch.check_grads`). Default: False."""
    torch_names: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    """`cb.torch_names`, torch's group entry -> the hyper(s) it holds, beside `core.hypers.TORCH_HYPER_NAMES`
    (`state.formats.torch_hyper_names`). Default: none."""
    torch_state: Mapping[str, str] = field(default_factory=dict)
    "`cb.torch_state`, torch's state name -> cbopt's (`state.formats.torch_state_names`). Default: none."
    torch_extra_state: Callable | None = None
    """`cb.torch_extra_state(**{**state, **hypers})`: entries torch keeps that cbopt computes (ASGD's `eta`, `mu`;
    `state.torch_format`). Default: None."""
    torch_flag: str | None = None
    """`cb.torch_flag`: the torch group flag that is True exactly when it is in the chain (`state.formats.chain_flags`).
    Default: None."""
    group_hypers: Mapping[str, str] = field(default_factory=dict)
    """`cb.group_hypers`, hyper -> the hyper a joining group copies it from where it has none
    (`chain.chain_group_hypers`, the optimizer). Default: none."""
    param_state: Mapping[str, Any] = field(default_factory=dict)
    """`cb.param_state` (whole-model callbacks only), entry -> initial value: per-param state kept as `'<name>.<key>'`
    (`chain.model_param_state`, `engine.model_stage`). Default: none."""
    flat_state: tuple[str, ...] = ()
    """`cb.flat_state` (whole-model callbacks only): entries of its `state` flat over its group's params
    (`chain.flat_model_keys`, `engine.model_plan`, loads). Default: none."""
    uses_closure: bool = False
    "`cb.uses_closure` (whole-model callbacks only): it gets `closure` and `loss` (`engine.model_stage`). Default: False."
    torch_model_state: Mapping[str, str | None] = field(default_factory=dict)
    """`cb.torch_model_state` (whole-model callbacks only), torch's key in a group's first param's state -> its
    `state` entry, None for torch's scratch (`state.formats.torch_model_state`). Default: none."""

    @property
    def declared(self) -> bool:
        "Whether it declares the state it creates (a whole-model callback always does: its `param_state`)."
        return self.state is not None or self.scope == 'model'


DECLARATIONS = tuple(f.name for f in dataclasses.fields(CallbackSpec) if f.name != 'name') + ('_defaults',)
_MODEL_ONLY = ('param_state', 'flat_state', 'uses_closure', 'torch_model_state')


_KEPT: dict[int, tuple] = {}  # id(function) -> (the function, its attributes (name, value) when read, its spec)
_KEEP = 4096  # functions kept at most (more: forget them all, and read each again at its next use)


def spec(cb: Callable) -> CallbackSpec:
    """What `cb` declares (through its `partial`s), checked: a `CallbackSpecError` names the callback and the attribute
    of a misspelt or mistyped declaration. Kept per callback (unhashable ones too: by identity) and read again when
    one of its attributes is set to another object. While torch.compile traces, a kept answer is taken as it is
    (dynamo traced the whole check and guarded each attribute it compared, at each use: half the instructions of a
    compiled Adam step's trace), and dynamo guards the entry of that callback alone, so a callback kept later does not
    recompile a step; so a declaration set anew after a step was compiled is seen once an eager call reads it again
    (a step or a load does). A callback no eager call has read is read afresh."""
    f = cb
    while isinstance(f, functools.partial): f = f.func
    compiling = torch.compiler.is_compiling()
    if compiling and (kept := _KEPT.get(id(f))) is not None and kept[0] is f: return kept[2]
    own = getattr(f, '__dict__', None) or {}  # (none: a builtin, a class with `__slots__`)
    if compiling: return _read(f, own)  # (not kept while tracing: a write to the cache would be a graph side effect)
    kept, items = _KEPT.get(id(f)), tuple(own.items())
    if kept is not None and kept[0] is f:
        try:
            if kept[1] == items: return kept[2]  # (values compare by identity first: the usual case costs no __eq__)
        except Exception: pass  # (a value set anew whose == is no bool: a tensor)
    out = _read(f, own)
    if len(_KEPT) >= _KEEP: _KEPT.clear()
    _KEPT[id(f)] = (f, items, out)
    return out


def _read(f: Callable, own: Mapping) -> CallbackSpec:
    name = cb_name(f)

    def bad(attr: str, why: str) -> CallbackSpecError:
        return CallbackSpecError(f"callback {name!r} declares {attr} = {getattr(f, attr)!r}: {why} "
                                 "(see cbopt.core.spec)")

    fields = {x.name for x in dataclasses.fields(f)} if dataclasses.is_dataclass(f) else set()
    for k in own:
        if k in DECLARATIONS or k in fields or k.startswith('__'): continue
        close = difflib.get_close_matches(k, DECLARATIONS, n=1, cutoff=0.8)
        if close:
            raise CallbackSpecError(f"callback {name!r} has the attribute {k!r}, which cbopt does not read: did you mean "
                                    f"{close[0]!r}? (the declarations: {', '.join(DECLARATIONS)}; see cbopt.core.spec)")

    def read(attr: str) -> Any: return getattr(f, attr, None)

    def mapping(attr: str, values: Callable[[Any], bool] | None = None, what: str = '') -> Mapping | None:
        v = read(attr)
        if v is None: return None
        if not isinstance(v, Mapping): raise bad(attr, f"expected a dict, got {type(v).__name__}")
        keys = [k for k in v if not isinstance(k, str)]
        if keys: raise bad(attr, f"its keys must be names (str), got {keys[0]!r}")
        if values is not None:
            for k, x in v.items():
                if not values(x): raise bad(attr, f"its entry {k!r} must be {what}, got {x!r}")
        return dict(v)

    def names(attr: str) -> tuple[str, ...]:
        v = read(attr)
        if v is None: return ()
        if not isinstance(v, (tuple, list)) or not all(isinstance(x, str) for x in v):
            raise bad(attr, "expected a tuple or list of entry names (str)" +
                      (f": ({v!r},) for one entry" if isinstance(v, str) else ""))
        return tuple(v)

    def flag(attr: str, default: bool) -> bool:
        v = read(attr)
        if v is None: return default
        if not isinstance(v, bool): raise bad(attr, f"expected True or False, got {type(v).__name__}")
        return v

    def function(attr: str) -> Callable | None:
        v = read(attr)
        if v is not None and not callable(v): raise bad(attr, f"expected a function, got {type(v).__name__}")
        return v

    is_name = lambda x: isinstance(x, str)
    defaults = {**(mapping('_defaults') or {}), **(mapping('defaults') or {})}
    state = mapping('state')
    scope = read('scope')
    if scope is not None and scope not in SCOPES:
        raise CallbackSpecError(f"callback {name!r} declares scope {scope!r}: expected one of {SCOPES}")
    if scope is None and state is not None: scope = 'element'
    torch_flag = read('torch_flag')
    if torch_flag is not None and not isinstance(torch_flag, str):
        raise bad('torch_flag', f"expected the name of a torch flag (str), got {type(torch_flag).__name__}")
    sparse = read('sparse_grads')
    if sparse is not None and not (isinstance(sparse, bool) or sparse == 'only' or callable(sparse)):
        raise bad('sparse_grads', "expected True, False, 'only' or a function of the hypers")
    out = CallbackSpec(
        name=name, sparse_grads=False if sparse is None else sparse, defaults=defaults, state=state, scope=scope,
        transient=names('transient'), shared=names('shared'), additive=flag('additive', False),
        on_train=function('on_train'), on_eval=function('on_eval'), supports_complex=flag('supports_complex', True),
        torch_names=mapping('torch_names', lambda x: is_name(x) or (isinstance(x, tuple) and all(map(is_name, x))),
                            'a hyper name or a tuple of them') or {},
        torch_state=mapping('torch_state', is_name, 'a state entry name') or {},
        torch_extra_state=function('torch_extra_state'), torch_flag=torch_flag,
        state_kinds=mapping('state_kinds', lambda x: x in STATE_KINDS, f'one of {STATE_KINDS}') or {},
        group_hypers=mapping('group_hypers', is_name, 'the name of a hyper') or {},
        param_state=mapping('param_state') or {}, flat_state=names('flat_state'),
        uses_closure=flag('uses_closure', False),
        torch_model_state=mapping('torch_model_state', lambda x: x is None or is_name(x),
                                  'a state entry name or None') or {})
    if scope != 'model':
        for attr in _MODEL_ONLY:
            if read(attr):  # (an empty or False one says nothing)
                raise bad(attr, "only a whole-model callback (scope = 'model') declares it")
    own_state = set(state or ()) | (set(out.param_state) if scope == 'model' else set())
    unknown = [k for k in out.state_kinds if k not in own_state]
    if unknown: raise bad('state_kinds', f"{unknown[0]!r} is not an entry of its `state`" +
                          ("" if scope != 'model' else " or `param_state`"))
    own_state = set(state or ())
    for attr, keys in (('flat_state', out.flat_state), ('torch_model_state', [k for k in out.torch_model_state.values() if k])):
        missing = [k for k in keys if k not in own_state]
        if missing: raise bad(attr, f"{missing[0]!r} is not an entry of its `state`")
    return out
