"""Composer's weight decay, decoupled from the size of the learning rate (MosaicML Composer's `DecoupledSGDW` and
`DecoupledAdamW`, listed into optimizers in `cbopt.recipes.composer`).

torch's AdamW shrinks a param by `lr * wd` per step, so its best `wd` moves whenever `lr` does. Composer's decay is
`wd * lr / initial_lr`, where `initial_lr` is the group's lr when it joined the optimizer: the decay follows the
schedule's shape (warmup, cosine) but not its size, so `wd` is the fraction a param shrinks by per step at the peak.
"""
from __future__ import annotations

import torch

from .fastai import decays

__all__ = ['lr_ratio', 'fully_decoupled_wd']


def lr_ratio(lr, initial_lr):
    """`lr / initial_lr`, the share of its first lr a group steps with now; 1 where `initial_lr` is 0 (Composer's rule:
    a group built with lr=0 decays by the whole `wd`). A tensor `initial_lr` is tested with `torch.where`, never a
    Python `if`, so compiled chains do not branch on a tensor's value."""
    if isinstance(initial_lr, torch.Tensor): return torch.where(initial_lr != 0, lr / initial_lr, torch.ones_like(initial_lr))
    return lr / initial_lr if initial_lr else 1.


def fully_decoupled_wd(p, lr, initial_lr, wd, do_wd=True, **kwargs):
    """Composer's decay: shrink `p` by `wd * lr / initial_lr` (not by `lr * wd`, as `weight_decay`), before the step.
    So `DecoupledAdamW(weight_decay=w)` is torch's `AdamW(weight_decay=w / initial_lr)`. `initial_lr` is a group hyper
    that every group gets when it joins the optimizer, as a copy of its lr then (`group_hypers`); an LR scheduler
    built later keeps it (torch's schedulers only set it where it is missing)."""
    if decays(wd, do_wd): p.data.mul_(1 - lr_ratio(lr, initial_lr) * wd)
fully_decoupled_wd.defaults = dict(wd=0.)
fully_decoupled_wd.state = {}
fully_decoupled_wd.group_hypers = dict(initial_lr='lr')  # a group's initial_lr: its lr when it joins the optimizer
