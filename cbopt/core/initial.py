"""The state a chain keeps for a param before its first step: declared by its callbacks, or found by a dry run on a
copy for a fastai-style (undeclared) chain. Read by the engine (new params, whole-model callbacks) and by loads."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .chain import init_chain_state, is_declared, param_chain, run_chain, transient_keys
from .flags import split_flags
from .hypers import Hypers
from .runtime import param_states

if TYPE_CHECKING: from ..optimizer import Optimizer

__all__ = ['initial_state', 'chain_initial_state']


def initial_state(opt: Optimizer, p: torch.Tensor, group: Mapping, template: bool = False) -> dict:
    """The state `group`'s chain keeps for `p` before its first step (see `chain_initial_state`), with `p`'s flags."""
    return chain_initial_state(group['cbs'], p, Hypers(group), split_flags(param_states(opt).get(p, {}))[1], template)


def chain_initial_state(cbs: list, p: Any, hyper: Mapping, flags: Mapping | None = None, template: bool = False) -> dict:
    """The state a chain keeps for `p` (a param or a stand-in): as declared by its callbacks (the values before a
    first step; with `template`, also the entries a first step creates, `chain.at_first_step`, as their templates:
    every entry a checkpoint holds), or, for a chain with an undeclared (fastai-style) callback, what a first step
    with a zero grad creates, computed on a copy of `p` (a template too)."""
    if is_declared(cbs): return init_chain_state(cbs, p, template)
    model = init_chain_state([cb for cb in cbs if cb not in param_chain(cbs)], p)  # whole-model callbacks declare theirs
    cbs = param_chain(cbs)
    with torch.no_grad():
        q = p.detach().clone()
        q.grad = torch.zeros_like(q)
        st = dict(flags or {})
        run_chain(cbs, q, st, hyper)
    return {**{k: v for k, v in split_flags(st)[0].items() if k not in transient_keys(cbs)}, **model}
