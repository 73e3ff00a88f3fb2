"""fastai's Learner, as the only place in cbopt that knows about fastai.

`Learner(dls, model, opt_func=cbopt.Adam)` works unchanged, which needs things fastai does not tell an optimizer:

- **Names.** A Learner hands `opt_func` unnamed param lists (its splitter's output). So that a Learner checkpoint is
  keyed like `learn.model.state_dict()`, and loads into a plain `cbopt.Adam(model.named_parameters())` and back,
  `from_learner` finds the Learner whose `create_opt` is building the optimizer and names the params by
  `learn.model`'s FQNs. This is the one place that reads the call stack, because fastai has no hook there:
  `create_opt` calls `opt_func(splitter(model), lr=lr)` with nothing that leads to the Learner, and no Learner event
  comes between it and the optimizer's first use (`learn.load` loads right after `create_opt`, `export` reloads its
  state right after, `save` may come before any `fit`), so the names must be there when `opt_func` returns. The
  lookup never imports fastai: no frame can be fastai's unless `fastai.learner` is already imported.
- **Callbacks, for the rest.** Having found the Learner, cbopt gives it its own fastai `Callback`s (once each; later
  events reach them through fastai's own callback calls, with no stack lookup):
  - `LRFindRestore`, for **lr_find's restore.** `lr_find` saves the optimizer before it runs (often still fresh, so
    with no state) and loads it back after, through `load_model`, which turns any error into a "Could not load the
    optimizer state" warning; a strict load of a checkpoint with no state into an optimizer with state raises. So
    when an `LRFinder` fits and the optimizer was fresh at `before_fit`, `LRFindRestore` calls `opt.clear_state()`
    (flags kept) at `after_fit`, just before the `LRFinder` loads: the load of a fresh checkpoint into a fresh
    optimizer is then the ordinary strict one.
  - `OptimizerModes`, for **train and eval modes.** A schedule-free optimizer trains at one point and is evaluated at
    another (the average of its iterates): `opt.eval()` before validating, `opt.train()` before training. fastai
    calls neither, so a Learner whose optimizer's chains have modes (a `train_mode` hyper) gets `OptimizerModes`.

It also offers `RecordStepStats`, a fastai `Callback` recording what each step used (`opt.step_stats`: the lr of
every group after warmup and schedulers, the pre-clip grad norm, whether the step was skipped) per batch, for plots
next to `learn.recorder`'s. The callbacks are built on first use, which imports fastai: nothing else here does.
fastai's `Learner.fit` also calls `opt.set_hypers(lr=..., wd=...)` and its schedules set `mom`: every cbopt optimizer
accepts those.
"""
from __future__ import annotations

import sys
from types import FrameType

import torch

from .. import optimizer as _optimizer
from ..core.flags import split_flags
from ..core.runtime import param_states

__all__ = ['fastai_frame', 'learner', 'learner_model', 'from_learner', 'RecordStepStats', 'OptimizerModes',
           'LRFindRestore']

MAX_DEPTH = 10  # frames between fastai's create_opt and cbopt (opt_func partials, Optimizer.__init__)


def fastai_frame(fn: str, depth: int = MAX_DEPTH) -> FrameType | None:
    "The frame of fastai.learner's `fn` (`create_opt`) if it is among our `depth` callers."
    mod = sys.modules.get('fastai.learner')
    if mod is None: return None
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None: return None
        if frame.f_code.co_name == fn and (frame.f_globals is vars(mod)
                                           or isinstance(frame.f_locals.get('self'), mod.Learner)): return frame
        frame = frame.f_back
    return None


def learner(depth: int = MAX_DEPTH + 3):
    "The fastai Learner whose `create_opt` is building an optimizer, if any."
    frame = fastai_frame('create_opt', depth)
    return frame.f_locals.get('self') if frame else None


def learner_model() -> torch.nn.Module | None:
    "The model of the fastai Learner whose `create_opt` is building an optimizer, if any."
    return getattr(learner(), 'model', None)


def from_learner(opt) -> None:
    """If a Learner's `create_opt` is building `opt`: name its params by the FQNs of the Learner's model, and give the
    Learner `LRFindRestore` and, if `opt` has train and eval modes, `OptimizerModes` (each once). A no-op outside one."""
    learn = learner()
    if learn is None: return
    if getattr(learn, 'model', None) is not None: opt.name_params(learn.model)
    wanted = ['LRFindRestore'] + (['OptimizerModes'] if any('train_mode' in g for g in opt.param_groups) else [])
    for cls in map(__getattr__, wanted):
        if not any(isinstance(cb, cls) for cb in learn.cbs): learn.add_cb(cls())


_optimizer.on_create.append(from_learner)


def is_fresh(opt) -> bool:
    "Whether `opt` holds no algorithm state (flags such as fastai's `do_wd` aside): as built, or after `clear_state()`."
    return not any(split_flags(param_states(opt).get(p, {}))[0] for p in opt.params)


