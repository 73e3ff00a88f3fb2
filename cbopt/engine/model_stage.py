"""The whole-model stage of a step: the whole-model callbacks listed before the per-param chains (each once, over
the params of every group listing it, with the first such group's hypers), the buckets, then those listed after. A
whole-model callback returning `skip=True` ends the step there with nothing else changed."""
from __future__ import annotations

from collections.abc import Mapping

from ..core.chain import ENGINE_KEYS, _cb_sig, cb_name, model_key, model_param_state, split_chain
from ..core.flags import split_flags
from ..core.hypers import Hypers
from ..core.initial import initial_state
from ..core.spec import spec
from .buckets import model_buckets
from .dispatch import run_buckets
from .scaling import pay_scales
from ..core.runtime import param_states

__all__ = ['model_plan', 'init_model_state', 'uses_closure', 'run_model_step']


def model_plan(groups: list) -> tuple[list, list]:
    """The whole-model callbacks of the chains of param groups `groups` (an optimizer's), as `[(cb, [groups listing
    it])]`: those listed before the per-param callbacks, and those after. One callback listed by several groups (a
    wrapper's, or the optimizer's shared chain) runs once per step, over all their params; one with state flat over
    its group's params (`cb.flat_state`, L-BFGS's history) is refused in several: whose params it spans, and in
    which order, a checkpoint could not tell."""
    pre: dict = {}
    post: dict = {}
    splits: dict = {}  # id(chain) -> its split: groups alike share one chain (a group per layer: one split)
    for g in groups:
        chain = g['cbs']
        if (split := splits.get(id(chain))) is None: split = splits[id(chain)] = split_chain(chain)
        before, _, after = split
        if not (before or after): continue
        for where, cbs in ((pre, before), (post, after)):
            for cb in cbs: where.setdefault(_cb_sig(cb), (cb, []))[1].append(g)
    for cb, listing in [*pre.values(), *post.values()]:
        flat = spec(cb).flat_state
        if flat and len(listing) > 1:
            where = [next(i for i, g in enumerate(groups) if g is l) for l in listing]
            raise ValueError(f"{cb_name(cb)} keeps state flat over its group's params ({', '.join(flat)}), but param "
                             f"groups {where} list it: give it one group (its own chain in a group dict), or make one "
                             "group of those params")
    return list(pre.values()), list(post.values())


def _fill_param_state(st: dict, p, per_param: Mapping) -> None:
    "Add to `p`'s state `st` the whole-model per-param entries it lacks, each from its declared initial value."
    for k, init in per_param.items():
        if k not in st: st[k] = init(p) if callable(init) else init


def init_model_state(opt, plan: tuple | None = None) -> None:
    """Give each whole-model callback its declared state (in the entries of the first group listing it) and each of
    its params with state its declared per-param state, where missing (a new optimizer, a wrapped one, a new group)."""
    pre, post = plan or model_plan(opt.param_groups)
    for cb, groups in [*pre, *post]:
        for k, v in (spec(cb).state or {}).items(): groups[0].setdefault(model_key(cb, k), v)
        per_param = model_param_state(cb)
        if not per_param: continue
        for g in groups:
            for p in g['params']:
                st = param_states(opt).get(p)
                if st and split_flags(st)[0]: _fill_param_state(st, p, per_param)


def _model_param_state(opt, cb, groups: list) -> None:
    """Before a whole-model callback with per-param state runs, every param it will see has its full state (as
    `init_state` creates it: training on is exactly as without it), so its buffers exist. (A param with state already
    has the callback's entries: `run_step` gives them, `init_model_state`, before any callback runs.)"""
    if not model_param_state(cb): return
    for g in groups:
        for p in g['params']:
            if p.grad is None: continue
            st = param_states(opt)[p]
            if not split_flags(st)[0]: st.update(initial_state(opt, p, g))


def uses_closure(cb) -> bool:
    "Whether a whole-model callback re-evaluates the model (`cb.uses_closure = True`, as `lbfgs`): it needs the closure."
    return spec(cb).uses_closure


