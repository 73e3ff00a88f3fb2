"""Buckets: the params with a grad, split into groups that one call of a chain can serve.

A bucket's params share their chain and hypers, device, dtype, flags, the keys of their tensor state and the values
of their Python state (a step count is one number for the whole call). Params of several param groups share a bucket
when the groups hold the same callbacks and equal entries (`sharing_key`: a model with one group per layer or per
tensor, all alike, steps in as few calls as one with a single group, where torch's optimizers call their kernels once
per group); such a bucket keeps its groups' own buckets (`parts`), which a step runs instead when the groups' hypers
differ at that step (`runs`: a scheduler that set one group's lr). A bucket's state is each param's own
`opt.state[p]` dict, viewed as `TensorList`s while the chain runs, so state_dicts are the same whatever the backend,
and a checkpoint saved under one resumes under any other.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import compress
from operator import attrgetter, is_, itemgetter
from typing import Any, NamedTuple

import torch

from .._torch import metadata_guard
from ..core.chain import chain_scope, param_chain
from ..core.dtensor import layout_key
from ..core.hypers import is_model_entry
from ..core.tensorlist import TensorList
from ..core.runtime import param_states, runtime

__all__ = ['give_grad', 'Bucket', 'buckets', 'planned_buckets', 'BucketPlan', 'grad_is_odd', 'is_sparse', 'SPARSE', 'WithSparse', 'stand_in', 'bucket_state', 'write_state',
           'sharing_key', 'runs', 'cache_chunks', 'model_buckets', 'as_real']


def give_grad(q: torch.Tensor, grad: torch.Tensor | None) -> None:
    """`q.grad = grad` for a stand-in `q` of a param (an alias, a copy, a pack): a param whose `grad_dtype` is another
    dtype (torch 2.13: a bf16 param with fp32 grads) has grads that `q`, whose grad_dtype is its own dtype, would refuse;
    `q` takes the grad's dtype for its grads then, as the param does."""
    if grad is not None and grad.dtype != q.dtype and q.grad_dtype != grad.dtype: q.grad_dtype = grad.dtype
    q.grad = grad


class Bucket(NamedTuple):
    """Params that one call of the chain can serve: same chain and hypers, device, dtype, flags, Python state and state
    keys. `group` is the first of their groups; a bucket of several groups' params lists each group's own bucket in
    `parts` (the params in order, group by group), which a step runs where the groups' hypers differ (`runs`)."""
    group: dict
    params: list
    states: list  # each param's own `opt.state[p]` dict
    # what runners found out about the bucket's layout (`kernels.kernel_step`), kept while `BucketPlan` finds the
    # bucket unchanged; None for a bucket made for one step
    known: dict | None = None
    parts: tuple = ()  # the groups' own buckets, for a bucket of several groups' params; () for a bucket of one group

    @property
    def cbs(self) -> list:
        """The group's per-param callbacks (its whole-model ones run once per step, around the buckets: see `engine`);
        kept while the plan holds (it holds while the group's chain lists the same callbacks)."""
        return self.kept('cbs', lambda: param_chain(self.group['cbs']))

    def kept(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """`make()`, kept in `known` under `key` while the bucket's plan holds (what depends only on the bucket's
        layout, asked at every step); made each time for a bucket made for one step."""
        known = self.known
        if known is None: return make()
        if (v := known.get(key)) is None: v = known[key] = make()
        return v

    @property
    def layout(self) -> tuple:
        "What a compiled chain is specialised on (group, device, dtype, size, state keys), taken as the state is now."
        p = self.params[0]
        return (id(self.group), p.device, p.dtype, len(self.params), tuple(self.states[0]))


def _state_key(st: dict) -> tuple:
    "Tensor state by key only; Python values (step counts, flags) by value, as one call must share them."
    return tuple([k if isinstance(v, torch.Tensor) else (k, v) for k, v in st.items()])


def grad_is_odd(p) -> bool:
    "A cheap test, per step and param, for a grad the engine must look at closely (sparse, another shape or dtype)."
    g = p.grad
    return g.layout is not torch.strided or g.dtype is not p.dtype or g.shape != p.shape


def _bucket_key(gi: int, p, st: dict, by_rank: bool) -> tuple:
    return (gi, p.device, p.dtype, layout_key(p), _state_key(st), p.ndim if by_rank else None)


SPARSE = 'sparse'  # the last entry of the key of a bucket of params with sparse grads (which the loop runner steps)


class WithSparse(list):
    "A step's buckets when some hold params with sparse grads (`BucketPlan`): a list, of this type so it says so."


def is_sparse(b: Bucket) -> bool:
    "Whether `b` holds params with sparse grads (`on_odd_grad` let them pass): the loop runner steps them, as torch's."
    return b.params[0].grad.is_sparse


_SCALARS = frozenset({int, float, bool, str, type(None)})  # group values compared by type and value


def _frozen(v: Any) -> Hashable:
    "A group entry, hashable: plain values by type and value, a tensor by identity, sequences of such (else TypeError)."
    t = type(v)
    if t in _SCALARS: return t, v
    if isinstance(v, torch.Tensor): return torch.Tensor, id(v)
    if t is tuple or t is list: return t, tuple(map(_frozen, v))
    raise TypeError(t)


def sharing_key(g: dict) -> Hashable | None:
    """What two param groups whose params may share buckets have in common: the same callbacks (objects) and equal
    entries (tensors: the same objects), their params, names and whole-model callbacks' state aside; None for a group
    whose params keep buckets of their own (low-bit state, an entry of another kind). Equal hypers now are checked
    again at every step (`runs`)."""
    if g.get('state_precision', 'fp32') != 'fp32': return None
    try: return (tuple(map(id, g['cbs'])),
                 tuple([(k, _frozen(v)) for k, v in g.items() if k not in _OWN_ENTRIES and not is_model_entry(k)]))
    except TypeError: return None


_OWN_ENTRIES = ('params', 'param_names', 'chain', 'cbs')  # (the chain: compared as `g['cbs']`, by its callbacks)


def _same(a: Any, b: Any) -> bool:
    "Two hyper values one call may use either of: the same object, or equal plain values of one type (sequences too)."
    if a is b: return True
    t = type(a)
    if t is not type(b) or isinstance(a, torch.Tensor): return False
    if t is tuple or t is list: return len(a) == len(b) and all(map(_same, a, b))
    try: return bool(a == b)
    except Exception: return False  # (a value whose comparison fails: not the same)


def _same_hypers(a: Mapping, b: Mapping) -> bool:
    "Whether two groups' hypers for a step (`Hypers.snapshot`) are the same (`_same`): one C-level test when all are plain."
    if a is b: return True
    types = tuple(map(type, a.values()))
    if len(a) != len(b) or types != tuple(map(type, b.values())): return False
    if _SCALARS.issuperset(types): return a == b
    return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())


