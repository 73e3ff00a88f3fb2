"""Export in a torch.optim class's own format (`opt.state_dict(format=torch.optim.AdamW)`): torch's state and group
names, its flags, and a clear refusal of whatever that class cannot hold."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..core.chain import chain_counters, chain_defaults, chain_name, chain_reads, param_chain
from ..core.flags import split_flags
from ..core.hypers import NOT_HYPERS, TorchParamGroup, _plain, is_framework_key, is_model_entry
from ..core.spec import spec
from .formats import (TORCH_CHAIN_FLAGS, TORCH_DECOUPLED, TORCH_FIXED_FLAGS, TORCH_STEPLESS, chain_flags, foreign_state_keys,
                      torch_hyper_names, torch_model_entries, torch_state_names)
from .lowbit import group_settings, stored_base, stored_part, torch_stored_name
from .save import torch_state_dict
from .torch_view import PYTHON_STEPS, torch_scalar

if TYPE_CHECKING: from ..optimizer import Optimizer

__all__ = ['torch_class_state_dict', 'torch_group_entries']


def torch_class_state_dict(opt: Optimizer, cls: type, dequantize: bool = False) -> dict:
    """The state_dict torch.optim's class `cls` would save for this optimizer: torch's layout (as `torch_state_dict`)
    with torch's state names (`cb.torch_state`) and the group entries of `cls`'s signature (`betas`, `weight_decay`,
    its flags from the chain, `foreach`/`fused` from the backend), so `cls(params).load_state_dict(...)` steps on as
    this optimizer would. What `cls` cannot hold is refused, naming the group or param: state with no torch name (another
    algorithm), a flag or a decay `cls` does not have, a hyper it has no entry for (unless at its callback's default,
    which changes nothing), fastai's `do_wd=False`. Whole-model callbacks (clipping...) are not torch.optim's: their
    entries are left out, but for those torch keeps under a group's first param (`cb.torch_model_state`: LBFGS's)."""
    what = f"torch.optim.{cls.__name__}"
    base = torch_state_dict(opt, dequantize)
    state, groups = {}, []
    for i, (g, saved) in enumerate(zip(opt.param_groups, base['param_groups'])):
        cbs, hyper = g['cbs'], {k: v for k, v in saved.items() if k not in NOT_HYPERS and not is_model_entry(k)}
        where = f"param group {i} (chain [{chain_name(cbs)}])"
        own_class = isinstance(g, TorchParamGroup) and cls is getattr(opt, 'torch_class', None)
        entries = torch_group_entries(where, cls, cbs, hyper, opt.backend, own_class)
        if own_class:  # cbopt.optim's: as the group
            entries.update((k, _plain(v)) for k, v in g.items() if k in entries)  # holds them (its own `foreach`...)
        own = {k: _plain(v) for k, v in g.items() if is_framework_key(k, cbs) and k not in entries}  # timm's lr_scale...
        groups.append({**entries, **own, **group_settings(saved),  # (low-bit: its format)
                       'param_names': saved['param_names'], 'params': saved['params']})
        names = {ours: theirs for theirs, ours in torch_state_names(cbs).items()}
        extras = [f for cb in cbs if (f := spec(cb).torch_extra_state) is not None]
        counters = chain_counters(param_chain(cbs))
        for p, pid, name in zip(g['params'], saved['params'], saved['param_names']):
            algo, flags = split_flags(base['state'].get(pid, {}))
            if flags.get('do_wd') is False and _nonzero(hyper.get('wd', 0)):
                raise ValueError(f"param {name!r} ({where}) is not decayed (fastai's do_wd=False), which {what} cannot "
                                 f"say: its weight_decay applies to every param of a group (put {name!r} in a group with wd=0)")
            algo = {k: v for k, v in algo.items() if not is_model_entry(k) or stored_part(k)}
            if not algo: continue
            carried = {k for k in foreign_state_keys(algo, names) if stored_base(k) not in names}  # a framework's own
            # entries (timm Lookahead's): saved as they are (a low-bit entry's parts are the chain's: `'exp_avg.codes'`)
            for k in algo:
                if stored_base(k) not in names and k not in carried:
                    raise ValueError(f"state {k!r} of param {name!r} ({where}) has no {what} name: this chain is not "
                                     f"{what}'s algorithm")
            torch_group = {**g, **groups[-1]}  # (its `fused`, `capturable`: where torch keeps its step)
            numbers = cls.__name__ in PYTHON_STEPS
            out = {torch_stored_name(k, names): torch_scalar(v, p, torch_group) if k in counters and not numbers else v
                   for k, v in algo.items()}
            if 'step' not in out and cls.__name__ not in TORCH_STEPLESS:
                raise ValueError(f"param {name!r} ({where}) has no step count, which {what}'s state must have: this "
                                 f"chain does not count steps (cbopt.optim.{cls.__name__} does)")
            for f in extras: out.update({k: torch_scalar(v, p, torch_group) for k, v in f(**{**algo, **hyper}).items()})
            state[pid] = out
        if saved['params'] and (model := torch_model_entries(saved, cbs)):  # LBFGS's history: under the first param
            state[saved['params'][0]] = {**state.get(saved['params'][0], {}), **model}
    return {'state': state, 'param_groups': groups}


def _nonzero(v: Any) -> bool: return bool(v != 0)  # (not float(v): a hyper may be a tensor that requires grad)


def torch_group_entries(where: str, cls: type, cbs: list, hyper: Mapping, backend: str, own_class: bool = False) -> dict:
    """One group's entries as torch's class `cls` saves them (and a `cbopt.optim` class's groups hold them): its
    constructor's arguments (at their defaults where the chain does not say) and the flags it fixes
    (`TORCH_FIXED_FLAGS`); see `torch_class_state_dict`. `own_class`: the group is one of `cls`'s twin in `cbopt.optim`,
    whose group dict may set such a flag otherwise (AdamW's `decoupled_weight_decay=False`, as torch's AdamW takes it);
    a chain written for another class with its flag otherwise is refused (torch's AdamW sets it again on loading)."""
    names, flags, reads = torch_hyper_names(cbs), chain_flags(cbs), chain_reads(cbs)
    what, fixed = f"torch.optim.{cls.__name__}", TORCH_FIXED_FLAGS.get(cls.__name__, {})
    sig = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items() if k not in ('self', 'params')}
    out, used = {}, set()
    for k, default in {**sig, **fixed}.items():
        canon = names.get(k)
        parts = canon if isinstance(canon, tuple) else (canon,)  # (None: no hyper of cbopt's)
        if k in fixed: out[k] = (k in flags) if own_class and k in TORCH_CHAIN_FLAGS and k not in reads else default
        elif k in TORCH_CHAIN_FLAGS and k not in reads: out[k] = k in flags
        elif all(c in hyper for c in parts):
            out[k] = tuple(hyper[c] for c in parts) if isinstance(canon, tuple) else hyper[canon]
            used.update(parts)
        elif k == 'foreach': out[k] = {'foreach': True, 'loop': False}.get(backend, default)
        elif k == 'fused': out[k] = True if backend == 'fused' else default
        else: out[k] = default  # (capturable, differentiable; dampening where the chain has none)
    if 'initial_lr' in hyper: out['initial_lr'] = hyper['initial_lr']
    wd = hyper.get('wd', 0)
    if 'wd' in reads and _nonzero(wd):
        ours = 'decoupled_weight_decay' in flags
        theirs = out['decoupled_weight_decay'] if 'decoupled_weight_decay' in out else cls.__name__ in TORCH_DECOUPLED
        if ours != theirs:
            raise ValueError(f"{where} decays the weights {'decoupled' if ours else 'by L2'} (wd={wd}), {what} "
                             f"{'decoupled' if theirs else 'by L2'}: its weight_decay would mean another decay")
    for f in sorted(flags - set(out) - {'decoupled_weight_decay'}):
        raise ValueError(f"{where} runs with {f}=True, which {what} does not take")
    defaults = chain_defaults(cbs)
    for k, v in hyper.items():
        if k in reads and k not in used and k != 'initial_lr' and not (k in defaults and _same_value(v, defaults[k])):
            raise ValueError(f"{where} has the hyper {k}={v!r}, which {what} has no entry for: it would be lost")
    return out


def _same_value(a: Any, b: Any) -> bool:
    "Whether hyper value `a` is the default `b`: a 1-element tensor (a tensor lr or beta) by its value."
    a, b = (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in (a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b
