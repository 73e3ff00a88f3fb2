"""Buckets: the params with a grad, split into groups that one call of a chain can serve.

A bucket's params share their group (so their chain and hypers), device, dtype, flags, the keys of their tensor
state and the values of their Python state (a step count is one number for the whole call). A bucket's state is each
param's own `opt.state[p]` dict, viewed as `TensorList`s while the chain runs, so state_dicts are the same whatever
the backend, and a checkpoint saved under one resumes under any other.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ..chain import chain_scope, param_chain
from ..dtensor import layout_key
from ..tensorlist import TensorList

__all__ = ['Bucket', 'buckets', 'grad_is_odd', 'stand_in', 'bucket_state', 'write_state', 'cache_chunks', 'model_buckets',
           'as_real']


class Bucket(NamedTuple):
    "Params that one call of the chain can serve: same group, device, dtype, flags, Python state and state keys."
    group: dict
    params: list
    states: list  # each param's own `opt.state[p]` dict

    @property
    def cbs(self) -> list:
        "The group's per-param callbacks (its whole-model ones run once per step, around the buckets: see `engine`)."
        return param_chain(self.group['cbs'])

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


def buckets(opt, on_odd_grad: Callable | None = None) -> list[Bucket]:
    """The params of `opt` with a grad, grouped by (group, device, dtype, Python-valued state and flags, state keys;
    rank, for a chain that reduces over whole params; mesh and placements, for params sharded as DTensors).
    `on_odd_grad(opt)` is called, before anything is stepped, if a grad is sparse or of another shape or dtype."""
    out, state = {}, opt.state
    for gi, g in enumerate(opt.param_groups):
        by_rank = chain_scope(g['cbs']) == 'tensor'  # such a chain may keep state by rank (`chain.declared_for`)
        for p in g['params']:
            if p.grad is None: continue
            if on_odd_grad is not None and grad_is_odd(p): on_odd_grad(opt)
            st = state[p]
            key = (gi, p.device, p.dtype, layout_key(p), _state_key(st), p.ndim if by_rank else None)
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
            states.append(opt.state[p])
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
    torch's state is), so checkpoints hold the params' own dtype. A bucket of real params is given as it is."""
    if not any(p.is_complex() for p in b.params):
        yield b
        return
    params, states = [], []
    for p, st in zip(b.params, b.states):
        q = _real(p)
        if q is not p: q.grad = _real(p.grad)
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
