"""Whole-model callbacks: run once per step over every param with a grad, before (or after) the per-param chain.

A whole-model callback `cb(params, groups, **{**param_state, **model_state, **hypers}) -> dict | None` gets the params
with a grad as a list of `TensorList`s (one per device and dtype, each with `.grad`), so it reduces with foreach kernels
(`torch.linalg.vector_norm(tl)` is one `torch._foreach_norm`) and one `torch.stack`, never a Python loop over params.
A callback changing the grads the rest of the step sees rebinds `tl.grad` out of place (`tl.grad = tl.grad * coef`),
never writing into it: the engine hands the new grads to the params for the step, then gives each param its own grad
back (the grad contract: a step leaves the user's `p.grad` as it was). The clips break it only when asked
(`in_place=True`: the clipped grads are left in `p.grad`, as torch's clip functions leave them). It declares `scope = 'model'`, its hypers (`defaults`), its own state (`state`: numbers, kept in the group entries as
`'<name>.<key>'`), per-param buffers (`param_state`) and what it returns for one step only (`transient`). Returning
`skip=True` ends the step with nothing else changed; `hypers=[...]` sets its groups' hypers for this step. See
`cbopt.chain` and `cbopt.engine` for the contract, `cbopt.wrappers` for torchrec's and fastai-style wrappers.
"""
from __future__ import annotations

import math

import torch

from .._torch import device_dtype_groups, foreach_op
from ..core.chain import zeros
from ..core.dtensor import across_shards, any_across_shards, global_value, layout_key, local

__all__ = ['grad_norm', 'clip_grad_norm', 'clip_by_global_norm', 'clip_grad_value', 'skip_nonfinite', 'accumulate_grads']


def _torch_order(params: list) -> list:
    """The buckets in the order torch's `clip_grad_norm_` stacks its (device, dtype) groups (not the order they come
    in): the sum of the norms is then the same, bit for bit."""
    if len(params) < 2: return params
    group = device_dtype_groups()
    if group is None: return params
    keys = list(group([[tl.grad[0] for tl in params]]))
    rank = {k: i for i, k in enumerate(keys)}
    return sorted(params, key=lambda tl: rank.get((tl.grad[0].device, tl.grad[0].dtype), len(rank)))


def total_grad_norm(params: list, norm_type: float) -> torch.Tensor:
    """The norm of all grads as one vector, as `torch.nn.utils.clip_grad_norm_` computes it: one foreach norm per
    bucket, then the norm of their stack (so the same numbers, bit for bit).

    Across ranks (FSDP2's DTensor grads), torchrec's rule: a sharded grad's norm is reduced over the ranks holding its
    shards (DTensor's own reduction of a partial norm, as `clip_grad_norm_` gets it), a replicated one (a plain
    tensor, or a `Replicate` DTensor) counts once. Grads of each layout (plain, or a DTensor mesh and placements) are
    reduced apart, then combined; the result is a plain tensor, the same on every rank."""
    if not params: return torch.tensor(0.0)
    first = params[0][0].device  # each bucket's norms stacked, then moved, at once: no Python step per param
    by_layout: dict = {}
    for tl in _torch_order(params):
        key = layout_key(tl.grad[0])
        if key is not None and norm_type == math.inf: norms = _max_abs_across_shards(tl).to(first)[None]
        else: norms = torch.stack(torch.linalg.vector_norm(tl.grad, norm_type)).to(first)
        by_layout.setdefault(key, []).append(norms)
    totals = [global_value(torch.linalg.vector_norm(torch.cat(ns) if len(ns) > 1 else ns[0], norm_type))
              for ns in by_layout.values()]
    return totals[0] if len(totals) == 1 else torch.linalg.vector_norm(torch.stack(totals), norm_type)


def _max_abs_across_shards(tl) -> torch.Tensor:
    """The inf norm of the sharded grads of bucket `tl` across ranks: a rank's shard of a small param may be empty,
    where torch's inf norm has no value, so each rank reduces its non-empty shards (0 if none), then one all-reduce."""
    shards = [g for g in map(local, tl.grad) if g.numel()]
    own = torch.stack(foreach_op('norm')(shards, math.inf)).amax() if shards else \
        torch.zeros((), dtype=tl.grad[0].dtype, device=tl.grad[0].device)
    return across_shards(own, tl.grad[0], 'max')


