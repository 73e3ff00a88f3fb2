"""Turn every accepted form of `params` into named param groups.

An optimizer's params may come as tensors, `named_parameters()` pairs, a `Dict[str, Tensor]`, a nested
dict of several models, torch-style group dicts or fastai-style lists of lists. All of them end up as
group dicts holding `params` (tensors) and `param_names` (FQNs), which is what named state is keyed by.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .hypers import ALIASES, HYPER_RULES, NOT_HYPERS, TORCH_NAMES, check_hyper, from_torch_names
from .names import canonical_names

__all__ = ['named_groups', 'check_params', 'is_group_dict', 'distinct_names', 'GROUP_SEP', 'non_leaf_params']

# torch's own wording (torch/optim/optimizer.py), then why it matters here
SET_MSG = ("optimizer parameters need to be organized in ordered collections, but the ordering of tensors in sets will "
           "change between runs. Please use a list instead. (cbopt names unnamed params by their position, so a set "
           "would name a different param each run, and a checkpoint would load another param's state.)")
MODULE_MSG = "pass model.parameters(), or model.named_parameters() to key the optimizer's state by param names"


def is_group_dict(o: Any) -> bool:
    "A torch-style group: a dict with a `params` entry."
    return isinstance(o, Mapping) and 'params' in o


def _is_named_pair(o: Any) -> bool:
    return isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str)


def _is_param_like(o: Any) -> bool:
    "A tensor, a (name, tensor) pair, or a pair that meant to be one (its name not a string): a param, not a group."
    return isinstance(o, torch.Tensor) or _is_named_pair(o) or (
        isinstance(o, tuple) and len(o) == 2 and isinstance(o[1], torch.Tensor))


def _a(o: Any) -> str:
    "'a float', 'an int': the type of `o` with its article."
    n = type(o).__name__
    return f"{'an' if n[0].lower() in 'aeiou' else 'a'} {n}"


def _at(prefix: str) -> str: return f' at {prefix!r}' if prefix else ''


def _check_form(o: Any, where: str) -> Any:
    """Refuse the forms that are not params though they look iterable (or are a user's likely slip); return `o`,
    with an `nn.ParameterDict` as a plain name -> param dict."""
    if isinstance(o, (set, frozenset)): raise TypeError(f"params{where} is {_a(o)}: {SET_MSG}")
    if isinstance(o, nn.ParameterDict): return dict(o.items())
    if isinstance(o, nn.Module) and not isinstance(o, nn.ParameterList):  # a ParameterList is a list of params, as in torch
        raise TypeError(f"params{where} is an nn.Module ({type(o).__name__}), not its parameters: {MODULE_MSG}")
    if isinstance(o, Mapping) and hasattr(o, '_metadata') and not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in o.values()):
        raise TypeError(f"params{where} looks like a model.state_dict(): its tensors are detached copies, which never "
                        f"get a grad, so nothing would train: {MODULE_MSG}")
    return o


def _flatten(params: Any, prefix: str) -> list[tuple[str | None, Any]]:
    "Flatten one group's `params` into (name or None, tensor) pairs; nested dicts join names with dots."
    if isinstance(params, torch.Tensor): return [(prefix or None, params)]
    params = _check_form(params, _at(prefix))
    if isinstance(params, Mapping):
        if 'params' in params:
            raise TypeError(f"a param group dict cannot be nested inside params{_at(prefix)}")
        out = []
        for k, v in params.items():
            if not isinstance(k, str) or not k:
                raise TypeError(f"param names must be non-empty strings, got {k!r} ({type(k).__name__}){_at(prefix)}")
            out += _flatten(v, f'{prefix}.{k}' if prefix else k)
        return out
    if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        hint = ''
        if prefix.rpartition('.')[2] in (*HYPER_RULES, *ALIASES, *TORCH_NAMES) and isinstance(params, (int, float)):
            hint = f" (is {prefix.rpartition('.')[2]!r} a hyper of a group dict that has no 'params' entry?)"
        raise TypeError(f"params{_at(prefix)} is {_a(params)}, not a Tensor, a dict or an iterable of them{hint}")
    out = []
    for i, o in enumerate(params):
        if _is_named_pair(o):
            if not o[0]: raise TypeError(f"param names must be non-empty strings, got '' at position {i}{_at(prefix)}")
            out += _flatten(o[1], f'{prefix}.{o[0]}' if prefix else o[0])
        # an unnamed tensor under a name (e.g. {"enc": enc.parameters()}) is named by its position there
        elif isinstance(o, torch.Tensor): out.append((f'{prefix}.{i}' if prefix else None, o))
        elif isinstance(o, Mapping) or isinstance(o, (set, frozenset, nn.Module)): out += _flatten(o, prefix)
        elif isinstance(o, tuple) and len(o) == 2 and isinstance(o[1], torch.Tensor):
            raise TypeError(f"params{_at(prefix)} holds a (name, Tensor) pair at position {i} whose name is "
                            f"{_a(o[0])} ({o[0]!r}): param names are strings")
        else:
            raise TypeError(f"params{_at(prefix)} holds {_a(o)} at position {i}, not a Tensor or a "
                            f"(name, Tensor) pair")
    return out


def _split_groups(params: Any) -> list[dict]:
    "Split top-level `params` into group dicts (not yet named)."
    if isinstance(params, torch.Tensor) or is_group_dict(params): params = [params]
    else:
        params = _check_form(params, '')
        if isinstance(params, Mapping): return [{'params': params}]
        if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):  # torch's wording
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                            + torch.typename(params))
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list (a generator such as model.parameters() gives its "
                         "params only once: was it used before?)")
    if all(is_group_dict(o) for o in items): return [dict(o) for o in items]
    if any(is_group_dict(o) for o in items):
        raise TypeError("params mixes group dicts with other entries: give either all group dicts or none")
    # fastai splitter style: a list whose entries are collections of params (lists, name->param dicts,
    # named_parameters() generators) gives one group per entry; a (name, tensor) pair is a param, not a group
    if not any(_is_param_like(o) for o in items):
        return [{'params': _check_form(o, f' at position {i}')} for i, o in enumerate(items)]  # _flatten reads each once
    return [{'params': items}]


def named_groups(params: Any, start: int = 0) -> list[dict]:
    """Group dicts with `params` (tensors) and `param_names` (FQNs) from any accepted form of `params`.
    Unnamed params get their position among all params (counting from `start`) as a stable name; names lose the
    prefixes wrappers add (`_orig_mod.`, DDP's `module.`, ...: `cbopt.state.names`), as torch's DCP helpers do; a
    group dict's own `param_names` (as torch's `param_groups` hold them) name its params as they are. torch's hyper
    names in a group dict (`weight_decay`, `betas`) become cbopt's (`cbopt.hypers.from_torch_names`)."""
    split = _split_groups(params)
    for i, g in enumerate(split): _check_aliases(g, i)  # here, before a group becomes a ParamGroup (which keeps the two equal)
    split = [from_torch_names(g, where=f' (group {i})') for i, g in enumerate(split)]
    flat = [_flatten(g['params'], '') for g in split]
    canon = iter(canonical_names([n for pairs in flat for n, _ in pairs if n is not None]))  # no wrapper prefixes
    groups, pos = [], start
    for i, (g, pairs) in enumerate(zip(split, flat)):
        names = [str(pos + j) if name is None else next(canon) for j, (name, _) in enumerate(pairs)]
        if g.get('param_names') is not None:
            given = list(g['param_names'])
            if len(given) != len(pairs):
                raise ValueError(f"param group {i} has {len(pairs)} params but {len(given)} param_names")
            for n, (name, _) in zip(given, pairs):
                if name is not None and name != n and canonical_names([name]) != [n]:
                    raise ValueError(f"param group {i} names a param both {name!r} and {n!r} (in its param_names)")
            names = given
        pos += len(pairs)
        groups.append({**g, 'params': [t for _, t in pairs], 'param_names': names})
    return groups


def _check_aliases(g: Mapping, i: int) -> None:
    "A group may give `mom` or torch's `momentum`, not both with different values (one would silently win)."
    for alias, canon in ALIASES.items():
        if alias in g and canon in g and g[alias] != g[canon]:
            raise ValueError(f"param group {i} gives both {canon!r} ({g[canon]!r}) and its torch name {alias!r} "
                             f"({g[alias]!r}): give one")


def check_group_hypers(g: Mapping, i: int) -> None:
    """The hypers a group dict gives itself are checked as the optimizer's are (`cbopt.hypers.check_hyper`); its
    aliases were checked by `named_groups`, which every group comes from."""
    for k, v in g.items():
        if k not in NOT_HYPERS: check_hyper(k, v, i)


GROUP_SEP = '/'  # a name given in several groups is keyed `<group index>/<name>` (no module FQN holds a '/')


def distinct_names(groups: list[dict]) -> None:
    """Key each name given in more than one group as `<group index>/<name>` (`GROUP_SEP`), in place. torch accepts such
    groups (each built from a submodule's `named_parameters()`: `weight` and `bias` in every group) and keeps the bare
    names, loading by position; cbopt keys state by name, so it makes them distinct, keeping the group they are in in
    the key (`opt.name_params(model)` keys them by their FQNs instead). A name repeated within one group stays a
    duplicate (`check_params` refuses it)."""
    def bare(n: str) -> str:  # (a name keyed so already: its given name)
        head, sep, rest = n.partition(GROUP_SEP)
        return rest if sep and head.isdigit() else n
    where: dict[str, set] = {}
    for i, g in enumerate(groups):
        for n in g['param_names']: where.setdefault(bare(n), set()).add(i)
    shared = {n for n, gs in where.items() if len(gs) > 1}
    if not shared: return
    for i, g in enumerate(groups):
        if any(n in shared for n in g['param_names']):
            g['param_names'] = [f'{i}{GROUP_SEP}{n}' if n in shared else n for n in g['param_names']]


_NON_LEAF_OK = contextvars.ContextVar('cbopt_non_leaf_params', default=False)


@contextlib.contextmanager
def non_leaf_params() -> Iterator[None]:
    """While building (or adding a group to) a differentiable optimizer (cbopt.optim's `differentiable=True`), params
    may be non-leaf tensors, as torch's differentiable optimizers take them: the step updates them in autograd's
    graph. Elsewhere a non-leaf param is a slip (its updates would never reach the tensor it was computed from)."""
    token = _NON_LEAF_OK.set(True)
    try: yield
    finally: _NON_LEAF_OK.reset(token)


def check_params(groups: list[dict], known: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise a clear error naming the culprit for a non-float (or complex), non-leaf (but under `non_leaf_params`),
    duplicated or doubly named param, or a bad hyper in a group dict (`groups` come from `named_groups`, which refuses
    anything but tensors)."""
    non_leaf_ok = _NON_LEAF_OK.get()
    seen_names = dict(known or {})
    seen_ids = {id(t): (n, None) for n, t in seen_names.items()}  # (name, group index here: None for `known`)
    for i, g in enumerate(groups):
        for name, t in zip(g['param_names'], g['params']):
            if not t.is_floating_point() and not t.is_complex():
                raise TypeError(f"param {name!r} (group {i}) has dtype {t.dtype}: only floating-point (or complex) params can be optimized")
            if not t.is_leaf and not t.retains_grad and not non_leaf_ok:
                raise ValueError(f"param {name!r} (group {i}) is not a leaf tensor: optimize the tensor it was computed from")
            if id(t) in seen_ids:
                other, j = seen_ids[id(t)]
                if j != i:  # torch's words (its test_errors matches them), then which param
                    raise ValueError(f"some parameters appear in more than one parameter group: param {name!r} (group "
                                     f"{i}) is the same tensor as {other!r} ({'an earlier group' if j is None else f'group {j}'})")
                raise ValueError(f"param {name!r} (group {i}) is the same tensor as {other!r}: "
                                 "a param may appear only once, in one group")
            if name in seen_names: raise ValueError(f"duplicate param name {name!r} (group {i})")
            seen_names[name], seen_ids[id(t)] = t, (name, i)
        check_group_hypers(g, i)
