"""The engine: how an `Optimizer`'s step runs each group's callback chain over its params, with the same math
(the callbacks') in every backend.

- `loop`: each callback once per param (fastai's way, and the reference the others are tested against).
- `foreach`: each callback once per bucket of params on `TensorList` stand-ins: `torch._foreach_*` kernels.
- `fused`: the whole chain in one pass per bucket: torch's fused kernel when one computes exactly the chain
  (`kernels`), otherwise the chain compiled with `torch.compile` (`compiled`).
- `auto`: torch's kernel if one matches, else foreach on accelerators, else the faster of foreach and loop as timed
  on the first steps (CPU); see `auto`.

Files: `buckets` (which params one call serves), `foreach` (loop and foreach runners, the probe), `compiled`,
`kernels`, `auto`, `runtime` (per-optimizer memory, warnings at the user's line).

A step: `check_grads`; the whole-model callbacks listed at the start of the chains (each once, over the params of
every group listing it, with the hypers of the first such group); the buckets; the whole-model callbacks listed at
the end. A whole-model callback returning `skip=True` ends the step there: no per-param callback runs, and no state
changes but that callback's own (earlier ones' returned state is dropped). What the step used is `opt.step_stats`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from ..chain import (ENGINE_KEYS, _cb_sig, cb_name, chain_name, model_key, model_param_state, param_chain, split_chain,
                     unwrap)
from ..hypers import Hypers
from .auto import auto_bucket
from . import buckets as bucketing
from .buckets import Bucket, as_real, model_buckets
from .compiled import fused_bucket
from . import traced
from .foreach import foreach_bucket, loop_bucket
from .kernels import has_kernel, register_kernel, torch_kernel
from .runtime import forget_state

__all__ = ['BACKENDS', 'Backend', 'as_backend', 'run_step', 'register_kernel', 'Bucket', 'model_plan', 'init_model_state',
           'forget_state']

BACKENDS = ('auto', 'loop', 'foreach', 'fused')


@dataclasses.dataclass(frozen=True)
class Backend:
    """How an optimizer runs its chains: `kind` (one of `BACKENDS`) and the settings of the runners.
    `Optimizer(..., backend='fused')` is `backend=Backend('fused')`; pass a `Backend` to change a setting."""
    kind: str = 'auto'
    compiler: str = 'inductor'        # torch.compile backend of the fused runner ('aot_eager': tracing without codegen)
    compile_chunk: int = 8            # params per compiled call: more compile per graph, fewer calls per step
    cpu_chunk_bytes: int = 4 << 20    # foreach on CPU: about what stays in cache between the chain's ops
    auto_trials: int = 2              # timed steps of each of foreach and loop before auto settles, per bucket layout

    def __post_init__(self):
        if self.kind not in BACKENDS: raise ValueError(f"unknown backend {self.kind!r}: expected one of {BACKENDS}")
        for f in ('compile_chunk', 'cpu_chunk_bytes', 'auto_trials'):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Backend.{f} must be a positive int, got {v!r}")


def as_backend(backend: str | Backend, current: Backend | None = None) -> Backend:
    "A `Backend` from a kind name (keeping `current`'s settings) or a `Backend`."
    if isinstance(backend, Backend): return backend
    if not isinstance(backend, str): raise TypeError(f"backend must be a str or a cbopt.Backend, not {type(backend).__name__}")
    return dataclasses.replace(current or Backend(), kind=backend)


def _fused(opt, b: Bucket, hyper: Mapping) -> None:
    if (kernel := torch_kernel(b, hyper)) is not None: return kernel()
    fused_bucket(opt, b, hyper)


RUNNERS: dict[str, Callable] = {'loop': loop_bucket, 'foreach': foreach_bucket, 'fused': _fused, 'auto': auto_bucket}


def check_grads(opt) -> None:
    """Before anything changes, refuse what no chain can step: a grad of another shape than its param, a grad that
    is not a floating-point tensor of the param's kind, a sparse grad (no cbopt callback supports one, as torch's Adam
    does not). The error names the param, and nothing is stepped: a step is all or nothing. Without whole-model
    callbacks it is called only when bucketing (which reads every grad anyway) meets an odd grad, so that a normal step
    pays for one more test per param, not another pass."""
    for g in opt.param_groups:
        for name, p in zip(g['param_names'], g['params']):
            grad = p.grad
            if grad is None: continue
            if grad.is_sparse:
                raise RuntimeError(f"param {name!r} has a sparse gradient, which the chain [{chain_name(g['cbs'])}] does "
                                   "not support (densify it with grad.to_dense(), or use torch.optim.SparseAdam)")
            if grad.shape != p.shape:
                raise RuntimeError(f"param {name!r} has shape {tuple(p.shape)} but its grad has shape {tuple(grad.shape)}")
            if grad.dtype.is_floating_point != p.dtype.is_floating_point or grad.is_complex() != p.is_complex():
                raise TypeError(f"param {name!r} has dtype {p.dtype} but its grad has dtype {grad.dtype}")


def model_plan(groups: list) -> tuple[list, list]:
    """The whole-model callbacks of the chains of param groups `groups` (an optimizer's), as `[(cb, [groups listing
    it])]`: those listed before the per-param callbacks, and those after. One callback listed by several groups (a
    wrapper's, or the optimizer's shared chain) runs once per step, over all their params; one with state flat over
    its group's params (`cb.flat_state`, L-BFGS's history) is refused in several: whose params it spans, and in
    which order, a checkpoint could not tell."""
    pre: dict = {}
    post: dict = {}
    for g in groups:
        before, _, after = split_chain(g['cbs'])
        for where, cbs in ((pre, before), (post, after)):
            for cb in cbs: where.setdefault(_cb_sig(cb), (cb, []))[1].append(g)
    for cb, listing in [*pre.values(), *post.values()]:
        flat = getattr(unwrap(cb), 'flat_state', ())
        if flat and len(listing) > 1:
            where = [next(i for i, g in enumerate(groups) if g is l) for l in listing]
            raise ValueError(f"{cb_name(cb)} keeps state flat over its group's params ({', '.join(flat)}), but param "
                             f"groups {where} list it: give it one group (its own chain in a group dict), or make one "
                             "group of those params")
    return list(pre.values()), list(post.values())


def _declared(cb, attr: str) -> dict: return dict(getattr(unwrap(cb), attr, None) or {})


def _fill_param_state(st: dict, p, per_param: Mapping) -> None:
    "Add to `p`'s state `st` the whole-model per-param entries it lacks, each from its declared initial value."
    for k, init in per_param.items():
        if k not in st: st[k] = init(p) if callable(init) else init


def init_model_state(opt, plan: tuple | None = None) -> None:
    """Give each whole-model callback its declared state (in the entries of the first group listing it) and each of
    its params with state its declared per-param state, where missing (a new optimizer, a wrapped one, a new group)."""
    from ..state.flags import split_flags
    pre, post = plan or model_plan(opt.param_groups)
    for cb, groups in [*pre, *post]:
        for k, v in _declared(cb, 'state').items(): groups[0].setdefault(model_key(cb, k), v)
        per_param = model_param_state(cb)
        if not per_param: continue
        for g in groups:
            for p in g['params']:
                st = opt.state.get(p)
                if st and split_flags(st)[0]: _fill_param_state(st, p, per_param)


def _model_param_state(opt, cb, groups: list) -> None:
    """Before a whole-model callback with per-param state runs, every param it will see has its full state (as
    `init_state` creates it: training on is exactly as without it), so its buffers exist. (A param with state already
    has the callback's entries: `run_step` gives them, `init_model_state`, before any callback runs.)"""
    from ..state.flags import split_flags
    from ..state.named import initial_state
    if not model_param_state(cb): return
    for g in groups:
        for p in g['params']:
            if p.grad is None: continue
            st = opt.state[p]
            if not split_flags(st)[0]: st.update(initial_state(opt, p, g))


def uses_closure(cb) -> bool:
    "Whether a whole-model callback re-evaluates the model (`cb.uses_closure = True`, as `lbfgs`): it needs the closure."
    return bool(getattr(unwrap(cb), 'uses_closure', False))


def _run_model_cb(opt, cb, groups: list, snapshots: dict, evaluation: Mapping | None = None) -> dict:
    """Run one whole-model callback over the params with a grad of `groups`; returns what it returned (checked).
    A callback that `uses_closure` also gets `evaluation`: `closure` (re-evaluates) and `loss` (its first value)."""
    _model_param_state(opt, cb, groups)
    g0, name = groups[0], cb_name(cb)
    declared, per_param = _declared(cb, 'state'), _declared(cb, 'param_state')
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
    allowed = set(declared) | set(getattr(unwrap(cb), 'transient', ())) | set(ENGINE_KEYS)
    for k in out:
        if k not in allowed:
            raise ValueError(f"whole-model callback {name!r} returned {k!r}, which it does not declare: list it in its "
                             f"`state` (kept, checkpointed) or `transient` (this step only)")
    return out


def _hypers(g, overrides: Mapping) -> dict:
    h = Hypers(g).snapshot()
    return {**h, **overrides[id(g)]} if id(g) in overrides else h


def run_step(opt, closure: Callable | None = None, loss=None) -> None:
    """Step every param of `opt` that has a grad, bucket by bucket, with `opt`'s backend, between the whole-model
    callbacks (see the module docstring); then refresh `opt.step_stats`. `closure` and `loss` (what `opt.step(closure)`
    got from its first call) go to the whole-model callbacks that re-evaluate the model (`uses_closure`, as `lbfgs`):
    after such a step each param holds the grad of the closure's last evaluation, as with torch.optim.LBFGS.

    Under an outer `torch.compile` (`@torch.compile def step(): opt.step()`, torch's compiled-optimizer recipe) the
    step is traced into the caller's graph (`traced`), or, where it cannot be (`traced.can_trace`), runs eagerly: one
    graph break."""
    if torch.compiler.is_compiling() and closure is None and traced.can_trace(opt): return traced.traced_step(opt)
    _eager_step(opt, closure, loss)


@torch._dynamo.disable(reason="cbopt's step runs eagerly here: its chain has a whole-model callback, GradScaler's inf "
                        "check or a closure, its params are DTensors, or a callback reads a Python value of a tensor "
                        "(see cbopt.engine.traced)")
def _eager_step(opt, closure: Callable | None = None, loss=None) -> None:
    "`run_step` in eager mode (the engine's counters as Python numbers: `traced.counters_as_numbers`)."
    with traced.counters_as_numbers(opt): _eager_run(opt, closure, loss)


def _eager_run(opt, closure: Callable | None = None, loss=None) -> None:
    for i, g in enumerate(opt.param_groups):  # schedule-free's rule: a group in eval mode must not step
        if g.get('train_mode') is False and any(p.grad is not None for p in g['params']):
            raise RuntimeError(f"param group {i} is in eval mode (its params are the averaged weights): call "
                               "opt.train() before opt.step(), and opt.eval() before evaluating or saving")
    found_inf, loss_scale = getattr(opt, 'found_inf', None), getattr(opt, 'grad_scale', None)  # GradScaler's
    if found_inf is not None and bool(found_inf):  # (one sync: step counts are Python ints)
        opt.step_stats = {'lr': [Hypers(g).snapshot().get('lr') for g in opt.param_groups], 'skipped': True,
                          'skipped_by': 'GradScaler'}
        return
    plan = model_plan(opt.param_groups)
    if not (plan[0] or plan[1]):
        snapshots = {id(g): Hypers(g).snapshot() for g in opt.param_groups}
        _run_buckets(opt, snapshots, check=True, loss_scale=loss_scale)
        opt.step_stats = {'lr': [snapshots[id(g)].get('lr') for g in opt.param_groups], 'skipped': False}
        return
    evaluating = [cb_name(cb) for cb, _ in [*plan[0], *plan[1]] if uses_closure(cb)]
    if evaluating and closure is None:
        raise RuntimeError(f"{evaluating[0]} re-evaluates the model several times per step: call opt.step(closure), "
                           "where closure() zeroes the grads, computes the loss, calls backward() and returns the loss "
                           "(a fastai Learner steps without a closure)")
    check_grads(opt)  # before the whole-model callbacks change anything
    if loss_scale is not None:  # whole-model callbacks read unscaled grads: unscale them first, as scaler.unscale_ does
        unscale_grads([p for g in opt.param_groups for p in g['params'] if p.grad is not None], loss_scale)
    init_model_state(opt, plan)
    user_grads = [(p, p.grad) for g in opt.param_groups for p in g['params'] if p.grad is not None]

    def reevaluate():
        "The closure, with grad enabled; its grads are the user's from now on (the last evaluation's stay)."
        with torch.enable_grad(): out = closure()
        user_grads[:] = [(p, p.grad) for g in opt.param_groups for p in g['params'] if p.grad is not None]
        return out
    try: _run_model_step(opt, plan, dict(closure=reevaluate, loss=loss) if evaluating else None)
    finally:  # the grad contract: whole-model callbacks rebind grads out of place; each param gets its own back
        for p, grad in user_grads: p.grad = grad


def _run_model_step(opt, plan: tuple, evaluation: Mapping | None = None) -> None:
    "`run_step` with whole-model callbacks (`plan`: `model_plan(opt.param_groups)`; `evaluation`: see `_run_model_cb`)."
    overrides: dict = {}
    snapshots = {id(g): _hypers(g, overrides) for g in opt.param_groups}
    stats: dict = {'skipped': False}
    staged = []  # (group, {entry: value}): committed once no callback skips the step
    scales: dict = {}  # id(group) -> (the grad scale its params' grads still owe, whether to write it into them)
    for cb, groups in plan[0]:
        _pay_scales(opt, scales)
        out = _run_model_cb(opt, cb, groups, snapshots, evaluation)
        new = {model_key(cb, k): v for k, v in out.items() if k not in ENGINE_KEYS and k in _declared(cb, 'state')}
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
        _run_buckets(opt, snapshots, scales=scales)
        scales.clear()  # (paid by the buckets)
        for cb, groups in plan[1]:
            out = _run_model_cb(opt, cb, groups, snapshots, evaluation)
            if out.get('skip') or out.get('hypers') is not None:
                raise ValueError(f"whole-model callback {cb_name(cb)!r} runs after the per-param chain: it cannot skip "
                                 "the step or set its hypers (list it at the start of the chain)")
            groups[0].update({model_key(cb, k): v for k, v in out.items() if k in _declared(cb, 'state')})
            stats.update(out)
    for cb, groups in [*plan[0], *plan[1]]:
        for k in _declared(cb, 'state'): stats[k] = groups[0][model_key(cb, k)]
    opt.step_stats = {'lr': [snapshots[id(g)].get('lr') for g in opt.param_groups], **stats}


def _scale_grads(params: list, scale, in_place: bool = False) -> None:
    """Give `params` their grads times `scale`: out of place (`run_step` gives each param its own grad back), or,
    `in_place` (`clip_grad_norm(in_place=True)`), written into the grads, as `clip_grad_norm_(foreach=True)` does."""
    by_device: dict = {}
    for p in params: by_device.setdefault(p.grad.device, []).append(p)
    for device, ps in by_device.items():
        if in_place: torch._foreach_mul_([p.grad for p in ps], scale.to(device))
        else:
            for p, g in zip(ps, torch._foreach_mul([p.grad for p in ps], scale.to(device))): p.grad = g


def unscale_grads(params: list, loss_scale: torch.Tensor) -> None:
    """Divide `params`' grads by GradScaler's `loss_scale` in place, as `scaler.unscale_` does (times the float32
    reciprocal of the scale, so the same numbers): what a step honouring GradScaler does where no fused kernel folds
    the division into its pass. GradScaler leaves unscaled grads, with torch's fused optimizers and the others alike."""
    inv = loss_scale.double().reciprocal().float()
    by_device: dict = {}
    for p in params: by_device.setdefault(p.grad.device, []).append(p.grad)
    for device, grads in by_device.items(): torch._foreach_mul_(grads, inv.to(device))


def _pay_scales(opt, scales: dict) -> None:
    "Apply the grad scales groups still owe (a whole-model callback reads the grads next), and forget them."
    for g in opt.param_groups:
        if id(g) in scales: _scale_grads([p for p in g['params'] if p.grad is not None], *scales[id(g)])
    scales.clear()


def _run_buckets(opt, snapshots: Mapping, check: bool = False, scales: Mapping | None = None,
                 loss_scale: torch.Tensor | None = None) -> None:
    """The per-param chains over every param with a grad, with each group's hypers for this step (`check`: the grads).
    `scales` (id(group) -> (0-d tensor, in_place), from `clip_grad_norm`) multiply those groups' grads: inside torch's
    fused kernel where one steps the bucket (`fused`, `auto`; in place: the kernel's own `grad_scale`, which writes the
    clipped grads into them), on scaled copies of the bucket's grads otherwise (in place: one `_foreach_mul_`).
    `loss_scale` (GradScaler's) divides every grad, in place: inside torch's kernel, else just before the chain; it
    never reaches the loop backend, which does not claim GradScaler's protocol (`_step_supports_amp_scaling`)."""
    kind, scales = opt.backend_options.kind, scales or {}
    if not any(param_chain(g['cbs']) for g in opt.param_groups): return  # only whole-model callbacks (lbfgs)
    if kind == 'loop':  # the reference needs no bucketing: one call per group
        todo = [(g, [p for p in g['params'] if p.grad is not None]) for g in opt.param_groups]
        if check and any(bucketing.grad_is_odd(p) for _, ps in todo for p in ps): check_grads(opt)
        for g, ps in todo:
            if not ps: continue
            if id(g) in scales: _scale_grads(ps, *scales[id(g)])
            with as_real(Bucket(g, ps, [opt.state[p] for p in ps])) as b: loop_bucket(opt, b, snapshots[id(g)])
        return
    run = RUNNERS[kind]
    for b in bucketing.planned_buckets(opt, on_odd_grad=check_grads if check else None):
        hyper, (scale, in_place) = snapshots[id(b.group)], scales.get(id(b.group), (None, False))
        with as_real(b) as b:  # complex params step as torch's do: on their real views
            if (scale is not None or loss_scale is not None) and kind in ('fused', 'auto'):
                if (kernel := torch_kernel(b, hyper, scale, loss_scale, scale_in_place=in_place)) is not None:
                    kernel()
                    continue
            if loss_scale is not None: unscale_grads(b.params, loss_scale)
            if scale is not None: _scale_grads(b.params, scale, in_place)
            run(opt, b, hyper)
