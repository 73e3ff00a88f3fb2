"""fastai's Learner, as the only place in cbopt that knows about fastai.

`Learner(dls, model, opt_func=cbopt.Adam)` works unchanged, which needs two things fastai does not tell an optimizer:

- **Names.** A Learner hands `opt_func` unnamed param lists (its splitter's output). So that a Learner checkpoint is
  keyed like `learn.model.state_dict()`, and loads into a plain `cbopt.Adam(model.named_parameters())` and back,
  `name_from_learner` finds the Learner whose `create_opt` is building the optimizer and names the params by
  `learn.model`'s FQNs.
- **lr_find's restore.** `lr_find` saves the optimizer before it runs (often still fresh, so with no state) and loads
  it back after, through `load_model`, which turns any error into a "Could not load the optimizer state" warning. So
  when fastai's `load_model` is the caller, a checkpoint with no state at all restores the fresh state (as
  `clear_state()`, flags kept) instead of raising.

It also offers `RecordStepStats`, a fastai `Callback` recording what each step used (`opt.step_stats`: the lr of
every group after warmup and schedulers, the pre-clip grad norm, whether the step was skipped) per batch, for plots
next to `learn.recorder`'s. It is built on first access, which imports fastai: nothing else here does.

- **Train and eval modes.** A schedule-free optimizer trains at one point and is evaluated at another (the average of
  its iterates): `opt.eval()` before validating, `opt.train()` before training. fastai calls neither, so when a
  Learner creates an optimizer whose chains have modes (a `train_mode` hyper), `add_modes_callback` gives the Learner
  an `OptimizerModes` callback that does (once; built on first use, as `RecordStepStats`).

fastai passes neither hint, so both look up the call stack for fastai.learner's frames. This never imports fastai:
no frame can be fastai's unless `fastai.learner` is already imported. fastai's `Learner.fit` also calls
`opt.set_hypers(lr=..., wd=...)` and its schedules set `mom`: every cbopt optimizer accepts those.
"""
from __future__ import annotations

import sys
from types import FrameType

import torch

from .. import optimizer as _optimizer

__all__ = ['fastai_frame', 'learner_model', 'name_from_learner', 'fresh_ok_in_load_model', 'add_modes_callback',
           'RecordStepStats', 'OptimizerModes']

MAX_DEPTH = 10  # frames between fastai's create_opt/load_model and cbopt (opt_func partials, Optimizer.__init__)


def fastai_frame(fn: str, depth: int = MAX_DEPTH) -> FrameType | None:
    "The frame of fastai.learner's `fn` (`create_opt`, `load_model`, ...) if it is among our `depth` callers."
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


def name_from_learner(opt) -> None:
    "Name `opt`'s params by the FQNs of the Learner's model that is creating it (a no-op outside a Learner)."
    if (model := learner_model()) is not None: opt.name_params(model)


def fresh_ok_in_load_model(opt) -> bool:
    "Whether fastai's `load_model` (lr_find's restore) is loading: then a checkpoint with no state restarts `opt`."
    return fastai_frame('load_model', MAX_DEPTH + 2) is not None


_optimizer.on_create.append(name_from_learner)
def add_modes_callback(opt) -> None:
    "Give the Learner creating `opt` an `OptimizerModes` callback if `opt` has train and eval modes (and it has none)."
    if not any('train_mode' in g for g in opt.param_groups): return
    learn = learner()
    if learn is None: return
    cls = __getattr__('OptimizerModes')
    if not any(isinstance(cb, cls) for cb in learn.cbs): learn.add_cb(cls())


_optimizer.load_policies.append(fresh_ok_in_load_model)
_optimizer.on_create.append(add_modes_callback)


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


_BUILDERS = {'RecordStepStats': _record_step_stats_class, 'OptimizerModes': _optimizer_modes_class}
_BUILT: dict = {}


def __getattr__(name: str):
    "`RecordStepStats` and `OptimizerModes` are built, importing fastai, only when asked for."
    if name not in _BUILDERS: raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT: _BUILT[name] = _BUILDERS[name]()
    return _BUILT[name]
