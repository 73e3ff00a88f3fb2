"""Turn every accepted form of `params` into named param groups.

An optimizer's params may come as tensors, `named_parameters()` pairs, a `Dict[str, Tensor]`, a nested
dict of several models, torch-style group dicts or fastai-style lists of lists. All of them end up as
group dicts holding `params` (tensors) and `param_names` (FQNs), which is what named state is keyed by.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ['named_groups', 'check_params', 'is_group_dict']


def is_group_dict(o: Any) -> bool:
    "A torch-style group: a dict with a `params` entry."
    return isinstance(o, Mapping) and 'params' in o


def _is_named_pair(o: Any) -> bool:
    return isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str)


def _flatten(params: Any, prefix: str) -> list[tuple[str | None, Any]]:
    "Flatten one group's `params` into (name or None, tensor) pairs; nested dicts join names with dots."
    if isinstance(params, torch.Tensor): return [(prefix or None, params)]
    if isinstance(params, Mapping):
        if 'params' in params:
            raise TypeError(f"a param group dict cannot be nested inside params{' at ' + repr(prefix) if prefix else ''}")
        out = []
        for k, v in params.items():
            if not isinstance(k, str): raise TypeError(f"param names must be strings, got {k!r} ({type(k).__name__})")
            out += _flatten(v, f'{prefix}.{k}' if prefix else k)
        return out
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        where = f' at {prefix!r}' if prefix else ''
        raise TypeError(f"params{where} is a {type(params).__name__}, not a Tensor, a dict or an iterable of them")
    out = []
    for i, o in enumerate(params):
        if _is_named_pair(o): out += _flatten(o[1], f'{prefix}.{o[0]}' if prefix else o[0])
        # an unnamed tensor under a name (e.g. {"enc": enc.parameters()}) is named by its position there
        elif isinstance(o, torch.Tensor): out.append((f'{prefix}.{i}' if prefix else None, o))
        elif isinstance(o, Mapping): out += _flatten(o, prefix)
        else:
            where = f' at {prefix!r}' if prefix else ''
            raise TypeError(f"params{where} holds a {type(o).__name__}, not a Tensor or a (name, Tensor) pair")
    return out


def _split_groups(params: Any) -> list[dict]:
    "Split top-level `params` into group dicts (not yet named)."
    if isinstance(params, torch.Tensor) or is_group_dict(params): params = [params]
    elif isinstance(params, Mapping): return [{'params': params}]
    elif isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise TypeError(f"params is a {type(params).__name__}, not a Tensor, a dict or an iterable of them")
    items = list(params)
    if not items: raise ValueError("optimizer got an empty parameter list")
    if all(is_group_dict(o) for o in items): return [dict(o) for o in items]
    if any(is_group_dict(o) for o in items):
        raise TypeError("params mixes group dicts with other entries: give either all group dicts or none")
    # fastai splitter style: a list whose entries are collections of params (lists, name->param dicts,
    # named_parameters() generators) gives one group per entry; a (name, tensor) pair is a param, not a group
    if all(not isinstance(o, torch.Tensor) and not _is_named_pair(o) for o in items):
        return [{'params': o if isinstance(o, Mapping) else list(o)} for o in items]
    return [{'params': items}]


def named_groups(params: Any, start: int = 0) -> list[dict]:
    """Group dicts with `params` (tensors) and `param_names` (FQNs) from any accepted form of `params`.
    Unnamed params get their position among all params (counting from `start`) as a stable name."""
    groups, pos = [], start
    for g in _split_groups(params):
        pairs = _flatten(g['params'], '')
        names = []
        for name, _ in pairs:
            names.append(str(pos) if name is None else name)
            pos += 1
        groups.append({**g, 'params': [t for _, t in pairs], 'param_names': names})
    return groups


def check_params(groups: list[dict], known: Mapping[str, torch.Tensor] | None = None) -> None:
    "Raise a clear error naming the culprit for a non-tensor, non-leaf, duplicated or doubly named param."
    seen_names = dict(known or {})
    seen_ids = {id(t): n for n, t in seen_names.items()}
    for i, g in enumerate(groups):
        for name, t in zip(g['param_names'], g['params']):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"param {name!r} (group {i}) is a {type(t).__name__}, not a Tensor")
            if not t.is_leaf and not t.retains_grad:
                raise ValueError(f"param {name!r} (group {i}) is not a leaf tensor: optimize the tensor it was computed from")
            if id(t) in seen_ids:
                raise ValueError(f"param {name!r} (group {i}) is the same tensor as {seen_ids[id(t)]!r}: "
                                 "a param may appear only once, in one group")
            if name in seen_names: raise ValueError(f"duplicate param name {name!r} (group {i})")
            seen_names[name], seen_ids[id(t)] = t, name
