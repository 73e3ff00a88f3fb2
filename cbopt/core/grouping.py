"""Param groups chosen by a rule over a model's named params: timm's split of the params that weight decay should
not touch (biases, norms, listed names), kept named so that cbopt's state stays keyed by FQN."""
from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ['param_groups_weight_decay']


def param_groups_weight_decay(model: nn.Module, weight_decay: float = 1e-5,
                              no_weight_decay_list: Iterable[str] = ()) -> list[dict]:
    """timm's `param_groups_weight_decay`: a group without decay (`weight_decay=0.`) of the params with `ndim <= 1`
    (norms' weights, biases), the names ending in `.bias` and those in `no_weight_decay_list` (exact FQNs, as a model's
    `no_weight_decay()` gives them), then a group with `weight_decay` of the rest; frozen params (`requires_grad=False`)
    are left out, as in timm. Unlike timm's, each group's `params` are `(name, param)` pairs, so an optimizer built from
    them keys its state and checkpoints by FQN. Decay shrinks params towards 0, which is the wrong prior for a norm's
    scale or a bias: that is why they are kept out.

    ```python
    import torch, cbopt
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = cbopt.param_groups_weight_decay(model, weight_decay=0.05)
    assert [[n for n, _ in g['params']] for g in groups] == [['0.bias', '1.weight', '1.bias'], ['0.weight']]
    opt = cbopt.DecoupledAdamW(groups)
    assert [g['wd'] for g in opt.param_groups] == [0., 0.05]
    ```
    """
    skip = set(no_weight_decay_list)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad: continue
        (no_decay if p.ndim <= 1 or name.endswith('.bias') or name in skip else decay).append((name, p))
    return [{'params': no_decay, 'weight_decay': 0.}, {'params': decay, 'weight_decay': weight_decay}]
