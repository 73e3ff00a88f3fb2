"""`InBackward`: an optimizer whose params step during backward, each as soon as its grad is ready.

PyTorch's recipe (the "optimizer step in backward" tutorial, `torch.distributed.optim._apply_optimizer_in_backward`)
builds one optimizer per param and steps it in a `register_post_accumulate_grad_hook`, then frees the grad: a training
step never holds every grad at once, but the state is then spread over many optimizers, and LR schedulers need
patching. Here one optimizer keeps its groups, named state and hypers, and the hook runs the param's group chain on
that one param (a bucket of one, through the engine's runners), so checkpoints are the wrapped optimizer's, and LR
schedulers, `register_step_post_hook` and fastai's hypers work as usual: `step()` runs the step hooks but steps no
param backward already stepped.

What cannot work in backward: a callback that needs every grad at once (global-norm clipping: `scope = 'model'`),
gradient accumulation over several backwards (each backward steps), and GradScaler's unscale (the grads are gone by
`step()`). The first is refused when the optimizer is built; the others are the user's to avoid.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from .. import engine
from ..core.chain import cb_name, is_model_cb
from ..engine import Backend
from ..engine.buckets import Bucket, as_real
from ..engine.foreach import loop_bucket
from ..engine.lowbit import chunks as lowbit_chunks
from ..engine.kernels import torch_kernel
from ..core.hypers import Hypers
from ..optimizer import Optimizer
from ..core.runtime import param_states
from ..state.lowbit import group_settings

__all__ = ['InBackward', 'model_scope_callbacks']

# id(param) -> (weakref to the param, weakref to the InBackward stepping it): a param steps in one InBackward only
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def model_scope_callbacks(opt: Optimizer) -> list[tuple[int, str]]:
    "(group index, callback name) of every callback of `opt` that needs every grad at once (`scope == 'model'`)."
    return [(i, cb_name(cb)) for i, g in enumerate(opt.param_groups) for cb in g['cbs']
            if is_model_cb(cb)]


def _refuse_model_scope(opt: Optimizer) -> None:
    if bad := model_scope_callbacks(opt):
        names = ', '.join(f"{n!r} (group {i})" for i, n in bad)
        raise ValueError(f"InBackward steps each param alone, as soon as its grad is ready, but {names} need every "
                         "grad at once (scope 'model'): step this optimizer after backward instead")


class InBackward(Optimizer):
    """`opt` stepping in backward: the same groups, param names, chains, hypers, state and backend, but each param steps
    in its post-accumulate-grad hook and its grad is then freed (`p.grad is None` after backward). `step(closure)` runs
    the step hooks (LR schedulers count it) and steps only params that still hold a grad (set by hand, not by
    backward), so none steps twice; `zero_grad()` is harmless. Its state_dict is `opt`'s, and loads both ways.
    In backward each param is stepped by the loop runner, or torch's fused kernel where the backend would use it
    (`'auto'`, `'fused'`): a compiled or foreach call on one param gains nothing. `remove_hooks()` stops it.

    ```python
    import torch, cbopt
    model = torch.nn.Linear(4, 2)
    opt = cbopt.InBackward(cbopt.Adam(model.named_parameters(), lr=1e-3))
    model(torch.randn(8, 4)).sum().backward()   # each param steps here, and its grad is freed
    opt.step()                                  # the step hooks (LR schedulers) run; no param steps twice
    assert model.weight.grad is None
    ```
    """
    in_backward = True

    def __init__(self, opt: Optimizer, backend: str | Backend | None = None):
        if not isinstance(opt, Optimizer):
            raise TypeError(f"InBackward wraps a cbopt optimizer, got a {type(opt).__module__}.{type(opt).__qualname__}")
        if getattr(opt, 'in_backward', False): raise TypeError("this optimizer already steps in backward")
        _refuse_model_scope(opt)
        groups = [{'params': list(g['params']), 'param_names': list(g['param_names']),
                   **Hypers(g).snapshot(),  # (no torch aliases: `momentum` is `mom`)
                   **group_settings(g),  # (low-bit state: stored as the wrapped one stores it)
                   'cbs': None if g['cbs'] is opt.cbs else list(g['cbs'])} for g in opt.param_groups]
        self._handles, self._hooked, self._index, self._stopped = [], set(), {}, False
        super().__init__(groups, list(opt.cbs), backend=opt.backend_options if backend is None else backend)
        self.defaults, self._given, self.frozen_idx = dict(opt.defaults), set(opt._given), opt.frozen_idx
        for p in opt.params:
            if p in param_states(opt): param_states(self)[p] = param_states(opt)[p]
        self._register(self.params)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def _register(self, params: list[torch.Tensor]) -> None:
        """Hook each of `params` that requires grad and is not hooked yet (a frozen param cannot be hooked: it is when
        `freeze_to` or `step()` finds it trainable), refusing one that another InBackward steps, all or none."""
        for k in [k for k, (p, _) in _OWNERS.items() if p() is None]: del _OWNERS[k]
        todo = [p for p in params if p.requires_grad and id(p) not in self._hooked]
        for p in todo:
            owner = _OWNERS.get(id(p))
            if owner is not None and owner[0]() is p and (other := owner[1]()) is not None and other is not self:
                raise ValueError(f"param {self._where(p)[1]!r} already steps in backward with another InBackward; call "
                                 "its remove_hooks() first, or it would step twice")
        me = weakref.ref(self)
        for p in todo:
            self._handles.append(p.register_post_accumulate_grad_hook(self._step_in_backward))
            self._hooked.add(id(p))
            _OWNERS[id(p)] = (weakref.ref(p), me)

    def remove_hooks(self) -> None:
        "Stop stepping in backward (grads then stay for `step()`, which steps them as the wrapped optimizer would)."
        for h in self._handles: h.remove()
        self._handles, self._hooked, self._stopped = [], set(), True
        for p in self.params:
            owner = _OWNERS.get(id(p))
            if owner is not None and owner[1]() is self: del _OWNERS[id(p)]

    @torch.no_grad()
    def _step_in_backward(self, p: torch.Tensor) -> None:
        "The post-accumulate-grad hook: step `p` alone with its group's chain and hypers, then free its grad."
        if p.grad is None: return
        g, name = self._where(p)
        if any(map(is_model_cb, g['cbs'])):  # appended to a chain since
            _refuse_model_scope(self)
        engine.check_grads(SimpleNamespace(param_groups=[{'param_names': [name], 'params': [p], 'cbs': g['cbs']}]))
        hyper = Hypers(g).snapshot()
        for c in lowbit_chunks(self, Bucket(g, [p], [param_states(self)[p]])):  # (low-bit state: fp32 while it steps)
            with as_real(c) as b:  # a complex param steps on its real view, as in `step`
                kernel = torch_kernel(b, hyper) if self.backend_options.kind in ('auto', 'fused') else None
                if kernel is not None: kernel()
                else: loop_bucket(self, b, hyper)
        p.grad = None

    def _where(self, p: torch.Tensor) -> tuple[dict, str]:
        "`p`'s group and name, through a cache checked on every use (groups may be added, params renamed)."
        hit = self._index.get(id(p))
        if hit is None or hit[1] >= len(hit[0]['params']) or hit[0]['params'][hit[1]] is not p:
            self._index = {id(q): (g, i) for g in self.param_groups for i, q in enumerate(g['params'])}
            hit = self._index.get(id(p))
            if hit is None: raise RuntimeError("a param hooked by InBackward is no longer in its groups")
        g, i = hit
        return g, g['param_names'][i]

    def freeze_to(self, n: int) -> None:
        "As `cbopt.Optimizer.freeze_to`; params it makes trainable step in backward too."
        super().freeze_to(n)
        if not self._stopped: self._register(self.params)

    # -- the torch.optim.Optimizer API -------------------------------------------------------------------------
    @property
    def _step_supports_amp_scaling(self) -> bool:
        "`torch.amp.GradScaler.step` asks this first: refuse it clearly, since the params stepped on scaled grads."
        raise TypeError("InBackward steps each param during backward, on its grad as backward computed it (scaled by "
                        "torch.amp.GradScaler), before the scaler can unscale it or check it for infs: use the scaler "
                        "with the wrapped optimizer instead, or a dtype that needs no scaler (bfloat16)")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """Run `closure` (its backward steps the params), then step the params that still hold a grad: only those
        given a grad by hand, since backward frees every grad it steps. Step hooks and LR schedulers see one step."""
        loss = None
        if closure is not None:
            with torch.enable_grad(): loss = closure()
        if any(p.grad is not None for p in self.params): engine.run_step(self)
        if not self._stopped: self._register(self.params)  # params unfrozen by hand since
        return loss

    def add_param_group(self, param_group: dict) -> None:
        "Add a group (as `cbopt.Optimizer` does) whose params then step in backward too."
        super().add_param_group(param_group)
        if self._building: return
        try: _refuse_model_scope(self)
        except ValueError:
            self.param_groups.pop()
            raise
        if not self._stopped: self._register(self.param_groups[-1]['params'])

    def __getstate__(self) -> dict:
        "Without the hook handles (a copy hooks its own params again, see `__setstate__`)."
        return {k: v for k, v in super().__getstate__().items() if k not in ('_handles', '_hooked', '_index')}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._handles, self._hooked, self._index = [], set(), {}
        if not self._stopped: self._register(self.params)

