"""Backends: the ways an `Optimizer` runs its callback chain over the params, all with the same math (the callbacks').

- `loop`: each callback once per param (fastai's way, and the reference the others are tested against).
- `foreach`: the params are split into buckets (`buckets`) of params that one call can serve; each callback runs
  once per bucket on `TensorList` stand-ins, so its tensor ops become `torch._foreach_*` kernels over the bucket.
- `fused`: the whole chain is one pass per bucket: torch's fused kernel when the chain is exactly one
  (`torch._fused_adamw_` for cbopt's AdamW), otherwise the chain compiled over the bucket with `torch.compile`.
- `auto`: torch's kernel if one matches, else foreach on accelerators, else the faster of foreach and loop as timed
  on the first steps (CPU); see `pick_runner`.

Buckets (`buckets`) hold params that one call can serve; a callback that cannot run on a whole bucket (Python `if`
on a tensor value: `TensorList.__bool__` raises `BucketError`) is found by `probe` on a copy before the bucket is
touched, and that bucket then runs param by param, with a one-time warning naming the callback.

A bucket's state is each param's own `opt.state[p]` entries (viewed as TensorLists while the chain runs), so
state_dicts are the same whatever the backend, and a checkpoint saved under one resumes under any other.
"""
from __future__ import annotations

import functools
import time
import types
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import optimizer as _optimizer  # circular: resolved at call time
from .hypers import Hypers
from .tensorlist import BucketError, TensorList

if TYPE_CHECKING: from .optimizer import Optimizer

__all__ = ['BACKENDS', 'Bucket', 'buckets', 'step_loop', 'step_foreach', 'step_fused', 'step_auto', 'pick_runner',
           'run_step', 'TensorList', 'BucketError']

BACKENDS = ('auto', 'loop', 'foreach', 'fused')


def _run_chain(cbs, p, state: dict, hyper: Mapping) -> None:
    "`optimizer.run_chain`: the one definition of a step, shared by every backend."
    _optimizer.run_chain(cbs, p, state, hyper)


# -- bucketing ---------------------------------------------------------------------------------------------------
class Bucket(NamedTuple):
    "Params that one call of the chain can serve: same group, device, dtype, flags, Python state and state keys."
    group: dict
    params: list
    states: list  # each param's own `opt.state[p]` dict

    @property
    def layout(self) -> tuple:
        "What a compiled chain is specialised on: everything but the values of the Python state."
        p = self.params[0]
        return (p.device, p.dtype, len(self.params), tuple(self.states[0]))


def _state_key(st: dict) -> tuple:
    "Tensor state by key only; Python values (step counts, flags) by value, as one call must share them."
    return tuple([k if isinstance(v, torch.Tensor) else (k, v) for k, v in st.items()])


def buckets(opt: Optimizer) -> list[Bucket]:
    "The params with a grad, grouped by (group, device, dtype, Python-valued state and flags, state keys)."
    out, state = {}, opt.state
    for gi, g in enumerate(opt.param_groups):
        for p in g['params']:
            if p.grad is None: continue
            st = state[p]
            key = (gi, p.device, p.dtype, _state_key(st))
            try: b = out.get(key)
            except TypeError: key, b = (gi, id(p)), None  # an unhashable Python state value: a bucket of its own
            if b is None: b = out[key] = Bucket(g, [], [])
            b.params.append(p)
            b.states.append(st)
    return list(out.values())


def stand_in(b: Bucket) -> TensorList:
    "The bucket as one param: a TensorList of its params whose `.grad` is the TensorList of their grads."
    p = TensorList(b.params)
    p.grad = TensorList([q.grad for q in b.params])
    return p


def bucket_state(b: Bucket) -> dict:
    "The bucket's state as callbacks see it: tensors as TensorLists, Python values (shared by the bucket) as they are."
    return {k: TensorList([s[k] for s in b.states]) if isinstance(v, torch.Tensor) else v for k, v in b.states[0].items()}


def write_state(b: Bucket, before: dict, after: dict) -> None:
    "Give each param its own tensor of every new TensorList state entry, and every param the new Python values."
    for k, v in after.items():
        if v is before.get(k): continue
        if isinstance(v, TensorList):
            for s, t in zip(b.states, v, strict=True): s[k] = t
        else:
            for s in b.states: s[k] = v