def runs(b: Bucket, snapshots: Mapping, scales: Mapping | None = None) -> Sequence[Bucket]:
    """What a step runs for bucket `b`: `b` itself, or, where its params come from several groups (`b.parts`) whose
    hypers for this step (`snapshots`: id(group) -> hypers) or grad scales (`scales`, id(group) -> (tensor, in_place),
    from a whole-model callback) differ, each group's own bucket. The check costs a comparison of two dicts per group."""
    parts = b.parts
    if not parts: return (b,)
    s0 = snapshots[id(b.group)]
    if not all(_same_hypers(snapshots[id(q.group)], s0) for q in parts): return parts
    if scales:
        c0 = scales.get(id(b.group))
        for q in parts:
            c = scales.get(id(q.group))
            if c is not c0 and (c is None or c0 is None or c[0] is not c0[0] or c[1] != c0[1]): return parts
    return (b,)


def _keyed_buckets(opt, on_odd_grad: Callable | None = None) -> dict:
    "`buckets`, by their keys (a group's first sharer's index stands for the group: `sharing_key`)."
    out, spans, state = {}, {}, param_states(opt)
    first: dict = {}
    for gi, g in enumerate(opt.param_groups):
        by_rank = chain_scope(g['cbs']) == 'tensor'  # such a chain may keep state by rank (`chain.declared_for`)
        share = sharing_key(g)
        ci = gi if share is None else first.setdefault(share, gi)
        for p in g['params']:
            if p.grad is None: continue
            odd = on_odd_grad is not None and grad_is_odd(p)
            if odd: on_odd_grad(opt)
            st = state[p]
            key = _bucket_key(ci, p, st, by_rank)
            if odd and p.grad.is_sparse: key += (SPARSE,)  # (a key of 7: the plan is made again at each step)
            try: b = out.get(key)
            except TypeError: key, b = (gi, id(p)), None  # an unhashable Python state value: a bucket of its own
            if b is None:
                b = out[key] = Bucket(g, [], [])
                spans[key] = [(g, 0)]
            elif spans[key][-1][0] is not g: spans[key].append((g, len(b.params)))
            b.params.append(p)
            b.states.append(st)
    for key, span in spans.items():
        if len(span) > 1:
            b = out[key]
            ends = [i for _, i in span[1:]] + [len(b.params)]
            out[key] = b._replace(parts=tuple(Bucket(g, b.params[i:j], b.states[i:j]) for (g, i), j in zip(span, ends)))
    return out


