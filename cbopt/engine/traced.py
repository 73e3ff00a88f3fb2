"""The step traced by an outer `torch.compile`: torch's compiled-optimizer recipe (`@torch.compile def step():
opt.step()`) on cbopt optimizers, as torch's own optimizers trace: into the caller's graph, with no graph break, and
no recompile as the step count grows or a tensor lr changes (a Python float lr is a constant of the graph, so a new
one recompiles, as with torch's optimizers).

How, in torch's way:
- `prepare` runs when dynamo traces the step, not in the graph (as torch's `_init_group`, which dynamo calls at
  trace time): it creates the state of params about to take their first step, so the graph finds it, and keeps each
  chain's Python counters (`step`) as 0-d float32 tensors in the state, as torch keeps its `step` (`count_tensor`),
  so that a new count is a new value of the same tensor, not a new constant. The chain computes from float64 copies
  of them made in the graph (its bias corrections as the eager step's, from Python numbers), and the new counts are
  copied back into the same tensors, in place (`_wide_counts`), as torch's compiled step adds 1 to its `step`. The
  eager step reads them back as Python numbers for its step (`counters_as_numbers`) and `state_dict` saves them as
  numbers: checkpoints do not change. It also marks the params with a grad and their state tensors static, as
  torch's compiled optimizers mark theirs (`_torch.static_address`): dynamo guards their identity alone and keeps them
  in the graph, where it would check the metadata of each (and a few attributes each) at every call and pass each
  as an argument; so a state entry the chain rebinds to a new tensor is copied into its old one instead (`_in_place`),
  as torch's state is updated in place. The grads are read as torch's compiled optimizers read theirs, through an
  `_init_group` call (on the optimizer's `_torch.GradReader`), which dynamo runs eagerly and whose grads it guards as
  present alone, not by their metadata, five `hasattr`s and an aliasing check each at every call (a grad that
  changes dtype or shape between steps is then not seen by the guards, as with torch's). The per-call cost left
  beside the kernels is then about torch's: an identity guard per param and state tensor, and the grads passed in.
- the traced step runs each group's chain once per bucket (`_traced_buckets`: the params of a group with a grad that
  share a device, dtype, state layout and count, at most `TRACED_BUCKET_PARAMS` of them), on `TensorList` stand-ins,
  as the `foreach` backend does: the graph holds one copy of the chain per bucket, of `torch._foreach_*` ops that
  inductor fuses horizontally (as torch's own compiled optimizers trace), whatever the number of params; every backend
  setting steps so under compile, the kernels being the compiler's. A chain with a callback that cannot run on a whole
  bucket (`foreach.probe`, run by `prepare` on a copy; cbopt's own callbacks all can) is traced once per param instead
  (`run_param`, the `loop` backend's path), with a one-time warning naming the callback. A tensor given where an op
  takes a number (a tensor lr as `alpha=`, a bias correction from a tensor count as `value=`) is traced by dynamo as a
  tensor op (an fma), as eager mode computes it.

The step runs eagerly instead, one graph break (`run_step`'s eager path), where tracing cannot do what eager does:
whole-model callbacks (clipping, accumulation, L-BFGS: their state is Python numbers in the param groups), a closure,
GradScaler's inf check (`found_inf`), a group in eval mode (the eager step raises), params sharded as DTensors, and a
chain whose callbacks read a Python value of a tensor (`if r > 5` on RAdam's rectification term, Lookahead's `la_step %
k`: with a tensor count those are data-dependent branches), which `prepare` finds by running the chain on a copy.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from numbers import Number
from typing import Any

import torch

from .._torch import constant_result, static_address
from ..core.chain import (chain_counters, chain_scope, cb_name, is_cbopts, is_declared, is_model_cb, param_chain,
                          run_chain, transient_keys)
from ..core.dtensor import is_dtensor
from ..core.hypers import Hypers
from ..core.tensorlist import TensorList
from .buckets import Bucket, _bucket_key, as_real, bucket_state, stand_in, write_state
from .compiled import float64_0d_copies, is_float64_0d
from .foreach import dry_copy, probe, run_param
from ..core.runtime import param_states, warn_once

__all__ = ['can_trace', 'traced_step', 'prepare', 'counters_as_numbers', 'number_tensor', 'count_tensor', 'VALUE_READS', 'ValueRead']

# what reads a Python value out of a tensor: a data-dependent branch when traced
VALUE_READS = frozenset({torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__,
                         torch.Tensor.__index__, torch.Tensor.tolist})


class ValueRead(TypeError):
    "A callback read a Python value of a tensor (an `if` on it, `.item()`, `float()`): it cannot be traced into a graph."


class _RefuseValueReads(torch.overrides.TorchFunctionMode):
    "Raises `ValueRead` where a callback reads a Python value of a tensor."
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in VALUE_READS: raise ValueRead(f"{func.__name__} of a tensor")
        return func(*args, **(kwargs or {}))


def number_tensor(v: Any, like: torch.Tensor) -> torch.Tensor:
    """A Python number (a step count, a hyper) as a 0-d float64 tensor on `like`'s device (float32 on MPS, which has no
    float64): exact for counts up to 2**53; a tensor is returned as it is."""
    if isinstance(v, torch.Tensor): return v
    return torch.tensor(v, dtype=torch.float32 if like.device.type == 'mps' else torch.float64, device=like.device)


def count_tensor(v: Any, like: torch.Tensor) -> torch.Tensor:
    """A chain's step count as torch keeps `state['step']`: a 0-d float32 tensor on `like`'s device (exact up to
    2**24 steps, as torch's), which the traced step updates in place (`_wide_counts`); a tensor is returned as it is.
    Not float64: dynamo takes a 0-d float64 input for one of its own tensorified Python floats, and guards each with a
    Python `.item()` per call, and AOT autograd drops in-place updates of such inputs."""
    if isinstance(v, torch.Tensor): return v
    return torch.tensor(float(v), dtype=torch.float32, device=like.device)


def groups(opt) -> list:
    """`opt.param_groups`, read as a plain attribute: dynamo's handling of torch.optim's `param_groups` (for torch's
    capturable flags) assumes plain dicts, and cbopt's groups are `ParamGroup`s."""
    return opt.__dict__['param_groups']


def _reads_values(cbs: list, p: torch.Tensor, state: Mapping, hyper: Mapping) -> bool:
    "Whether the chain reads a Python value of a tensor, run on a copy of `p`, its grad and state (counters as tensors)."
    q, st = dry_copy(p, state)
    counters = chain_counters(cbs)
    st = {k: number_tensor(v, p) if k in counters else v for k, v in st.items()}
    try:
        with _RefuseValueReads(): run_param(cbs, q, st, hyper, transient_keys(cbs))
    except ValueRead: return True
    return False


def _not_bucketwise(cbs: list, b: Bucket, hyper: Mapping):
    "The first callback of the chain that cannot run on a whole bucket (`foreach.probe`, with counters as tensors)."
    counters = chain_counters(cbs)
    st = {k: number_tensor(v, b.params[0]) if k in counters else v for k, v in b.states[0].items()}
    return probe(cbs, Bucket(b.group, b.params[:1], [st]), hyper)


@constant_result
def prepare(opt) -> bool:
    """Run when dynamo traces a step, never in the graph (dynamo calls it eagerly and keeps its answer, as it does
    torch's `_init_group`). Returns whether every group with grads can be traced (see the module docstring); if so,
    creates the declared state of params about to take their first step, turns the chains' Python counters into
    0-d float32 tensors (`count_tensor`), so the graph steps them as inputs, one per bucket (`_share_counts`), and
    marks the params and state static. Nothing changes otherwise."""
    from ..core.flags import split_flags
    from ..core.initial import initial_state
    todo, per_param = [], []
    with torch.no_grad():
        for gi, g in enumerate(opt.param_groups):
            ps = [p for p in g['params'] if p.grad is not None]
            if not ps: continue
            if any(is_dtensor(p) for p in ps): return False
            cbs = param_chain(g['cbs'])
            fresh = {p: initial_state(opt, p, g) for p in ps if is_declared(cbs) and not split_flags(param_states(opt)[p])[0]}
            p0 = ps[0]
            with as_real(Bucket(g, [p0], [{**param_states(opt)[p0], **fresh.get(p0, {})}])) as b:
                hyper = Hypers(g).snapshot()
                if _reads_values(cbs, b.params[0], b.states[0], hyper): return False
                if not (is_declared(cbs) and all(map(is_cbopts, cbs))) and (bad := _not_bucketwise(cbs, b, hyper)):
                    per_param.append(gi)
                    name = cb_name(bad)
                    warn_once(opt, ('traced per param', name), f"callback {name!r} cannot run on a whole bucket of "
                              "params: a compiled step traces its chain once per param (a larger graph, a longer "
                              "compile)")
            todo.append((gi, g, cbs, fresh))
        count_classes = {}
        for gi, g, cbs, fresh in todo:
            for p, st in fresh.items(): param_states(opt)[p].update(st)
            counters = chain_counters(cbs)
            for p in g['params']:
                st = param_states(opt).get(p)
                for k in counters:
                    if st and isinstance(st.get(k), Number): st[k] = count_tensor(st[k], p)
            count_classes[gi] = _share_counts(opt, g, counters, chain_scope(cbs) == 'tensor', gi not in per_param)
            for p in g['params']:
                st = param_states(opt).get(p)
                if p.grad is None: continue
                static_address(p)  # (as torch's compiled optimizers: identity guards, no inputs; see the module docstring)
                for v in (st or {}).values():
                    if _kept(v): static_address(v)
    opt.__dict__['_counters_are_tensors'] = True
    opt.__dict__['_traced_per_param'] = tuple(per_param)
    opt.__dict__['_traced_groups'] = {gi: (_float64_keys(opt, g), count_classes.get(gi, ()))
                                      for gi, g in enumerate(opt.param_groups)}
    return True


TRACED_BUCKET_PARAMS = 32
"""The most params one traced call of a chain steps (`_share_counts`), so one count and one set of bias corrections:
every param's update reads its bucket's corrections, and inductor's fusion pass tries each node against up to 64 (its
`max_fusion_buffer_group_pairwise_attempts`) of the others that read a buffer it reads, and the merged nodes against
each other again, round after round; on GPT-2 small (148 params in one bucket) that pass took 12-16 s of a compile
where torch's compiled AdamW spends 2 s in it. In buckets of 32 it takes about 5 s, every pair of a bucket still
tried, so the same-size params of a bucket still merge their loops (the faster step)."""


def _share_counts(opt, g, counters: Mapping, by_rank: bool, bucketwise: bool) -> tuple:
    """Makes the params of group `g` that one traced call of the chain steps with one count (a bucket's params with a
    grad, `_traced_buckets`, whose counts are equal, as the eager step buckets them by their counts, at most
    `TRACED_BUCKET_PARAMS` of them) hold one count, per counter: tensors of their own that share one storage
    (`_same_count`), so that the chain computes its bias corrections once per bucket, from one count, and the graph
    writes one count back, where it did both once per param. Every other param gets a count with a storage of its own
    (every param, with `bucketwise` False: a chain traced per param steps each param's count). Each param's count
    stays a tensor of its own, which dynamo guards by identity: a count given anew to one param
    (`counters_as_numbers`, `TorchParamState`) traces the step again, and this sharing is worked out again. Returns
    the class (its bucket of equal counts) of each param with a grad, in the group's order; counts that already share
    a storage among exactly their class's params are kept, so a step traced again finds the tensors of the graphs it
    compiled before. The counts are read with one wait per device (`_numbers`), not one per param."""
    states = param_states(opt)
    held = [(p, k, v) for p in g['params'] for k in counters
            if isinstance(v := (states.get(p) or {}).get(k), torch.Tensor)]
    number = dict(zip(((id(p), k) for p, k, _ in held), _numbers([v for _, _, v in held])))
    holders = Counter(v.data_ptr() for _, _, v in held)
    members, classes, sizes, out = {}, {}, Counter(), []
    for p in g['params']:
        if p.grad is None or not bucketwise: continue
        st = states.get(p) or {}
        key = (_bucket_key(0, p, st, by_rank), tuple((k, number[id(p), k]) for k in counters if (id(p), k) in number))
        cls = classes.setdefault((key, sizes[key] // TRACED_BUCKET_PARAMS), len(classes))
        sizes[key] += 1
        members.setdefault(cls, []).append((p, st))
        out.append(cls)
    for pst in members.values():
        sts = [st for _, st in pst]
        for k in counters:
            if not isinstance(first := sts[0].get(k), torch.Tensor): continue
            ptr = first.data_ptr()
            if holders[ptr] == len(sts) and all(st[k].data_ptr() == ptr for st in sts): continue
            first = count_tensor(number[id(pst[0][0]), k], first)
            for st in sts: st[k] = _same_count(first)
    in_class = {id(st) for pst in members.values() for _, st in pst}
    holders = Counter(states[p][k].data_ptr() for p, k, _ in held)
    for p, k, v in held:
        if id(st := states[p]) in in_class or holders[v.data_ptr()] <= 1: continue
        holders[v.data_ptr()] -= 1
        st[k] = count_tensor(number[id(p), k], v)
    return tuple(out)


def _numbers(tensors: list) -> list:
    "The values of 0-d tensors as Python numbers, read with one `tolist` per device (on a GPU, one wait), in order."
    by_device: dict = {}
    for i, t in enumerate(tensors): by_device.setdefault(t.device, []).append(i)
    out = [None] * len(tensors)
    for idx in by_device.values():
        for i, n in zip(idx, torch.stack([tensors[i] for i in idx]).tolist()): out[i] = n
    return out


def _same_count(t: torch.Tensor) -> torch.Tensor:
    """A tensor of its own holding `t`'s storage (not a view: no `_base`), so that a write into either is seen by both,
    and dynamo, which guards one tensor object once however many state entries hold it, guards each by identity."""
    return t.detach()


def can_trace(opt) -> bool:
    """Whether the step can be traced (see the module docstring). Run while tracing: what it reads is guarded, so a
    change (GradScaler's flag, a group put in eval mode, a new chain) traces again."""
    if getattr(opt, 'found_inf', None) is not None or getattr(opt, 'grad_scale', None) is not None: return False
    for g in groups(opt):
        if g.get('train_mode') is False: return False
        if g.get('state_precision', 'fp32') != 'fp32': return False  # (low-bit state steps eagerly: `engine.lowbit`)
        for cb in g['cbs']:
            if is_model_cb(cb): return False
    return prepare(opt)


def traced_step(opt) -> None:
    """The step as dynamo traces it: each group's chain once per bucket of its params with a grad (on TensorLists:
    `torch._foreach_*` ops, which inductor fuses horizontally, as torch's compiled optimizers), or once per param for
    a chain `prepare` found cannot run bucket-wise, with the group's hypers (see the module docstring); then
    `opt.step_stats`."""
    lrs = []
    per_param = _per_param_groups(opt)
    for gi, g in enumerate(groups(opt)):
        hyper = Hypers(g).snapshot()
        lrs.append(hyper.get('lr'))
        todo, grads = _with_grads(opt, gi, g)
        if not todo: continue
        own, transient, counters = _chain_facts(opt, gi)
        cbs = [g['cbs'][i] for i in own]
        all_states = param_states(opt)  # (after the grads: see `_with_grads`)
        states = [all_states[p] for p in todo]
        wide, classes = _group_plan(opt, gi)
        if wide:  # (see `compiled.float64_0d_copies`: an in-place update of one would be lost)
            for st in states: st.update(float64_0d_copies(st, wide))
        if gi in per_param:
            for q, qst in zip(todo, states):
                with as_real(Bucket(g, [q], [qst])) as b:  # (a bucket of one: the group's params may differ in dtype)
                    p, st = b.params[0], b.states[0]
                    before = dict(st)
                    with _wide_counts(st, counters): run_param(cbs, p, st, hyper, transient)
                    _in_place(before, st)
            continue
        for b, b_grads in _traced_buckets(g, todo, grads, states, classes):
            with torch.no_grad(), as_real(b) as real:  # (a TensorList's `.data` is itself: no_grad as torch's step has)
                if real is b:  # (the grads as read: a param's `.grad` read again would be guarded as a tensor)
                    p = TensorList(b.params)
                    p.grad = TensorList(b_grads)
                else: p = stand_in(real)  # (complex params' real views, their grads given by as_real)
                b, state = real, bucket_state(real)
                before = dict(state)
                with _wide_counts(state, counters): run_chain(cbs, p, state, hyper)
                _in_place(before, state)
                write_state(b, before, state, transient)
    opt.step_stats = {'lr': lrs, 'skipped': False}


def _with_grads(opt, gi: int, g) -> tuple[list, list]:
    """Group `gi`'s params that have a grad, and their grads, read through the optimizer's `GradReader` (as torch's
    compiled optimizers read theirs, through `_init_group`: each grad guarded as present alone), or, for an optimizer
    without one, as `p.grad` (each guarded by its metadata); read before the state, whose keys are the params."""
    reader = opt.__dict__.get('_optimizer_grads')
    todo, grads = [], []
    if reader is not None:
        reader._init_group(gi, todo, grads)
        return todo, grads
    for p in g['params']:
        grad = p.grad
        if grad is not None:
            todo.append(p)
            grads.append(grad)
    return todo, grads


def _kept(t: Any) -> bool:
    "Whether `t` is a state tensor `prepare` marks static (all but 0-d float64 ones, which the step hands copies of)."
    return isinstance(t, torch.Tensor) and not is_float64_0d(t)


def _in_place(before: Mapping, after: dict) -> None:
    """State entries the chain rebound to new tensors of the same shape, dtype and device, copied into the tensors they
    had instead (in the graph), which stay the entries: `prepare` marks those static, as torch's compiled optimizers
    mark their state (a new tensor there would fail its identity guard and compile the step again), and torch's
    update theirs in place. For a param's dict, or a bucket's TensorLists."""
    for k, new in after.items():
        old = before.get(k)
        if new is old: continue
        if isinstance(old, TensorList) and isinstance(new, TensorList):
            olds, news = list(old), list(new)
            if len(olds) != len(news): continue
            pairs = list(zip(olds, news))
        elif isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor): pairs = [(old, new)]
        else: continue
        if not all(_kept(o) and isinstance(n, torch.Tensor) and o.shape == n.shape and o.dtype == n.dtype
                   and o.device == n.device for o, n in pairs): continue
        for o, n in pairs: o.copy_(n)
        after[k] = old


def _float64_keys(opt, g) -> tuple:
    "The keys of the 0-d float64 entries in the state of group `g`'s params (`compiled.float64_0d_copies`)."
    states = (param_states(opt).get(p) or {} for p in g['params'] if p.grad is not None)
    return tuple(sorted({k for st in states for k, v in st.items() if is_float64_0d(v)}))


@constant_result
def _group_plan(opt, gi: int) -> tuple[tuple, tuple]:
    """What `prepare` found of group `gi`, read eagerly (a constant of the trace): the keys of its 0-d float64 state
    entries (`_float64_keys`), which the traced step copies alone instead of scanning every entry of every param's
    state for them, and the class of each of its params with a grad (`_share_counts`)."""
    return opt.__dict__.get('_traced_groups', {}).get(gi, ((), ()))


@constant_result
def _per_param_groups(opt) -> tuple:
    """The groups `prepare` found a chain in that cannot run bucket-wise: read eagerly (a constant of the trace), as
    dynamo keeps the optimizer's attributes as it first read them, before `prepare` ran."""
    return opt.__dict__.get('_traced_per_param', ())


@constant_result
def _chain_facts(opt, gi: int) -> tuple:
    """What the traced step needs of group `gi`'s chain, worked out eagerly (a constant of the trace: dynamo traced
    each callback's declarations otherwise, an eighth of a compiled Adam step's traced instructions): the positions of
    its per-param callbacks in the group's `cbs`, its transient state keys and its counters' keys. The callbacks
    themselves are read in the trace, so dynamo guards them (as `can_trace` does)."""
    cbs = groups(opt)[gi]['cbs']
    at = tuple(i for i, cb in enumerate(cbs) if not is_model_cb(cb))
    own = [cbs[i] for i in at]  # (`param_chain`)
    return at, tuple(sorted(transient_keys(own))), tuple(chain_counters(own))


def _traced_buckets(g, params: list, grads: list, states: list, classes: tuple) -> list[tuple[Bucket, list]]:
    """A group's params with a grad, in the buckets one call of the chain serves, each with its params' grads (as
    read): `classes`, from `_share_counts` (as `buckets.buckets`: device, dtype, state keys and Python values; rank,
    for a chain reducing over whole params; and their count, one tensor per bucket, at most `TRACED_BUCKET_PARAMS`
    params). Each state's keys and entries are looked at here all the same, so that dynamo guards them (the keys, the
    Python values by value, the tensors by identity): an entry added to one param's state, a Python value changed or
    a count given anew (the chain reads a bucket's first count alone) traces the step again, and `_share_counts`
    buckets anew. Param by param, entry by entry, so that the graph takes the state tensors in that order: taken in
    the chain's order (every first moment, then every second), inductor's reordering for peak memory placed the
    updates of same-size params too far apart to fuse their loops, and its fusion pass took 1.8x as long."""
    out: dict = {}
    for p, grad, st, cls in zip(params, grads, states, classes, strict=True):
        for k in st: isinstance(st[k], torch.Tensor)  # (a value dynamo looks at: guarded by value, a tensor by id)
        if cls not in out: out[cls] = (Bucket(g, [], []), [])
        b, b_grads = out[cls]
        b.params.append(p)
        b.states.append(st)
        b_grads.append(grad)
    return list(out.values())


@contextmanager
def _wide_counts(state: dict, counters: Mapping) -> Iterator[None]:
    """The chain's counters in `state` (a param's tensors, or a bucket's TensorLists of them, which share one storage:
    `_share_counts`) handed to the chain as a float64 copy of the first, made in the graph (float32 on MPS), so that
    it computes from it (bias corrections) as the eager step does from its Python number, once per bucket as the
    eager step does; after the chain, the count's new value is copied back into that tensor in place, and so into the
    storage of the whole bucket's counts (exact up to 2**24), as torch's compiled step adds 1 to its `step`: the graph
    writes its inputs and returns nothing for them, and dynamo puts nothing back into the state dicts."""
    counts = {}
    for k in counters:
        v = state.get(k)  # (no walrus in a comprehension: dynamo cannot trace its cell)
        if isinstance(v, (torch.Tensor, TensorList)): counts[k] = (v, list(v)[0] if isinstance(v, TensorList) else v)
    for k, (_, t) in counts.items(): state[k] = t.to(_wide(t))
    yield
    for k, (v, t) in counts.items():
        t.copy_(state[k])
        state[k] = v


def _wide(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.device.type == 'mps' else torch.float64


@contextmanager
def counters_as_numbers(opt) -> Iterator[None]:
    """For an eager step (which buckets params by their counts and lets callbacks branch on them): the counters a
    traced step keeps as tensors, as Python numbers of their declared type, written back into their tensors after,
    so a traced step that follows finds the same inputs; a param whose count no longer equals the others' of its
    shared tensor (`_share_counts`: it had no grad) gets a tensor of its own, which fails the compiled step's
    guards, so that it traces again. Free for an optimizer that was never traced."""
    if not opt.__dict__.get('_counters_are_tensors'):
        yield
        return
    held, entries = [], []
    for g in opt.param_groups:
        counters = chain_counters(param_chain(g['cbs']))
        for p in g['params']:
            st = param_states(opt).get(p)
            if not st: continue
            for k, kind in counters.items():
                if isinstance(v := st.get(k), torch.Tensor): entries.append((st, k, kind, v))
    for (st, k, kind, v), n in zip(entries, _numbers([e[3] for e in entries])):  # (one wait per device)
        st[k] = kind(n)
        held.append((st, k, v))
    try: yield
    finally:
        filled = {}
        for st, k, t in held:
            if isinstance(v := st.get(k), Number):
                if filled.setdefault(t.data_ptr(), v) != v: t = count_tensor(v, t)  # (a bucket's, now different)
                else: t.fill_(v)
                st[k] = t