def clip_grad_norm(params, max_norm, norm_type=2.0, in_place=False, **kwargs):
    """Scale all grads by `min(1, max_norm / (total_norm + 1e-6))` (torch's `clip_grad_norm_`, and torchrec's NORM);
    the pre-clip `grad_norm` is reported (`opt.step_stats['grad_norm']`, `opt.last_total_grad_norm`).

    `in_place=False` (the grad contract): the step sees the clipped grads, the user's `p.grad` stays as it was.
    `in_place=True` (torch's and torchrec's behaviour): the grads themselves are clipped, as `clip_grad_norm_` leaves
    them, in the step's own pass where torch's fused kernel steps (its `grad_scale` divisor, `1 / coefficient`, which
    it stores back into the grads), by one in-place multiply before the chain otherwise. The engine applies the
    coefficient when the step runs (or before a later whole-model callback reads the grads), so a step skipped
    before that leaves the grads as they were."""
    total = total_grad_norm(params, float(norm_type))
    if not params: return {'grad_norm': total}
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {'grad_norm': total, 'grad_scale': coef, 'grad_scale_in_place': bool(in_place)}
clip_grad_norm.scope = 'model'
clip_grad_norm.defaults = dict(max_norm=1.0, norm_type=2.0, in_place=False)  # fastai's GradientClip defaults
clip_grad_norm.state = {}
clip_grad_norm.transient = ('grad_norm',)


def clip_by_global_norm(params, max_norm, in_place=False, **kwargs):
    """optax's `clip_by_global_norm`: grads whose total 2-norm `g` reaches `max_norm` are scaled by `max_norm / g`,
    with no epsilon (torch's `clip_grad_norm` adds 1e-6 to `g`, so its clipped norm falls just short of `max_norm`);
    the others are left as they are. `in_place` and `grad_norm` as `clip_grad_norm`'s."""
    total = total_grad_norm(params, 2.0)
    if not params: return {'grad_norm': total}
    coef = torch.where(total < max_norm, torch.ones_like(total), max_norm / total)
    return {'grad_norm': total, 'grad_scale': coef, 'grad_scale_in_place': bool(in_place)}
clip_by_global_norm.scope = 'model'
clip_by_global_norm.defaults = dict(max_norm=1.0, in_place=False)
clip_by_global_norm.state = {}
clip_by_global_norm.transient = ('grad_norm',)


def grad_norm(params, norm_type=2.0, **kwargs):
    """Report the total grad norm, changing nothing (torchrec's `track_grad_norm` with VALUE or NONE clipping): it is
    `opt.step_stats['grad_norm']` and `opt.last_total_grad_norm`, as `clip_grad_norm`'s pre-clip norm is."""
    return {'grad_norm': total_grad_norm(params, float(norm_type))}
grad_norm.scope = 'model'
grad_norm.defaults = dict(norm_type=2.0)
grad_norm.state = {}
grad_norm.transient = ('grad_norm',)


def clip_grad_value(params, clip_value, in_place=False, **kwargs):
    """Clamp every grad element to `[-clip_value, clip_value]` (torch's `clip_grad_value_`, torchrec's VALUE): out of
    place by default (the user's `p.grad` stays as it was), or, `in_place=True`, into the grads the step sees (the
    user's, as `clip_grad_value_` leaves them, unless an earlier whole-model callback replaced them for the step)."""
    for tl in params:
        if in_place: tl.grad.clamp_(-clip_value, clip_value)  # torch's foreach clamp_min_ then clamp_max_
        else: tl.grad = tl.grad.clamp(-clip_value, clip_value)
clip_grad_value.scope = 'model'
clip_grad_value.defaults = dict(clip_value=1.0, in_place=False)
clip_grad_value.state = {}


def _any_nonfinite(tl) -> bool:
    """Whether a grad of the bucket `tl` holds an inf or NaN, on any rank: each rank tests its shards (the max |g|
    of each, inf or NaN if any element is), then one all-reduce for sharded grads, so every rank skips alike."""
    shards = [g for g in map(local, tl.grad) if g.numel()]  # (a rank's shard of a small param may be empty)
    bad = torch.zeros((), dtype=torch.bool, device=tl.grad[0].device)
    if shards: bad = ~torch.isfinite(torch.stack(foreach_op('norm')(shards, math.inf))).all()
    return bool(any_across_shards(bad, tl.grad[0]))


def skip_nonfinite(params, max_consecutive=None, skipped_total=0, skipped_consecutive=0, **kwargs):
    """Skip a step whose grads hold an inf or NaN: no param and no state changes, but these counts. More than
    `max_consecutive` skips in a row (None: no limit) raise instead: training has diverged."""
    finite = not any([_any_nonfinite(tl) for tl in params])  # (every bucket, so every rank makes the same collectives)
    if finite: return {'skipped_consecutive': 0}
    if max_consecutive is not None and skipped_consecutive >= max_consecutive:
        raise FloatingPointError(f"skip_nonfinite: the grads held an inf or NaN at {skipped_consecutive + 1} steps in a "
                                 f"row, more than max_consecutive={max_consecutive}: training has diverged (lower the "
                                 f"lr, clip the grads, or check the loss)")
    return {'skip': True, 'skipped_total': skipped_total + 1, 'skipped_consecutive': skipped_consecutive + 1}