# -- per-optimizer runtime memory (kept off the optimizer, so that pickling and deepcopy never see it) ------------
class _Runtime:
    def __init__(self):
        self.warned, self.seen, self.no_compile, self.auto_times = set(), set(), set(), {}
        self.per_param = set()  # bucket layouts whose chain failed the probe: they run param by param

_RUNTIME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

def _runtime(opt) -> _Runtime:
    if opt not in _RUNTIME: _RUNTIME[opt] = _Runtime()
    return _RUNTIME[opt]


def _warn_once(opt, key, msg: str) -> None:
    rt = _runtime(opt)
    if key not in rt.warned:
        rt.warned.add(key)
        warnings.warn(msg, stacklevel=4)


# -- loop ----------------------------------------------------------------------------------------------------------
def step_loop(opt: Optimizer) -> None:
    "The reference: every callback once per param with a grad."
    for g in opt.param_groups:
        hyper = Hypers(g).snapshot()
        for p in g['params']:
            if p.grad is not None: _run_chain(opt.cbs, p, opt.state[p], hyper)


def _loop_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    for p, st in zip(b.params, b.states): _run_chain(opt.cbs, p, st, hyper)


# -- foreach -------------------------------------------------------------------------------------------------------
def probe(cbs, b: Bucket, hyper: Mapping) -> Callable | None:
    """The first callback of the chain that cannot run bucket-wise, found by running the chain on a bucket of one:
    a copy of the bucket's smallest param, grad and state (so nothing real is touched). Control flow in callbacks may
    only depend on hypers and Python state, which the copy shares with the bucket, so what fails here would fail on
    the bucket, and a bucket is only ever stepped whole: never left half-updated by a callback that fails midway."""
    i = min(range(len(b.params)), key=lambda j: b.params[j].numel())
    p = TensorList([b.params[i].detach().clone()])
    p.grad = TensorList([b.params[i].grad.detach().clone()])
    state = {k: TensorList([v.clone()]) if isinstance(v, torch.Tensor) else v for k, v in b.states[i].items()}
    for cb in cbs:
        try:
            new = cb(p, **{**state, **hyper})
            if isinstance(new, dict):
                for k, v in new.items():
                    if isinstance(v, torch.Tensor) and not isinstance(v, TensorList):
                        raise BucketError(f"state {k!r} is one tensor for a whole bucket")
                state.update(new)
        except Exception: return cb
    return None


def foreach_bucket(opt, b: Bucket, hyper: Mapping) -> bool:
    """Run the chain once on bucket `b`, or per param (with a one-time warning) if a callback cannot run bucket-wise.
    Returns whether it ran bucket-wise."""
    rt, layout = _runtime(opt), (id(b.group), b.layout)
    if layout in rt.per_param:  # failed its probe before: the loop is always right, so don't probe every step again
        _loop_bucket(opt, b, hyper)
        return False
    bad = probe(opt.cbs, b, hyper)
    if bad is not None:
        rt.per_param.add(layout)
        name = _optimizer.cb_name(bad)
        _warn_once(opt, ('fallback', name), f"callback {name!r} cannot run on a whole bucket of params (e.g. Python "
                   "control flow on a tensor value); its buckets run param by param")
        _loop_bucket(opt, b, hyper)
        return False
    for chunk in cache_chunks(b):
        p, state = stand_in(chunk), bucket_state(chunk)
        before = dict(state)
        _run_chain(opt.cbs, p, state, hyper)
        write_state(chunk, before, state)
    return True


FOREACH_CHUNK_BYTES = 4 << 20  # on CPU: about what stays in cache between the chain's ops


def cache_chunks(b: Bucket) -> list[Bucket]:
    """On CPU, `b` split into runs of params of about `FOREACH_CHUNK_BYTES` (a larger param alone), so that the chain's
    next op finds the previous op's tensors still in cache instead of streaming the whole bucket from memory once per
    op; the same ops on the same tensors, so results do not change. Accelerators take the bucket whole (one launch)."""
    if b.params[0].device.type != 'cpu': return [b]
    chunks, start, size = [], 0, 0
    for i, p in enumerate(b.params):
        n = p.numel() * p.element_size()
        if i > start and size + n > FOREACH_CHUNK_BYTES:
            chunks.append(Bucket(b.group, b.params[start:i], b.states[start:i]))
            start, size = i, 0
        size += n
    chunks.append(Bucket(b.group, b.params[start:], b.states[start:]))
    return chunks


