"""The `loop` runner (each callback once per param: fastai's way, and the reference) and the `foreach` runner (each
callback once per bucket, on `TensorList` stand-ins whose ops are `torch._foreach_*` kernels).

A callback that cannot run on a whole bucket (Python `if` on a tensor value: `TensorList` raises `BucketError`) is
found by `probe` on a copy before the bucket is touched, and that bucket then runs param by param, with a one-time
warning naming the callback. Any other error a callback raises on the copy is a real bug: it is raised as it is,
before any param changed. A chain of cbopt's own callbacks (`chain.is_cbopts`, declared) is not probed: they run
bucket-wise by construction, and a probe per bucket per step doubled the Python cost of a step with one param per
group.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..core.chain import cb_name, check_returns, is_cbopts, is_declared, run_chain, transient_keys
from ..core.dtensor import refusing_partial_numbers
from ..core.tensorlist import BucketError, TensorList
from .buckets import Bucket, bucket_state, cache_chunks, give_grad, stand_in, write_state
from ..core.runtime import runtime, warn_once

__all__ = ['run_param', 'loop_bucket', 'dry_copy', 'probe', 'foreach_bucket', 'check_once']


def run_param(cbs, p, state: dict, hyper: Mapping, transient: frozenset) -> None:
    "The chain on one param; its transient state is dropped after."
    run_chain(cbs, p, state, hyper)
    for k in transient: state.pop(k, None)


def loop_bucket(opt, b: Bucket, hyper: Mapping) -> None:
    "The reference: the chain once per param of `b`."
    cbs, transient = b.cbs, b.kept('transient', lambda: transient_keys(b.cbs))  # (spec per callback: once per plan)
    with refusing_partial_numbers(cbs, b.params[0]):
        check_once(opt, b, hyper)
        for p, st in zip(b.params, b.states): run_param(cbs, p, st, hyper, transient)


def dry_copy(p: torch.Tensor, state: Mapping, as_bucket: bool = False) -> tuple:
    """A copy of `p`, its grad and its state, for running a chain on without touching anything real (the probes):
    a param of its own, or a bucket of one (TensorLists). Python values are shared, as the bucket shares them."""
    wrap = (lambda t: TensorList([t])) if as_bucket else (lambda t: t)
    q = wrap(p.detach().clone())
    grad = wrap(p.grad.detach().clone())
    if as_bucket: q.grad = grad  # (a TensorList holds any grads)
    else: give_grad(q, grad)
    return q, {k: wrap(v.clone()) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _dry_run(cbs, p, state: dict, hyper: Mapping, as_bucket: bool) -> Callable | None:
    """Run the chain on a copy, recording which callbacks return which state entries. Returns the first callback
    that cannot run bucket-wise (`as_bucket`), or None; raises a callback's real errors as they are."""
    creators: dict = {}
    for cb in cbs:
        try: new = cb(p, **{**state, **hyper})
        except BucketError:
            if as_bucket: return cb
            raise
        if isinstance(new, dict):
            for k, v in new.items():
                if as_bucket and isinstance(v, torch.Tensor) and not isinstance(v, TensorList): return cb
                creators.setdefault(k, []).append(cb)
            state.update(new)
    check_returns(creators)
    return None


def check_once(opt, b: Bucket, hyper: Mapping) -> None:
    """Once per chain: an undeclared chain runs on a copy of one param, so that two callbacks returning one state
    entry (which would update one buffer twice) are refused before anything changes. Declared chains were checked
    when the optimizer was built."""
    rt = runtime(opt)
    if id(b.group) in rt.checked: return
    if not is_declared(b.cbs): _dry_run(b.cbs, *dry_copy(b.params[0], b.states[0]), hyper, as_bucket=False)
    rt.checked.add(id(b.group))


def probe(cbs, b: Bucket, hyper: Mapping) -> Callable | None:
    """The first callback of the chain that cannot run bucket-wise, found by running the chain on a bucket of one:
    a copy of the bucket's smallest param, grad and state (so nothing real is touched). Control flow in callbacks may
    only depend on hypers and Python state, which the copy shares with the bucket, so what fails here would fail on
    the bucket, and a bucket is only ever stepped whole: never left half-updated by a callback that fails midway."""
    i = min(range(len(b.params)), key=lambda j: b.params[j].numel())
    return _dry_run(cbs, *dry_copy(b.params[i], b.states[i], as_bucket=True), hyper, as_bucket=True)


def foreach_bucket(opt, b: Bucket, hyper: Mapping) -> bool:
    """Run the chain once on bucket `b`, or per param (with a one-time warning) if a callback cannot run bucket-wise.
    Returns whether it ran bucket-wise. On DTensors, a chain reading a Python number of a partial one is refused
    (`cbopt.dtensor.refusing_partial_numbers`) by the probe, before any param changed."""
    with refusing_partial_numbers(b.cbs, b.params[0]): return _foreach_bucket(opt, b, hyper)


def _foreach_bucket(opt, b: Bucket, hyper: Mapping) -> bool:
    rt = runtime(opt)
    if b.layout in rt.per_param:  # failed its probe before: the loop is always right, so don't probe every step again
        loop_bucket(opt, b, hyper)
        return False
    cbs = b.cbs
    own = b.kept('own', lambda: is_declared(cbs) and all(map(is_cbopts, cbs)))
    bad = None if own else probe(cbs, b, hyper)
    rt.checked.add(id(b.group))
    if bad is not None:
        rt.per_param.add(b.layout)
        name = cb_name(bad)
        warn_once(opt, ('fallback', name), f"callback {name!r} cannot run on a whole bucket of params (e.g. Python "
                  "control flow on a tensor value); its buckets run param by param")
        loop_bucket(opt, b, hyper)
        return False
    transient = b.kept('transient', lambda: transient_keys(cbs))
    size = opt.backend_options.cpu_chunk_bytes
    for chunk in b.kept(('chunks', size), lambda: cache_chunks(b, size)):
        p, state = stand_in(chunk), bucket_state(chunk)
        before = dict(state)
        run_chain(cbs, p, state, hyper)
        write_state(chunk, before, state, transient)
    return True
