"""L-BFGS as a whole-model callback: torch.optim.LBFGS's algorithm, its history as named, checkpointed state.

L-BFGS works on the flat vector of all params (the grads of the group's params concatenated, in order, as torch's
`_gather_flat_grad`), and re-evaluates the model several times per step. So it is one whole-model callback, `lbfgs`,
that declares `uses_closure = True`: the engine passes it the step's `closure` (each call re-evaluates the loss and
the grads, with grad enabled) and `loss`, what the closure returned when `step` evaluated it first. Its state is the
group entries `'lbfgs.<key>'` (`func_evals`, `n_iter`, `d`, `t`, `old_dirs`, `old_stps`, `ro`, `H_diag`,
`prev_flat_grad`, `prev_loss`: torch's names), so a checkpoint carries it by name, loads with weights_only, and a
torch.optim.LBFGS state_dict (which keeps it under its first param) loads into it. The per-param chain is empty: every
backend (loop, foreach, fused, auto) runs the same whole-model code. torch's strong-Wolfe line search
(`torch.optim.lbfgs._strong_wolfe`, through `cbopt._torch.strong_wolfe`) is reused as it is.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .._torch import strong_wolfe


__all__ = ['lbfgs', 'LINE_SEARCHES']

LINE_SEARCHES = (None, 'strong_wolfe')


def _real(t: torch.Tensor) -> torch.Tensor:
    "A complex tensor as its (real, imaginary) pairs, a view (torch's LBFGS works on complex params' real views)."
    return torch.view_as_real(t) if t.is_complex() else t


def _flat_grad(ps: list) -> torch.Tensor:
    """Every param's grad as one flat real vector, in order; zeros for a param without a grad (torch's
    `_gather_flat_grad`: a complex grad gives its real and imaginary parts)."""
    return torch.cat([_real(p).new_zeros(_real(p).numel()) if p.grad is None else _real(p.grad).reshape(-1)
                      for p in ps])


def _add(ps: list, t, d: torch.Tensor) -> None:
    "`p += t * d` for each param's slice of the flat direction `d` (torch's `_add_grad`), on complex params' real views."
    offset = 0
    for p in map(_real, ps):
        p.add_(d[offset:offset + p.numel()].view_as(p), alpha=t)
        offset += p.numel()


def _check(ps: list, groups: list, max_eval, line_search_fn, d, prev_flat_grad) -> None:
    "What would fail mid-step, refused before anything changes."
    if len(groups) != 1: raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")
    if line_search_fn not in LINE_SEARCHES:
        raise ValueError(f"lbfgs: line_search_fn={line_search_fn!r} is not supported: only None or 'strong_wolfe'")
    if line_search_fn == 'strong_wolfe': strong_wolfe()  # (raises where this torch has none)
    if max_eval is not None and (isinstance(max_eval, bool) or not isinstance(max_eval, int) or max_eval < 1):
        raise ValueError(f"lbfgs: max_eval must be None or an int >= 1, got {max_eval!r}")
    numel = sum(_real(p).numel() for p in ps)
    for k, v in (('d', d), ('prev_flat_grad', prev_flat_grad)):
        if v is not None and (not isinstance(v, torch.Tensor) or v.shape != (numel,)):
            raise ValueError(f"lbfgs: its state {k!r} has shape {tuple(getattr(v, 'shape', ()))}, but the params have "
                             f"{numel} elements: the state is of other params (LBFGS's history follows the params' order)")


def lbfgs(params, groups, closure: Callable, loss, lr, max_iter, max_eval, tolerance_grad, tolerance_change,
          history_size, line_search_fn, func_evals=0, n_iter=0, d=None, t=None, old_dirs=(), old_stps=(), ro=(),
          H_diag=None, prev_flat_grad=None, prev_loss=None, **kwargs) -> dict:
    """One torch.optim.LBFGS step, op for op: up to `max_iter` iterations of the two-loop recursion over the last
    `history_size` curvature pairs, each with a fixed step `lr` or torch's strong-Wolfe line search. `loss` is the
    closure's value at the start (the engine evaluated it); `closure()` re-evaluates. The state it is given is never
    changed in place (a checkpoint holding it stays as it was); t, H_diag and ro are kept as Python floats."""
    ps = list(groups[0]['params'])
    _check(ps, groups, max_eval, line_search_fn, d, prev_flat_grad)
    if max_eval is None: max_eval = max_iter * 5 // 4
    lr = lr.item() if isinstance(lr, torch.Tensor) else lr
    loss = float(loss)
    current_evals, func_evals = 1, func_evals + 1
    flat_grad = _flat_grad(ps)
    if flat_grad.abs().max() <= tolerance_grad: return dict(func_evals=func_evals, n_iter=n_iter)  # optimal already

    old_dirs, old_stps, ro = list(old_dirs), list(old_stps), [float(r) for r in ro]
    it = 0
    while it < max_iter:
        it += 1
        n_iter += 1
        # the descent direction
        if n_iter == 1:
            d, old_dirs, old_stps, ro, H_diag = flat_grad.neg(), [], [], [], 1.0
        else:
            y = flat_grad.sub(prev_flat_grad)
            s = d.mul(t)
            ys = y.dot(s)
            if ys > 1e-10:  # a curvature pair worth keeping
                if len(old_dirs) == history_size: old_dirs, old_stps, ro = old_dirs[1:], old_stps[1:], ro[1:]
                old_dirs, old_stps, ro = old_dirs + [y], old_stps + [s], ro + [float(1.0 / ys)]
                H_diag = float(ys / y.dot(y))
            q, al = flat_grad.neg(), [None] * len(old_dirs)
            for i in range(len(old_dirs) - 1, -1, -1):
                al[i] = old_stps[i].dot(q) * ro[i]
                q.add_(old_dirs[i], alpha=-al[i])
            d = r = torch.mul(q, H_diag)
            for i in range(len(old_dirs)):
                be_i = old_dirs[i].dot(r) * ro[i]
                r.add_(old_stps[i], alpha=al[i] - be_i)
        prev_flat_grad, prev_loss = flat_grad.clone(memory_format=torch.contiguous_format), loss
        # the step length
        t = min(1.0, 1.0 / flat_grad.abs().sum()) * lr if n_iter == 1 else lr
        gtd = flat_grad.dot(d)
        if gtd > -tolerance_change: break  # not a descent direction any more
        ls_func_evals = 0
        if line_search_fn == 'strong_wolfe':
            def evaluate(x, t, d):
                "The loss and flat grad at `x + t*d` (torch's `_directional_evaluate`); the params return to `x`."
                _add(ps, t, d)
                f = float(closure())
                g = _flat_grad(ps)
                for p, x_p in zip(ps, x): p.copy_(x_p)
                return f, g
            x_init = [p.clone(memory_format=torch.contiguous_format) for p in ps]
            loss, flat_grad, t, ls_func_evals = strong_wolfe()(evaluate, x_init, t, d, loss, flat_grad, gtd,
                                                              max_ls=max_eval - current_evals)
            _add(ps, t, d)
            opt_cond = flat_grad.abs().max() <= tolerance_grad
        else:
            _add(ps, t, d)
            if it != max_iter:  # (torch does not re-evaluate after the last iteration)
                loss = float(closure())
                flat_grad = _flat_grad(ps)
                opt_cond = flat_grad.abs().max() <= tolerance_grad
                ls_func_evals = 1
        current_evals += ls_func_evals
        func_evals += ls_func_evals
        if it == max_iter or current_evals >= max_eval or opt_cond: break
        if d.mul(t).abs().max() <= tolerance_change or abs(loss - prev_loss) < tolerance_change: break  # no progress
    as_float = lambda v: None if v is None else float(v)
    return dict(func_evals=func_evals, n_iter=n_iter, d=d, t=as_float(t), old_dirs=old_dirs, old_stps=old_stps, ro=ro,
                H_diag=as_float(H_diag), prev_flat_grad=prev_flat_grad, prev_loss=prev_loss)
lbfgs.scope = 'model'
lbfgs.uses_closure = True
lbfgs.defaults = dict(lr=1, max_iter=20, max_eval=None, tolerance_grad=1e-7, tolerance_change=1e-9, history_size=100,
                      line_search_fn=None)
lbfgs.state = dict(func_evals=0, n_iter=0, d=None, t=None, old_dirs=[], old_stps=[], ro=[], H_diag=None,
                   prev_flat_grad=None, prev_loss=None)
lbfgs.flat_state = ('d', 'old_dirs', 'old_stps', 'prev_flat_grad')  # over the params in order: loaded in this order
# torch.optim.LBFGS keeps this state under its first param (and its scratch `al`, which cbopt does not keep)
lbfgs.torch_model_state = {**{k: k for k in lbfgs.state}, 'al': None}
lbfgs.torch_names = {k: k for k in lbfgs.defaults if k != 'lr'}
