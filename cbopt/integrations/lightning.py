"""Lightning: `LRFindRestore`, the callback that lets `Tuner.lr_find` (and Lightning's `LearningRateFinder`) restore
its checkpoint into a cbopt optimizer. Imports Lightning only when `LRFindRestore` is first asked for.

lr_find saves a checkpoint before its first step, steps, then loads that checkpoint back. A cbopt optimizer's load is
strict: a checkpoint without state for params that have state now would silently restart them, so it is refused
(`load_state_dict`: "call clear_state() first"). `LRFindRestore` is that explicit call, made where Lightning restores
the lr_find checkpoint (its `on_load_checkpoint`, which runs before the optimizers load), for the optimizers that
the checkpoint saved with no state: they come back fresh, as torch's AdamW does (the same pattern as fastai's
`cbopt.integrations.fastai.LRFindRestore`). Writes through `self.optimizers()` (`LightningOptimizer`) reach the
optimizer without any callback: see `cbopt.Optimizer.__setattr__`."""
from __future__ import annotations

__all__ = ['LRFindRestore']


def _lr_find_restore_class():
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import LearningRateFinder

    from .. import optimizer as _optimizer
    from ..core.flags import split_flags

    class LRFindRestore(Callback):
        """Clear the state of each cbopt optimizer that the checkpoint being restored saved with no state, while an
        lr finder runs (a `LearningRateFinder` among the trainer's callbacks: `Tuner.lr_find` adds one), so its strict
        load restores the fresh optimizer lr_find started from. `Trainer(callbacks=[LRFindRestore()])`."""

        def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
            if not any(isinstance(cb, LearningRateFinder) for cb in trainer.callbacks): return
            for opt, saved in zip(trainer.optimizers, checkpoint.get('optimizer_states', [])):
                empty = not any(split_flags(s)[0] for s in saved.get('state', {}).values() if isinstance(s, dict))
                if isinstance(opt, _optimizer.Optimizer) and empty: opt.clear_state()

    LRFindRestore.__module__ = __name__
    LRFindRestore.__qualname__ = 'LRFindRestore'
    return LRFindRestore


_BUILT: dict = {}


def __getattr__(name: str):
    "`LRFindRestore` is built, importing Lightning, only when asked for."
    if name != 'LRFindRestore': raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT: _BUILT[name] = _lr_find_restore_class()
    return _BUILT[name]
