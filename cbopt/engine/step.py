"""A step's entry: eager (GradScaler's skip, the grad checks, the whole-model stage or the buckets alone) or traced
into the caller's graph under an outer `torch.compile` (`traced`)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .._torch import constant_result, dynamo_loaded
from ..core.chain import cb_name
from ..core.hypers import Hypers
from . import traced
from .dispatch import check_grads, counts_as_numbers, kernel_step_on_device, read_on_host, run_buckets
from .model_stage import init_model_state, model_plan, run_model_step, uses_closure
from .scaling import unscale_grads

__all__ = ['run_step']


def run_step(opt, closure: Callable | None = None, loss=None) -> None:
    """Step every param of `opt` that has a grad, bucket by bucket, with `opt`'s backend, between the whole-model
    callbacks (see the module docstring); then refresh `opt.step_stats`. `closure` and `loss` (what `opt.step(closure)`
    got from its first call) go to the whole-model callbacks that re-evaluate the model (`uses_closure`, as `lbfgs`):
    after such a step each param holds the grad of the closure's last evaluation, as with torch.optim.LBFGS.

    Under an outer `torch.compile` (`@torch.compile def step(): opt.step()`, torch's compiled-optimizer recipe) the
    step is traced into the caller's graph (`traced`), or, where it cannot be (`traced.can_trace`), runs eagerly: one
    graph break. Once `torch._dynamo` is imported, the eager step is one dynamo never traces (`_off_dynamo`); before,
    no frame can be under dynamo, and the step is called as it is."""
    if torch.compiler.is_compiling():
        if closure is None and traced.can_trace(opt): return traced.traced_step(opt)
        _off_dynamo()
        return _OFF_DYNAMO(opt, closure, loss)
    if not dynamo_loaded(): return _eager_step(opt, closure, loss)
    _off_dynamo()
    _OFF_DYNAMO(opt, closure, loss)


def _eager_step(opt, closure: Callable | None = None, loss=None) -> None:
    "`run_step` in eager mode (the engine's counters as Python numbers: `traced.counters_as_numbers`)."
    with traced.counters_as_numbers(opt): _eager_run(opt, closure, loss)


_OFF_DYNAMO: Callable | None = None  # `_eager_step` as dynamo's `disable` makes it, once `_off_dynamo` has run


@constant_result
def _off_dynamo() -> bool:
    """Make `_OFF_DYNAMO`, `_eager_step` marked for dynamo never to trace (`torch.compiler.disable`: a traced caller
    breaks its graph there, naming the reason, and the step runs eagerly), once dynamo is imported: marking it at
    import would import `torch._dynamo` with cbopt. Dynamo calls this eagerly when it traces a step (a constant
    result), so the traced step then reads the global it made."""
    global _OFF_DYNAMO
    if _OFF_DYNAMO is None:
        _OFF_DYNAMO = torch.compiler.disable(_eager_step, reason=(
            "cbopt's step runs eagerly here: its chain has a whole-model callback, GradScaler's inf check or a "
            "closure, its params are DTensors, or a callback reads a Python value of a tensor (see cbopt.engine.traced)"))
    return True


def _eager_run(opt, closure: Callable | None = None, loss=None) -> None:
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():  # (free without CUDA: a flag read)
        raise RuntimeError("cbopt's step cannot be captured in a CUDA graph: its step counts and hypers are Python "
                           "numbers, which every replay of the graph would reuse unchanged (silently wrong steps); step "
                           "it eagerly, or under torch.compile without CUDA graphs")
    for i, g in enumerate(opt.param_groups):  # schedule-free's rule: a group in eval mode must not step
        if dict.get(g, 'train_mode') is False and any(p.grad is not None for p in g['params']):
            raise RuntimeError(f"param group {i} is in eval mode (its params are the averaged weights): call "
                               "opt.train() before opt.step(), and opt.eval() before evaluating or saving")
    found_inf, loss_scale = getattr(opt, 'found_inf', None), getattr(opt, 'grad_scale', None)  # GradScaler's
    plan = model_plan(opt.param_groups)
    snapshots = None
    if found_inf is not None and not read_on_host(found_inf) and not (plan[0] or plan[1]):
        snapshots = {id(g): Hypers(g).snapshot() for g in opt.param_groups}  # (every bucket on torch's kernel: the
        # step reads found_inf nowhere but in the kernels, and a skipped step is told by `step_stats['skipped']`, a
        # 0-d tensor on the device)
        if kernel_step_on_device(opt, snapshots, found_inf, loss_scale):
            opt.step_stats = {'lr': [snapshots[id(g)].get('lr') for g in opt.param_groups], 'skipped': found_inf}
            return
    counts_as_numbers(opt)  # (counts the kernels kept on the device: numbers again, for the chains)
    if found_inf is not None and bool(found_inf):  # (one sync on this path: chains read their counts as numbers)
        opt.step_stats = {'lr': [Hypers(g).snapshot().get('lr') for g in opt.param_groups], 'skipped': True,
                          'skipped_by': 'GradScaler'}
        return
    if not (plan[0] or plan[1]):
        snapshots = snapshots or {id(g): Hypers(g).snapshot() for g in opt.param_groups}
        run_buckets(opt, snapshots, check=True, loss_scale=loss_scale)
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
    try: run_model_step(opt, plan, dict(closure=reevaluate, loss=loss) if evaluating else None)
    finally:  # the grad contract: whole-model callbacks rebind grads out of place; each param gets its own back
        for p, grad in user_grads: p.grad = grad