def step_foreach(opt: Optimizer) -> None:
    "Each callback once per bucket, its tensor ops spread over the bucket by `torch._foreach_*` kernels."
    for b in buckets(opt): foreach_bucket(opt, b, Hypers(b.group).snapshot())


# -- fused: torch's own kernels ------------------------------------------------------------------------------------
def _cb_sig(cb) -> tuple | Callable:
    "A callback by what it computes: `partial`s compare by function and arguments, not by identity."
    if isinstance(cb, functools.partial): return (_cb_sig(cb.func), cb.args, tuple(sorted(cb.keywords.items())))
    return cb


def chain_sig(cbs) -> tuple: return tuple(_cb_sig(cb) for cb in cbs)


@functools.cache
def _adamw_sig() -> tuple:
    from .optimizers import adam_chain
    return chain_sig(adam_chain())


def _is_float(*vs) -> bool: return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs)


def adamw_kernel(opt, b: Bucket, hyper: Mapping) -> Callable[[], None] | None:
    "`torch._fused_adamw_` doing exactly what cbopt's AdamW chain does to `b`, or None if it does not apply."
    st, p0 = b.states[0], b.params[0]
    if chain_sig(opt.cbs) != _adamw_sig() or set(st) - {'do_wd', 'force_train'} != {'grad_avg', 'sqr_avg', 'step'}: return None
    if 'dampening' in hyper or not _is_float(hyper['lr'], hyper['mom'], hyper['sqr_mom'], hyper['eps'], hyper['wd']): return None
    if p0.device.type not in ('cpu', 'cuda') or p0.dtype not in (torch.float32, torch.float64): return None
    if any(s[k].dtype != p0.dtype for s in b.states for k in ('grad_avg', 'sqr_avg')): return None
    if any(p.grad.dtype != p0.dtype for p in b.params): return None
    def run():
        step = st['step'] + 1
        steps = [torch.tensor(float(step), device=p0.device)] * len(b.params)
        torch._fused_adamw_(b.params, [p.grad for p in b.params], [s['grad_avg'] for s in b.states],
                            [s['sqr_avg'] for s in b.states], [], steps, lr=hyper['lr'], beta1=hyper['mom'],
                            beta2=hyper['sqr_mom'], weight_decay=hyper['wd'] if st.get('do_wd', True) else 0.,
                            eps=hyper['eps'], amsgrad=False, maximize=False)
        for s in b.states: s['step'] = step
    return run


KERNELS = [adamw_kernel]  # each: (opt, bucket, hyper) -> a function stepping the bucket, or None


def torch_kernel(opt, b: Bucket, hyper: Mapping) -> Callable[[], None] | None:
    "The first of torch's fused kernels that computes this chain on this bucket, if any."
    for k in KERNELS:
        if (run := k(opt, b, hyper)) is not None: return run
    return None


