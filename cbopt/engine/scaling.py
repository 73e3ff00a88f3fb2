"""Grad scaling outside torch's kernels: GradScaler's unscale (`unscale_grads`) and the scale a whole-model callback
(`clip_grad_norm`) hands the per-param step (`scale_grads`), out of place unless asked."""
from __future__ import annotations

import torch

from .._torch import foreach_op

__all__ = ['scale_grads', 'unscale_grads', 'pay_scales']


def scale_grads(params: list, scale, in_place: bool = False) -> None:
    """Give `params` their grads times `scale`: out of place (`run_step` gives each param its own grad back), or,
    `in_place` (`clip_grad_norm(in_place=True)`), written into the grads, as `clip_grad_norm_(foreach=True)` does."""
    by_device: dict = {}
    for p in params: by_device.setdefault(p.grad.device, []).append(p)
    for device, ps in by_device.items():
        if in_place: foreach_op('mul_')([p.grad for p in ps], scale.to(device))
        else:
            for p, g in zip(ps, foreach_op('mul')([p.grad for p in ps], scale.to(device))): p.grad = g


def unscale_grads(params: list, loss_scale: torch.Tensor) -> None:
    """Divide `params`' grads by GradScaler's `loss_scale` in place, as `scaler.unscale_` does (times the float32
    reciprocal of the scale, so the same numbers): what a step honouring GradScaler does where no fused kernel folds
    the division into its pass. GradScaler leaves unscaled grads, with torch's fused optimizers and the others alike."""
    inv = loss_scale.double().reciprocal().float()
    by_device: dict = {}
    for p in params: by_device.setdefault(p.grad.device, []).append(p.grad)
    for device, grads in by_device.items(): foreach_op('mul_')(grads, inv.to(device))


def pay_scales(opt, scales: dict) -> None:
    "Apply the grad scales groups still owe (a whole-model callback reads the grads next), and forget them."
    for g in opt.param_groups:
        if id(g) in scales: scale_grads([p for p in g['params'] if p.grad is not None], *scales[id(g)])
    scales.clear()