def _run_model_cb(opt, cb, groups: list, snapshots: dict, evaluation: Mapping | None = None) -> dict:
    """Run one whole-model callback over the params with a grad of `groups`; returns what it returned (checked).
    A callback that `uses_closure` also gets `evaluation`: `closure` (re-evaluates) and `loss` (its first value)."""
    _model_param_state(opt, cb, groups)
    g0, name = groups[0], cb_name(cb)
    declared, per_param = dict(spec(cb).state or {}), spec(cb).param_state
    model_state = {k: g0[model_key(cb, k)] for k in declared}
    bks = model_buckets(opt, groups)
    params = [tl for tl, _ in bks]
    pstate = {k: [type(tl)([s[model_key(cb, k)] for s in states]) for tl, states in bks] for k in per_param}
    grads = [tl.grad for tl in params]
    extra = dict(evaluation or {}) if uses_closure(cb) else {}
    out = cb(params, groups=groups, **{**pstate, **model_state, **snapshots[id(g0)], **extra})
    for tl, before in zip(params, grads):  # grads it rebound (out of place): the rest of the step sees them
        if tl.grad is not before:
            for p, g in zip(tl, tl.grad): p.grad = g
    out = dict(out) if isinstance(out, dict) else {}
    allowed = set(declared) | set(spec(cb).transient) | set(ENGINE_KEYS)
    for k in out:
        if k not in allowed:
            raise ValueError(f"whole-model callback {name!r} returned {k!r}, which it does not declare: list it in its "
                             f"`state` (kept, checkpointed) or `transient` (this step only)")
    return out


def _hypers(g, overrides: Mapping) -> dict:
    h = Hypers(g).snapshot()
    return {**h, **overrides[id(g)]} if id(g) in overrides else h


def run_model_step(opt, plan: tuple, evaluation: Mapping | None = None) -> None:
    "`run_step` with whole-model callbacks (`plan`: `model_plan(opt.param_groups)`; `evaluation`: see `_run_model_cb`)."
    overrides: dict = {}
    snapshots = {id(g): _hypers(g, overrides) for g in opt.param_groups}
    stats: dict = {'skipped': False}
    staged = []  # (group, {entry: value}): committed once no callback skips the step
    scales: dict = {}  # id(group) -> (the grad scale its params' grads still owe, whether to write it into them)
    for cb, groups in plan[0]:
        pay_scales(opt, scales)
        out, declared = _run_model_cb(opt, cb, groups, snapshots, evaluation), spec(cb).state or {}
        new = {model_key(cb, k): v for k, v in out.items() if k not in ENGINE_KEYS and k in declared}
        stats.update({k: v for k, v in out.items() if k not in ENGINE_KEYS})
        if out.get('skip'):
            groups[0].update(new)
            stats.update(skipped=True, skipped_by=cb_name(cb))
            break
        staged.append((groups[0], new))
        if out.get('hypers') is not None:
            hs = list(out['hypers'])
            if len(hs) != len(groups):
                raise ValueError(f"whole-model callback {cb_name(cb)!r} returned hypers for {len(hs)} groups, not {len(groups)}")
            for g, h in zip(groups, hs): overrides.setdefault(id(g), {}).update(h)
            snapshots = {id(g): _hypers(g, overrides) for g in opt.param_groups}
        if out.get('grad_scale') is not None:  # (paid before the next whole-model callback: at most one is owed)
            for g in groups: scales[id(g)] = (out['grad_scale'], bool(out.get('grad_scale_in_place')))
    else:
        for g, new in staged: g.update(new)
        run_buckets(opt, snapshots, scales=scales)
        scales.clear()  # (paid by the buckets)
        for cb, groups in plan[1]:
            out = _run_model_cb(opt, cb, groups, snapshots, evaluation)
            if out.get('skip') or out.get('hypers') is not None:
                raise ValueError(f"whole-model callback {cb_name(cb)!r} runs after the per-param chain: it cannot skip "
                                 "the step or set its hypers (list it at the start of the chain)")
            declared = spec(cb).state or {}
            groups[0].update({model_key(cb, k): v for k, v in out.items() if k in declared})
            stats.update(out)
    for cb, groups in [*plan[0], *plan[1]]:
        for k in (spec(cb).state or {}): stats[k] = groups[0][model_key(cb, k)]
    opt.step_stats = {'lr': [snapshots[id(g)].get('lr') for g in opt.param_groups], **stats}