# -- fused: the chain compiled over a bucket -----------------------------------------------------------------------
class _ScalarArgsAsTensors(torch.overrides.TorchFunctionMode):
    """Inside the compiled chain, turn `alpha=`/`value=`/`weight=`/clamp numbers into tensor ops: torch.compile keeps
    a Python number symbolic (no recompile when lr or step change) only where it meets a tensor, and would otherwise
    bake it into the graph and recompile at every new value."""
    ALPHA = {torch.Tensor.add, torch.Tensor.add_, torch.Tensor.sub, torch.Tensor.sub_, torch.add, torch.sub}
    VALUE = {torch.Tensor.addcmul, torch.Tensor.addcmul_, torch.Tensor.addcdiv, torch.Tensor.addcdiv_, torch.addcmul,
             torch.addcdiv}
    LERP = {torch.Tensor.lerp: torch.Tensor.add, torch.Tensor.lerp_: torch.Tensor.add_, torch.lerp: torch.add}
    CLAMP = {torch.Tensor.clamp, torch.Tensor.clip, torch.clamp, torch.clip}
    CLAMP_ = {torch.Tensor.clamp_, torch.Tensor.clip_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self.CLAMP or func in self.CLAMP_:  # as maximum/minimum with tensors (seen miscompiled otherwise)
            x, bounds = args[0], [*args[1:], None, None]
            lo, hi = kwargs.get('min', bounds[0]), kwargs.get('max', bounds[1])
            as_t = lambda v: v if isinstance(v, torch.Tensor) else torch.zeros_like(x) + v
            res = x if lo is None else torch.maximum(x, as_t(lo))
            res = res if hi is None else torch.minimum(res, as_t(hi))
            return x.copy_(res) if func in self.CLAMP_ else res
        if func in self.ALPHA and 'alpha' in kwargs: args = (args[0], args[1] * kwargs.pop('alpha'), *args[2:])
        elif func in self.VALUE and 'value' in kwargs: args = (args[0], args[1] * kwargs.pop('value'), *args[2:])
        elif func in self.LERP and len(args) == 3 and not isinstance(args[2], torch.Tensor):
            x, end, w = args  # x + w * (end - x)
            return self.LERP[func](x, (end - x) * w)
        return func(*args, **kwargs)


_COMPILED: dict = {}  # (chain_sig, chunk layout) -> compiled function, shared by every optimizer in the process
CHUNK = 32            # params per compiled call: bounds compile time (see `_chunks`)
COMPILER = 'inductor' # torch.compile backend of the fused runner ('aot_eager' checks the tracing without codegen)


def _fused_chain_fn(cbs, name: str) -> Callable:
    "The chain over a list of params as one function, under a code object of its own (torch.compile caches per code)."
    def fused_chain(params, tstates, pystate, hyper):
        new_t, new_py = [], {}
        with _ScalarArgsAsTensors():
            for p, ts in zip(params, tstates):  # unrolled when compiled: one graph, fused by inductor
                st = {**pystate, **ts}
                _run_chain(cbs, p, st, hyper)
                new_t.append({k: v for k, v in st.items() if isinstance(v, torch.Tensor) and v is not ts.get(k)})
                new_py = {k: v for k, v in st.items() if not isinstance(v, torch.Tensor)}
        return new_t, new_py
    code = fused_chain.__code__.replace(co_name=name)
    return types.FunctionType(code, fused_chain.__globals__, name, None, fused_chain.__closure__)


def compiled_chain(opt, b: Bucket, idx: list) -> Callable:
    """The chain compiled for the params `idx` of `b`, with dynamic shapes and Python numbers: a change of lr or step
    does not recompile. Compiled once per chain and layout (device, dtype, ranks, state keys) in this process."""
    p0 = b.params[idx[0]]
    key = (chain_sig(opt.cbs), p0.device, p0.dtype, tuple(b.params[i].ndim for i in idx), tuple(b.states[idx[0]]))
    key = (COMPILER, *key)
    if key not in _COMPILED:
        fn = _fused_chain_fn(opt.cbs, f'cbopt_fused_chain_{len(_COMPILED)}')
        _COMPILED[key] = torch.compile(fn, backend=COMPILER, fullgraph=True, dynamic=True)
    return _COMPILED[key]


def _chunks(shapes: list[tuple]) -> list[list[int]]:
    """Indices of same-shape params, in chunks of at most `CHUNK`. Same shapes let inductor step a whole chunk in one
    loop; a size from CHUNK/2 to CHUNK that divides a shape's count (1000 params: 40 chunks of 25) spares the compile
    of a remainder chunk. With dynamic shapes, chunks of the same rank and length share one compiled graph."""
    groups: dict = {}
    for i, s in enumerate(shapes): groups.setdefault(s, []).append(i)
    out = []
    for idx in groups.values():
        k = next((k for k in range(CHUNK, CHUNK // 2 - 1, -1) if len(idx) % k == 0), CHUNK)
        out += [idx[j:j + k] for j in range(0, len(idx), k)]
    return out


def compiled_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    """Step `b` with the compiled chain, in chunks of params of the same shape (`_chunks`). Compilation traces the chain
    before running anything, so a chain that cannot compile raises before its first chunk is touched."""
    pystate = {k: v for k, v in b.states[0].items() if not isinstance(v, torch.Tensor)}
    chunks = _chunks([p.shape for p in b.params])
    hyper = dict(hyper)
    with torch._dynamo.config.patch(force_parameter_static_shapes=False):  # nn.Parameters get dynamic shapes too
        for j, idx in enumerate(chunks):
            tstates = [{k: v for k, v in b.states[i].items() if isinstance(v, torch.Tensor)} for i in idx]
            try: new_t, new_py = compiled_chain(opt, b, idx)([b.params[i] for i in idx], tstates, pystate, hyper)
            except Exception as e:  # nothing of this chunk ran: the rest of the bucket is handed back untouched
                rest = [i for c in chunks[j:] for i in c]
                raise _CompileFailed(e, Bucket(b.group, [b.params[i] for i in rest], [b.states[i] for i in rest])) from e
            for i, nt in zip(idx, new_t):
                b.states[i].update(nt)
                b.states[i].update(new_py)


class _CompileFailed(Exception):
    def __init__(self, err: Exception, rest: Bucket): self.err, self.rest = err, rest


def fused_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    """One pass over `b`: torch's kernel if one matches; else the compiled chain, once a first eager (foreach) step
    of this layout has created the state; foreach (warning once) if the chain does not compile."""
    if (kernel := torch_kernel(opt, b, hyper)) is not None: return kernel()
    rt, layout = _runtime(opt), (id(b.group), b.layout)
    if layout in rt.no_compile or layout not in rt.seen:
        after = (id(b.group), b.layout) if foreach_bucket(opt, b, hyper) else None
        rt.seen.add(layout)
        if after is None: rt.no_compile.add(layout)  # a chain that cannot run bucket-wise cannot compile either
        else: rt.seen.add(after)  # the layout after the step is state-complete: compile it next time
        return
    try: compiled_bucket(opt, b, hyper)
    except _CompileFailed as e:
        rt.no_compile.add(layout)
        _warn_once(opt, ('compile', layout), f"the callback chain could not be compiled ({type(e.err).__name__}: "
                   f"{e.err}); running it with the foreach backend")
        foreach_bucket(opt, e.rest, hyper)


def step_fused(opt: Optimizer) -> None:
    "The whole chain as one pass per bucket (vertical fusion): torch's fused kernel or the compiled chain."
    for b in buckets(opt): fused_bucket(opt, b, Hypers(b.group).snapshot())


# -- auto ------------------------------------------------------------------------------------------------------------
AUTO_TRIALS = 2  # timed steps of each of foreach and loop before auto settles on the faster, per bucket layout


def pick_runner(opt, b: Bucket, hyper: Mapping) -> tuple[str, Callable]:
    """auto's rule, per bucket:
    1. torch's fused kernel when one computes exactly this chain (cbopt's AdamW on fp32/fp64): the fastest there is;
    2. on an accelerator, foreach: one kernel launch per op for the bucket instead of one per param;
    3. on CPU, foreach or loop, whichever was faster over `AUTO_TRIALS` timed steps each of this bucket layout.
       Measured here (1 thread, README benchmark): on many small params foreach is ~1.9x faster (less Python per
       param); on GPT-2's large params the two are within ~10% either way, as both are memory-bound, and which wins
       depends on the chain. Both are exact, so trying each costs nothing in results.
    The compiled chain is never picked: its first compile costs seconds to a minute; ask for `backend='fused'`."""
    if (kernel := torch_kernel(opt, b, hyper)) is not None: return 'kernel', kernel
    if b.params[0].device.type != 'cpu': return 'foreach', functools.partial(foreach_bucket, opt, b, hyper)
    times = _runtime(opt).auto_times.setdefault((id(b.group), b.layout), {'foreach': [], 'loop': []})
    if min(len(t) for t in times.values()) < AUTO_TRIALS: name = min(times, key=lambda k: len(times[k]))
    else: name = min(times, key=lambda k: min(times[k]))
    return name, functools.partial(foreach_bucket if name == 'foreach' else _loop_bucket, opt, b, hyper)


def step_auto(opt: Optimizer) -> None:
    "Each bucket with the runner `pick_runner` chooses."
    rt = _runtime(opt)
    for b in buckets(opt):
        name, run = pick_runner(opt, b, Hypers(b.group).snapshot())
        times = rt.auto_times.get((id(b.group), b.layout))
        if name == 'kernel' or times is None or len(times[name]) >= AUTO_TRIALS: run()
        else:
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)


RUNNERS = {'loop': step_loop, 'foreach': step_foreach, 'fused': step_fused, 'auto': step_auto}


def run_step(opt: Optimizer, backend: str) -> None:
    "Step `opt` with `backend` (one of `BACKENDS`)."
    if backend not in RUNNERS: raise ValueError(f"unknown backend {backend!r}: expected one of {BACKENDS}")
    RUNNERS[backend](opt)
