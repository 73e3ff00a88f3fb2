"""Wrappers, fastai's `Lookahead(opt)` style: each returns one new `cbopt.Optimizer` (a `torch.optim.Optimizer`, so
schedulers and fastai keep working) whose groups run `[model_cb, *their chain]`, with the wrapped optimizer's params,
names, hypers, backend, state and whole-model state carried over.

torchrec's `GradientClippingOptimizer` and `WarmupOptimizer` keep torchrec's names, signatures and numbers; where
torchrec is awkward these do better: the warmup counter is whole-model state (saved with the groups: it loads into a
fresh wrapper with no `init_state()` step), `lr=None` keeps each group's own lr as its base (torchrec writes one lr
into every group), INVSQRT as a first stage is a clear error (`WarmupSchedule`), and each group's `lr` stays the base
lr, the warmup multiplying it for the step (so a torch scheduler or fastai's schedules compose with it: the lr used is
`base * multiplier`, in `opt.step_stats['lr']`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from ..core.chain import cb_name
from ..callbacks.schedules import GradientClipping, WarmupSchedule, WarmupStage, warmup
from ..callbacks.whole_model import accumulate_grads, clip_grad_norm, clip_grad_value, grad_norm, skip_nonfinite
from ..optimizer import Optimizer, rechain

__all__ = ['wrap', 'GradientClippingOptimizer', 'WarmupOptimizer', 'SkipNonFinite', 'Accumulate']


def wrap(opt: Optimizer, *cbs: Callable, **hypers) -> Optimizer:
    "`opt` with the whole-model callbacks `cbs` first in every group's chain (their `hypers` set in every group)."
    if not isinstance(opt, Optimizer): raise TypeError(f"expected a cbopt.Optimizer, got {type(opt).__name__}")
    if getattr(opt, 'in_backward', False):  # its hooks step each param alone, before any whole-model callback could run
        raise TypeError(f"the whole-model callback {cb_name(cbs[0])!r} needs every grad at once, but this optimizer steps in "
                        "backward (cbopt.InBackward), each param alone: step it after backward instead")
    return rechain(opt, lambda chain: [*cbs, *chain], **hypers)


def GradientClippingOptimizer(optimizer: Optimizer, clipping: GradientClipping = GradientClipping.NONE,
                              max_gradient: float = 0.1, norm_type: float | str = 2.0,
                              enable_global_grad_clip: bool = False, param_to_pgs: dict | None = None,
                              track_grad_norm: bool = False, in_place: bool = False) -> Optimizer:
    """torchrec's gradient clipping: NORM scales all grads by `min(1, max_gradient / (total_norm + 1e-6))`, VALUE
    clamps them to `[-max_gradient, max_gradient]`, NONE steps as `optimizer`. The pre-clip norm is
    `opt.last_total_grad_norm` (and `opt.step_stats['grad_norm']`): with NORM always, with VALUE and NONE when
    `track_grad_norm` (torchrec's flag: computing it costs a pass over the grads). `in_place=True` leaves the clipped
    grads in `p.grad`, as torchrec's wrapper and torch's clip functions do (and costs no pass of its own under torch's
    fused kernel); the default leaves the user's grads as they were (cbopt's grad contract). Sharded global clipping
    (`enable_global_grad_clip`, `param_to_pgs`) is not supported."""
    if enable_global_grad_clip or param_to_pgs:
        raise NotImplementedError("cbopt's GradientClippingOptimizer clips over the local params only: "
                                  "enable_global_grad_clip / param_to_pgs are not supported")
    clipping = GradientClipping(clipping)
    if not isinstance(in_place, bool): raise TypeError(f"in_place must be True or False, got {in_place!r}")
    if clipping is GradientClipping.NORM:
        return wrap(optimizer, clip_grad_norm, max_norm=max_gradient, norm_type=float(norm_type), in_place=in_place)
    track = dict(norm_type=float(norm_type)) if track_grad_norm else {}
    if clipping is GradientClipping.VALUE:
        return wrap(optimizer, *([grad_norm] if track else []), clip_grad_value, clip_value=max_gradient,
                    in_place=in_place, **track)
    return wrap(optimizer, grad_norm, **track) if track else wrap(optimizer, _no_clip)


def _no_clip(params, **kwargs):
    "torchrec's GradientClipping.NONE: nothing (kept in the chain, so a checkpoint names the wrapper)."
_no_clip.scope = 'model'
_no_clip.state = {}


def WarmupOptimizer(optimizer: Optimizer, stages: Sequence[WarmupStage], lr: float | None = 0.1,
                    lr_param: str = 'lr') -> Optimizer:
    """torchrec's warmup: the k-th step (from 0) runs with `base_lr * multiplier(k)` of the `stages` (torchrec's
    policies and stage switching, see `cbopt.warmup`). `lr` (torchrec's default 0.1) is written into every group as
    its base; `lr=None` keeps each group's own lr as its base, so discriminative lrs keep their ratios. The group's
    `lr` stays the base: a scheduler or fastai changing it scales the warmed-up lr."""
    schedule = WarmupSchedule(stages)
    res = wrap(optimizer, partial(warmup, schedule=schedule, lr_param=lr_param))
    if lr is not None: res.set_hyper(lr_param, lr)
    return res


def SkipNonFinite(opt: Optimizer, max_consecutive: int | None = None) -> Optimizer:
    """`opt` skipping every step with an inf or NaN grad (nothing changes but the skip counts); more than
    `max_consecutive` skips in a row raise. Wrap it last (outermost) so it sees the grads before anything else."""
    if max_consecutive is not None and (not isinstance(max_consecutive, int) or max_consecutive < 0):
        raise ValueError(f"max_consecutive must be None or an int >= 0, got {max_consecutive!r}")
    return wrap(opt, skip_nonfinite, max_consecutive=max_consecutive)


def Accumulate(opt: Optimizer, every: int) -> Optimizer:
    "`opt` stepping once every `every` calls, with the mean of their grads (optax's MultiSteps)."
    return wrap(opt, accumulate_grads, every=every)