skip_nonfinite.scope = 'model'
skip_nonfinite.defaults = dict(max_consecutive=None)
skip_nonfinite.state = dict(skipped_total=0, skipped_consecutive=0)


def accumulate_grads(params, every, grad_sum, micro_step=0, **kwargs):
    """Step once every `every` calls, with the mean of their grads (optax's MultiSteps): the other calls add the grads
    to a per-param sum and skip; the last one replaces each grad by `(sum + grad) / every` and resets the sum."""
    n = micro_step + 1
    if n < every:
        for tl, s in zip(params, grad_sum): s.add_(tl.grad)
        return {'skip': True, 'micro_step': n}
    if every > 1:
        for tl, s in zip(params, grad_sum):
            tl.grad = tl.grad.add(s).div_(every)  # a new buffer (the user's grads stay as they are), then in place on it
            s.zero_()
    return {'micro_step': 0}
accumulate_grads.scope = 'model'
accumulate_grads.defaults = dict(every=1)
accumulate_grads.state = dict(micro_step=0)
accumulate_grads.param_state = dict(grad_sum=zeros)
accumulate_grads.state_kinds = dict(grad_sum='exact')


# -- pure forms, for `cbopt.functional` -------------------------------------------------------------------------------
# `pure(grads, **{**param_state, **state, **hypers}) -> dict`: the callback over a list of grads (one per param with a
# grad), its per-param state as lists aligned with them, its own state as 0-d tensors. It returns its new state and
# per-param state, `grads` where it changes them, and `skip` (a 0-d bool tensor) where it may skip the step: data, not
# control flow, so the update composes with vmap, grad and torch.compile. The same numbers as the callback.
def _total_norm(grads: list, norm_type: float) -> torch.Tensor:
    "The norm of all grads as one vector, as `total_grad_norm` computes it (the norm of the per-grad norms)."
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)


def _pure_clip_grad_norm(grads, max_norm, norm_type=2.0, **kwargs) -> dict:
    coef = torch.clamp(max_norm / (_total_norm(grads, float(norm_type)) + 1e-6), max=1.0)
    return {'grads': [g * coef for g in grads]}


def _pure_clip_by_global_norm(grads, max_norm, **kwargs) -> dict:
    total = _total_norm(grads, 2.0)
    coef = torch.where(total < max_norm, torch.ones_like(total), max_norm / total)
    return {'grads': [g * coef for g in grads]}


def _pure_clip_grad_value(grads, clip_value, **kwargs) -> dict:
    return {'grads': [g.clamp(-clip_value, clip_value) for g in grads]}


def _pure_skip_nonfinite(grads, skipped_total, skipped_consecutive, max_consecutive=None, **kwargs) -> dict:
    if max_consecutive is not None:
        raise ValueError("skip_nonfinite with max_consecutive raises once training diverges, which a pure update cannot "
                         "(under vmap or torch.compile): set max_consecutive=None and read "
                         "state['skip_nonfinite']['skipped_consecutive'] instead")
    bad = ~torch.stack([torch.isfinite(g).all() for g in grads]).all()
    return {'skip': bad, 'skipped_total': skipped_total + bad.to(skipped_total.dtype),
            'skipped_consecutive': torch.where(bad, skipped_consecutive + 1, torch.zeros_like(skipped_consecutive))}


def _pure_accumulate_grads(grads, grad_sum, every, micro_step, **kwargs) -> dict:
    emit = micro_step + 1 >= every
    return {'skip': ~emit, 'micro_step': torch.where(emit, torch.zeros_like(micro_step), micro_step + 1),
            'grads': [g.add(s).div(every) for g, s in zip(grads, grad_sum)],
            'grad_sum': [torch.where(emit, torch.zeros_like(s), s + g) for g, s in zip(grads, grad_sum)]}


def _pure_grad_norm(grads, **kwargs) -> dict: return {}


PURE = {clip_grad_norm: _pure_clip_grad_norm, clip_by_global_norm: _pure_clip_by_global_norm,
        clip_grad_value: _pure_clip_grad_value, skip_nonfinite: _pure_skip_nonfinite,
        accumulate_grads: _pure_accumulate_grads, grad_norm: _pure_grad_norm}
"""The pure form of each whole-model callback that has one (see above), by callback: what `cbopt.functional` runs."""