def buckets(opt) -> list[Bucket]:
    """The params of `opt` with a grad, grouped by (group, or groups alike: `sharing_key`; device, dtype, Python-valued
    state and flags, state keys; rank, for a chain that reduces over whole params; mesh and placements, for params
    sharded as DTensors)."""
    return list(_keyed_buckets(opt).values())


_GRAD = attrgetter('grad')
_NONE = type(None)
_NUMBERS = (int, float, bool)  # Python state values a plan compares (step counts, flags); any other: no plan


class BucketPlan:
    """`buckets(opt)`, kept between steps and checked at each against what it was made from, which costs a fraction
    of making it again: per param, C-level passes over the params, grads and state (which params have a grad, the
    same state dicts with the same keys, the Python values equal within each bucket) and one metadata check of
    every param, grad and state tensor (`cbopt._torch.metadata_guard`). Grads are new tensors each step (`zero_grad` sets them
    to None), a param can be given new memory, a dtype or another shape, state can be loaded or written: whatever
    changes the buckets fails the check. A step finds the buckets `buckets` would make, in its order."""

    def __init__(self, opt, on_odd_grad: Callable | None = None):
        keyed = _keyed_buckets(opt, on_odd_grad)
        self.buckets = [Bucket(b.group, b.params, b.states, {}, tuple(q._replace(known={}) for q in b.parts))
                        for b in keyed.values()]
        self.keys = list(keyed)
        per_group = Counter(k[0] for k in self.keys)  # buckets that could merge: those of a group (or of groups alike)
        self.mergeable = [i for i, k in enumerate(self.keys) if per_group[k[0]] > 1]  # with several
        self.state = param_states(opt)
        self.groups = [(g, list(g['params']), tuple(g['cbs']), list(map(type, map(_GRAD, g['params']))))
                       for g in opt.param_groups]
        plain = all(len(k) == 6 and k[3] is None for k in self.keys)  # (no DTensors: placements are not checked;
        self.sparse = any(k[-1] == SPARSE for k in self.keys)  # no sparse grads: their metadata is not strides')
        if self.sparse: self.buckets = WithSparse(self.buckets)  # (what a step tells at no cost: `is_sparse`)
        ts = self._tensors(opt) if plain else None
        self.guard = None if ts is None else metadata_guard(ts)

    def _tensors(self, opt) -> list | None:
        "Every param with a grad, its grad and each tensor of its state, as now; None if one is not where it was."
        ts = []
        for g, params, cbs, grad_types in self.groups:
            ps = g['params']
            if len(ps) != len(params) or not all(map(is_, ps, params)): return None
            grads = list(map(_GRAD, ps))
            if list(map(type, grads)) != grad_types: return None  # a grad came or went
            if _NONE in grad_types:
                has = [t is not _NONE for t in grad_types]
                ps, grads = list(compress(ps, has)), list(compress(grads, has))
            ts += ps
            ts += grads
        for b in self.buckets:
            st0 = b.states[0]
            n = len(st0)
            if list(map(len, b.states)) != [n] * len(b.states): return None
            for k, v in st0.items():
                vs = list(map(itemgetter(k), b.states))
                if isinstance(v, torch.Tensor): ts += vs
                elif type(v) not in _NUMBERS or list(map(type, vs)).count(type(v)) != len(vs) or vs.count(v) != len(vs):
                    return None
        return ts

    def current(self, opt) -> list[Bucket] | None:
        """The plan's buckets if nothing they depend on changed since it was made, else None. A grad that
        `on_odd_grad` let pass then has the same dtype, shape and layout now (the metadata check): it passes again."""
        if self.guard is None or param_states(opt) is not self.state or len(opt.param_groups) != len(self.groups): return None
        for g, (g0, _, cbs, _) in zip(opt.param_groups, self.groups):
            if g is not g0 or len(g['cbs']) != len(cbs) or not all(map(is_, g['cbs'], cbs)): return None
        try:
            ts = self._tensors(opt)
            if ts is None or not self.guard.check(*ts): return None
            state = param_states(opt)
            for b in self.buckets:  # the same state dicts (a load gives each param a new one)
                if not all(map(is_, map(state.__getitem__, b.params), b.states)): return None
            keys = [_bucket_key(k[0], b.params[0], b.states[0], k[5] is not None)
                    for k, b in ((self.keys[i], self.buckets[i]) for i in self.mergeable)]
            if len(set(keys)) != len(keys): return None  # Python values that made two buckets of a group are now equal
        except (KeyError, TypeError, RuntimeError): return None  # (a key gone, an unhashable value, a sparse grad)
        return self.buckets