def _record_step_stats_class() -> type:
    "fastai's `Callback` recording `opt.step_stats` per batch (built on first use: it imports fastai)."
    from fastai.callback.core import Callback

    class RecordStepStats(Callback):
        """Record, after each training step, what it used (`learn.opt.step_stats`): `lrs` (one list per step, an lr
        per group, after warmup and schedulers), `grad_norms` (the pre-clip total norm as a float, None without
        `clip_grad_norm`/`track_grad_norm`) and `skipped` (a bool: skip_nonfinite or an accumulation micro-step).
        fastai attaches it as `learn.record_step_stats`; `plot()` draws the lr of each group and the grad norm."""
        order = 60  # after fastai's ParamScheduler (50) and before the Recorder's after_batch; it records after_step

        def before_fit(self): self.lrs, self.grad_norms, self.skipped = [], [], []

        def after_step(self):
            st = getattr(self.learn.opt, 'step_stats', None) or {}
            norm = st.get('grad_norm')
            self.lrs.append([float(lr) for lr in st.get('lr', [])])
            self.grad_norms.append(None if norm is None else float(norm))
            self.skipped.append(bool(st.get('skipped', False)))

        def plot(self, figsize=(10, 3)):
            "The lr of each group and the grad norm at each step (skipped steps marked), side by side."
            import matplotlib.pyplot as plt
            fig, (ax_lr, ax_norm) = plt.subplots(1, 2, figsize=figsize)
            for i, lrs in enumerate(zip(*self.lrs)): ax_lr.plot(lrs, label=f'group {i}')
            ax_lr.set(title='lr used', xlabel='step'); ax_lr.legend()
            steps = [i for i, n in enumerate(self.grad_norms) if n is not None]
            ax_norm.plot(steps, [self.grad_norms[i] for i in steps])
            skipped = [i for i, s in enumerate(self.skipped) if s and self.grad_norms[i] is not None]
            ax_norm.scatter(skipped, [self.grad_norms[i] for i in skipped], c='r', marker='x', label='skipped')
            ax_norm.set(title='grad norm (pre-clip)', xlabel='step', yscale='log'); ax_norm.legend()
            return fig

    RecordStepStats.__qualname__ = 'RecordStepStats'  # pickled (learn.export) by this module's name, found through __getattr__
    return RecordStepStats


def _optimizer_modes_class() -> type:
    "fastai's `Callback` putting a schedule-free optimizer in train mode to train and eval mode to validate."
    from fastai.callback.core import Callback

    class OptimizerModes(Callback):
        """`learn.opt.train()` before each training phase, `learn.opt.eval()` before each validation (and `get_preds`),
        so that validation sees a schedule-free optimizer's averaged weights and training its own point. Added by
        cbopt to a Learner whose optimizer has modes; after `fit` the model holds the averaged weights."""
        order = -5  # early: the params are in place before any other callback of the phase reads them

        def before_train(self):
            if self.learn.opt is not None: self.learn.opt.train()

        def before_validate(self):
            if self.learn.opt is not None: self.learn.opt.eval()

    OptimizerModes.__qualname__ = 'OptimizerModes'  # pickled (learn.export) by this module's name, found through __getattr__
    return OptimizerModes


def _lr_find_restore_class() -> type:
    "fastai's `Callback` letting lr_find restore a fresh optimizer (see the module docstring)."
    from fastai.callback.core import Callback
    from fastai.callback.schedule import LRFinder

    class LRFindRestore(Callback):
        """While an `LRFinder` fits: if the optimizer was fresh (no algorithm state) at `before_fit`, `opt.clear_state()`
        at `after_fit`, just before the `LRFinder` loads back the checkpoint it saved then. So lr_find on a fresh
        optimizer leaves it fresh (flags kept), through fastai's ordinary strict load, with no warning. Added by cbopt to
        a Learner that creates a cbopt optimizer."""
        order = LRFinder.order - 1  # after_fit runs in order: just before the LRFinder's, which loads its checkpoint
        fresh = False

        def before_fit(self):
            opt = self.learn.opt
            self.fresh = (isinstance(opt, _optimizer.Optimizer) and is_fresh(opt)
                          and any(isinstance(cb, LRFinder) for cb in self.learn.cbs))

        def after_fit(self):
            if self.fresh and self.learn.opt is not None: self.learn.opt.clear_state()
            self.fresh = False

    LRFindRestore.__qualname__ = 'LRFindRestore'  # pickled (learn.export) by this module's name, found through __getattr__
    return LRFindRestore


_BUILDERS = {'RecordStepStats': _record_step_stats_class, 'OptimizerModes': _optimizer_modes_class,
             'LRFindRestore': _lr_find_restore_class}
_BUILT: dict = {}


def __getattr__(name: str):
    "`RecordStepStats`, `OptimizerModes` and `LRFindRestore` are built, importing fastai, only when asked for."
    if name not in _BUILDERS: raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT: _BUILT[name] = _BUILDERS[name]()
    return _BUILT[name]
