"""`LBFGS`: torch.optim.LBFGS as a recipe, one group running the whole-model callback `lbfgs`."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._torch import strong_wolfe
from ..callbacks.quasi_newton import LINE_SEARCHES, lbfgs
from ..core.hypers import check_hyper
from ..core.params import check_params, named_groups
from ..optimizer import Optimizer

__all__ = ['LBFGS']


def LBFGS(params: Any, lr: float | torch.Tensor = 1, max_iter: int = 20, max_eval: int | None = None,
          tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9, history_size: int = 100,
          line_search_fn: str | None = None, backend: str = 'auto') -> Optimizer:
    """torch.optim.LBFGS (its hypers, defaults and numerics): `opt.step(closure)`, where `closure` zeroes the grads,
    computes the loss, calls `backward()` and returns the loss. One param group, as torch's; `max_eval` defaults to
    `max_iter * 5 // 4`, stored as torch stores it. A fastai Learner steps without a closure: it gets an error."""
    if line_search_fn not in LINE_SEARCHES:
        raise ValueError(f"line_search_fn={line_search_fn!r} is not supported: only None or 'strong_wolfe'")
    if line_search_fn == 'strong_wolfe': strong_wolfe()  # (a clear error now where this torch has none)
    check_hyper('max_iter', max_iter)
    if max_eval is None: max_eval = max_iter * 5 // 4
    if isinstance(max_eval, bool) or not isinstance(max_eval, int) or max_eval < 1:
        raise ValueError(f"Invalid max_eval value: {max_eval} (expected an int >= 1)")
    if not isinstance(params, (torch.Tensor, Mapping)): params = list(params)  # (a generator: read once, here)
    groups = named_groups(params)
    if len(groups) > 1:  # (after the params' own checks, as torch: a param in two groups is that error)
        check_params(groups)
        raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")
    opt = Optimizer(params, [lbfgs], lr=lr, max_iter=max_iter, max_eval=max_eval, tolerance_grad=tolerance_grad,
                    tolerance_change=tolerance_change, history_size=history_size, line_search_fn=line_search_fn,
                    backend=backend)
    return opt
