"""Saving: an optimizer's state as a snapshot keyed by param names (`named_state_dict`, torchrec's KeyedOptimizer
layout) or by integer ids in torch's layout (`torch_state_dict`, what DCP, ZeRO and other torch tools read). Both
hold only tensors, numbers, strings, lists and dicts, so `torch.load(..., weights_only=True)` reads them, and
`chain` names the callbacks each group ran, so another algorithm's checkpoint is refused on load."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core.chain import chain_counters, chain_name
from ..core.hypers import Hypers, _plain, model_entries
from ..core.dtensor import is_dtensor
from ..core.runtime import param_states
from .lowbit import dequantized_state, group_settings, whole_parts

if TYPE_CHECKING: from ..optimizer import Optimizer

__all__ = ['named_state_dict', 'torch_state_dict']


def named_state_dict(opt: Optimizer, dequantize: bool = False) -> dict:
    """The optimizer's state keyed by FQN, and its groups' hypers with the FQNs of their params. A snapshot: its
    tensors are copies, so a checkpoint kept in memory does not change as training goes on (torch's aliases the live
    state tensors, while cbopt's step counts are Python numbers: aliasing would mix a later step's moments with an
    earlier step's count). The copies of state on an accelerator (CUDA) are made in host memory (`_snapshot`): a
    dict kept while training holds no second copy of the state on the GPU (Adam's is twice the model's size), and
    `torch.save` writes host memory anyway; every load puts the state back on its params' device. Low-bit state
    (`cbopt.state.lowbit`) is saved as it is stored, with each group's `state_precision` (a param sharded by FSDP2: as
    one process stores the whole tensor, gathered: `lowbit.whole_parts`, a collective); `dequantize`: as fp32
    tensors, and the groups say 'fp32'."""
    state = {}
    for g in opt.param_groups:
        counters = chain_counters(g['cbs'])  # (0-d tensors after a step traced by torch.compile: saved as numbers)
        for name, p in zip(g['param_names'], g['params']):
            if s := param_states(opt).get(p):
                s = dequantized_state(s, p, g) if dequantize else whole_parts(s, p, g)  # (a shard's: as one process's)
                state[name] = {k: _snapshot(v, counters.get(k)) for k, v in s.items()}
    groups = [{**{k: _plain(v) for k, v in Hypers(g).items()}, **{k: _copied(_plain(v), host=True) for k, v in model_entries(g).items()},
               **group_settings(g), **({'state_precision': 'fp32'} if dequantize and 'state_precision' in g else {}),
               'chain': chain_name(g['cbs']), 'params': list(g['param_names'])} for g in opt.param_groups]
    return {'state': state, 'param_groups': groups}


def _snapshot(v: Any, counter: type | None = None) -> Any:
    "A state value as a checkpoint holds it: a tensor copied, a counter (`chain_counters`: its type) as a Python number."
    if isinstance(v, torch.Tensor): return counter(v.item()) if counter is not None else _host_copy(v)
    return _plain(v)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` for a checkpoint: in host memory where `t` is on an accelerator (no second copy of the state on
    the GPU while the dict lives), where it is otherwise (CPU; 'meta', which has no data to copy; a DTensor, whose
    shards DCP reads where they are)."""
    t = t.detach()
    if t.device.type in ('cpu', 'meta') or is_dtensor(t): return t.clone()
    return t.to('cpu')  # (a new tensor: never the live state)


def _copied(v: Any, host: bool = False) -> Any:
    """`v` with its tensors copied, in lists too (whole-model state such as LBFGS's history): a snapshot, not an alias;
    with `host`, copied to host memory as `_host_copy` does (a checkpoint's)."""
    if isinstance(v, torch.Tensor): return _host_copy(v) if host else v.detach().clone()
    if isinstance(v, (list, tuple)): return type(v)(_copied(o, host) for o in v)
    return v


def torch_state_dict(opt: Optimizer, dequantize: bool = False) -> dict:
    """`named_state_dict` in torch's layout: params as integer ids in `param_groups` order, each group listing its
    `param_names` (what torch.optim saves for named params, and what DCP, ZeRO and other torch tools expect)."""
    named = named_state_dict(opt, dequantize)
    ids: dict = {}  # a param listed again (torch's test: a group list extended by itself) keeps its first id, as torch's
    for i, n in enumerate(opt.param_names): ids.setdefault(n, i)
    groups = [{**{k: v for k, v in g.items() if k != 'params'}, 'param_names': g['params'],
               'params': [ids[n] for n in g['params']]} for g in named['param_groups']]
    return {'state': {ids[n]: s for n, s in named['state'].items()}, 'param_groups': groups}