def planned_buckets(opt, on_odd_grad: Callable | None = None) -> list[Bucket]:
    """`buckets(opt)`, from the optimizer's `BucketPlan` when it still holds (made again when not, calling
    `on_odd_grad(opt)` before anything is stepped if a grad is sparse or of another shape or dtype): the engine's
    per-step bucketing."""
    rt = runtime(opt)
    plan = rt.bucket_plan
    if plan is not None and (bs := plan.current(opt)) is not None: return bs
    rt.bucket_plan = plan = BucketPlan(opt, on_odd_grad)
    return plan.buckets


def stand_in(b: Bucket) -> TensorList:
    "The bucket as one param: a TensorList of its params whose `.grad` is the TensorList of their grads."
    p = TensorList(b.params)
    p.grad = TensorList([q.grad for q in b.params])
    return p


def bucket_state(b: Bucket) -> dict:
    "The bucket's state as callbacks see it: tensors as TensorLists, Python values (shared by the bucket) as they are."
    return {k: TensorList([s[k] for s in b.states]) if isinstance(v, torch.Tensor) else v for k, v in b.states[0].items()}


def write_state(b: Bucket, before: dict, after: dict, transient: frozenset = frozenset()) -> None:
    """Give each param its own tensor of every new TensorList state entry, and every param the new Python values;
    transient entries are dropped."""
    for k, v in after.items():
        if k in transient:
            for s in b.states: s.pop(k, None)
            continue
        if v is before.get(k): continue
        if isinstance(v, TensorList):
            for s, t in zip(b.states, v, strict=True): s[k] = t
        else:
            for s in b.states: s[k] = v


def cache_chunks(b: Bucket, chunk_bytes: int) -> list[Bucket]:
    """On CPU, `b` split into runs of params of about `chunk_bytes` (a larger param alone), so that the chain's next
    op finds the previous op's tensors still in cache instead of streaming the whole bucket from memory once per op;
    the same ops on the same tensors, so results do not change. Accelerators take the bucket whole (one launch)."""
    if b.params[0].device.type != 'cpu': return [b]
    chunks, start, size = [], 0, 0
    for i, p in enumerate(b.params):
        n = p.numel() * p.element_size()
        if i > start and size + n > chunk_bytes:
            chunks.append(Bucket(b.group, b.params[start:i], b.states[start:i]))
            start, size = i, 0
        size += n
    chunks.append(Bucket(b.group, b.params[start:], b.states[start:]))
    return chunks


def model_buckets(opt, groups: list) -> list[tuple[TensorList, list]]:
    """The params with a grad of `groups`, for a whole-model callback: one `TensorList` (with `.grad`) per (device,
    param dtype, grad dtype, and the grads' mesh and placements if they are DTensors), in the order the params are
    listed (torch's `clip_grad_norm_` groups its grads the same way), each with the params' own state dicts."""
    out: dict = {}
    for g in groups:
        for p in g['params']:
            if p.grad is None: continue
            ps, states = out.setdefault((p.device, p.dtype, p.grad.dtype, layout_key(p.grad)), ([], []))
            ps.append(p)
            states.append(param_states(opt)[p])
    res = []
    for ps, states in out.values():
        tl = TensorList(ps)
        tl.grad = TensorList([p.grad for p in ps])
        res.append((tl, states))
    return res


def _real(t: torch.Tensor) -> torch.Tensor:
    "A complex tensor as the real tensor of its (real, imaginary) pairs, a view: writes reach it (`torch.view_as_real`)."
    return torch.view_as_real(t.detach()) if t.is_complex() else t


@contextmanager
def as_real(b: Bucket) -> Iterator[Bucket]:
    """`b` with its complex params, grads and state viewed as real tensors of shape `(..., 2)`, as torch.optim steps
    complex params: every callback's math is then the real one, on the real and imaginary parts. In-place updates
    reach the complex tensors through the views; a new state tensor of a param's real shape is kept complex (as
    torch's state is), so checkpoints hold the params' own dtype. A bucket of real params is given as it is (its
    first param says: a bucket's params share a dtype)."""
    if not (b.params and b.params[0].is_complex()):
        yield b
        return
    params, states = [], []
    for p, st in zip(b.params, b.states):
        q = _real(p)
        if q is not p: give_grad(q, _real(p.grad))
        params.append(q)
        states.append({k: _real(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()})
    views = [dict(st) for st in states]
    yield Bucket(b.group, params, states)
    for p, q, st, real, before in zip(b.params, params, b.states, states, views):
        for k in [k for k in st if k not in real]: del st[k]  # (transient entries the runner dropped)
        for k, v in real.items():
            if k in before and v is before[k]: continue  # updated in place: the complex tensor already holds it
            complex_shaped = q is not p and isinstance(v, torch.Tensor) and v.shape == q.shape and v.dtype == q.dtype
            st[k] = torch.view_as_complex(v) if complex_shaped else v
